"""SparseOptimizer: takes each table's traced gradients and pushes one update per table.

``step()`` asks every table for its traced gradients summed per id (DESIGN.md: summed,
as PyTorch does; DGL averages them) and pushes them, with the hyperparameters of the
subclass's rule, to the rows' owner, which runs the fused rule in place
(:mod:`distemb.rules`). Where the sums are made is the business of the client that
placed the rows (:mod:`distemb.kvstore.types`): a host table sums in numpy, a GPU table
on its GPU, a host table looked up onto a GPU on that GPU (only the sums come back), and
a synchronous-exact cluster client pushes an empty update when there is nothing, so every
trainer's step reaches the servers. ``step()`` consumes the lookups whose backward has
run: a second ``step()`` without new lookups is a no-op, and a lookup still waiting for
its backward stays traced for the next one. ``zero_grad()`` drops gradients of earlier
backward passes only, so it may sit anywhere in the loop (torch's idiom calls it between
forward and backward).

Optimizers subclass ``torch.optim.Optimizer`` so that LR schedulers drive them through
``param_groups`` (one group; ``params`` is empty because tables are not torch tensors),
and ``step()`` runs torch's step hooks (``register_step_pre_hook``/``post_hook``, and the
global ones). With ``check_finite=True`` a step whose gradients hold NaN or infinity is
refused whole before any row changes (:class:`~distemb.errors.NonFiniteGradientError`
naming the table), on every placement: otherwise one bad batch turns its rows into NaN,
and on servers every trainer then reads them. torch would also wrap ``step()`` in a profiler range
(``Optimizer.step#...``); distemb's is left unwrapped: entering that range costs about
0.15 ms a call, measured at 6-7% of a whole embedded step on one core (bench_step,
Adagrad, zipf ids), and a sparse step has nothing of torch's inside to attribute.

Example:
    >>> import torch
    >>> from distemb import DistEmbedding, SparseAdagrad
    >>> opt = SparseAdagrad([DistEmbedding(5, 2, name="doc-base")], lr=1.0)
    >>> isinstance(opt, SparseOptimizer), isinstance(opt, torch.optim.Optimizer)
    (True, True)
"""
from itertools import chain
from typing import Callable, Dict, Iterable, List, Optional, Union

import numpy as np
import torch
from torch.optim import optimizer as torch_optimizer

from distemb import checkpoint
from distemb.embedding import DistEmbedding
from distemb.errors import DistEmbError
from distemb.kvstore.types import TableGradients
from distemb.rules import Hyper, RuleName
from distemb.tensor import DistTensor

#: torch's add_param_group as written, under its ``torch._disable_dynamo`` wrapper (the
#: wrapper's own function where a torch version wraps it otherwise)
_TORCH_ADD_PARAM_GROUP = getattr(torch_optimizer.Optimizer.add_param_group, "__wrapped__",
                                 torch_optimizer.Optimizer.add_param_group)

#: Rows of optimizer state pushed per request by ``load_state_dict`` (as checkpoints do).
STATE_CHUNK_ROWS = checkpoint.CHUNK_ROWS


def check_hyper(name: str, value, low: float = 0.0, high: Optional[float] = None,
                low_open: bool = False) -> float:
    """Validate one hyperparameter; the error names it and its range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        rng = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and < {high}")
        raise ValueError(f"{name}: expected a number {rng}, got {value!r}")
    return float(value)


def all_finite(grads: List[torch.Tensor]) -> bool:
    """Whether no gradient of ``grads`` holds NaN or infinity (True for none).

    One sum per gradient, on its device: NaN and infinities carry into the sum (``inf -
    inf`` is NaN), so a finite sum means finite gradients. It is the cheapest pass found
    (``torch.isfinite(g).all()`` writes a mask first): 40 us for a 4,096 x 128 gradient
    against a 1.29 ms Adagrad step, 3.1% (fastest of 3,000 and of 300, a shared 2-core
    AMD EPYC; docs/performance.md). A batch whose finite gradients sum past float32's
    range (3.4e38) counts as not finite too.
    """
    return all(bool(torch.isfinite(g.sum())) for g in grads)


class SparseOptimizer(torch.optim.Optimizer):
    """Base of distemb's sparse optimizers.

    Subclasses set ``rule`` (a :class:`~distemb.rules.RuleName`), optionally
    ``rule_options()`` (state initialisation), and ``hyper(group, step)`` (the rule's
    hyperparameter dataclass for one step of one table).

    Args:
        params: list of :class:`~distemb.embedding.DistEmbedding` to optimise.
        defaults: hyperparameters of the one param group (``lr`` among them).
        check_finite: every optimizer's keyword: ``step()`` refuses a step whose gradients
            hold NaN or infinity, before any row changes
            (:class:`~distemb.errors.NonFiniteGradientError`). Off by default: the check
            (:func:`all_finite`) costs 3-4% of an embedded step (one pass over the
            gradients beside the fused kernels), more than the ~2% a default may cost.
    """

    rule: RuleName

    def __init__(self, params: Union[DistEmbedding, Iterable[DistEmbedding]], defaults: dict,
                 check_finite: bool = False):
        if isinstance(params, DistEmbedding):
            params = [params]
        params = list(params)
        if not params:
            raise ValueError("params: expected a non-empty list of DistEmbedding, got []")
        for i, p in enumerate(params):
            if not isinstance(p, DistEmbedding):
                raise TypeError(f"params[{i}]: expected a DistEmbedding, got {type(p).__name__}")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"params: each DistEmbedding may appear once, got names {names}")
        super().__init__([{"params": []}], defaults)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite: expected True or False, got {check_finite!r}")
        #: Whether step() refuses gradients holding NaN or infinity (see the class).
        self.check_finite = check_finite
        self._embs = params
        self._steps = {p.name: 0 for p in params}
        for emb in params:
            emb.optm_state = emb.kvstore.init_optimizer(emb.name, self.rule,
                                                        self.rule_options())

    def rule_options(self) -> dict:
        """Options the rule's state initialisation reads (e.g. initial accumulator)."""
        return {}

    def hyper(self, group: dict, step: int) -> Hyper:
        """The hyperparameters of one update at global step ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must define hyper()")

    @property
    def embeddings(self) -> List[DistEmbedding]:
        return list(self._embs)

    # Compatibility aliases of dgl.distributed.optim's attributes, which DGL code (its
    # own tests among it) reads and sets; the param group stays the one source of truth.
    @property
    def _lr(self) -> float:
        return self.param_groups[0]["lr"]

    @_lr.setter
    def _lr(self, value: float) -> None:
        self.param_groups[0]["lr"] = check_hyper("_lr", value)

    @property
    def _eps(self) -> float:
        if "eps" not in self.param_groups[0]:
            raise AttributeError(f"{type(self).__name__} has no eps (no _eps)")
        return self.param_groups[0]["eps"]

    @_eps.setter
    def _eps(self, value: float) -> None:
        self.param_groups[0]["eps"] = check_hyper("_eps", value)

    @property
    def _state(self) -> Dict[str, Union[DistTensor, tuple]]:
        """DGL's ``opt._state``: table name -> its state as DistTensor(s).

        One state (Adagrad's ``sum``): the DistTensor; several: a tuple in DGL's order
        where DGL has it (Adam: ``row_step`` first when counted per row, then
        ``exp_avg``, ``exp_avg_sq``). Reads and writes go to the live state.
        """
        out = {}
        for emb in self._embs:
            names = self._state_names(emb)
            order = sorted(names, key=lambda s: s != "row_step")  # DGL: step, mem, power
            tensors = []
            for sname in order:
                tensors.append(DistTensor.attach(names[sname], emb.weight.context,
                                                 emb.device))
            out[emb.name] = tensors[0] if len(tensors) == 1 else tuple(tensors)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of earlier backward passes, wherever it sits in the loop.

        Lookups whose backward has not run yet are kept, so ``out = model(x);
        opt.zero_grad(); loss.backward(); opt.step()`` trains (DGL 1.1.3 gets there by
        clearing its trace only after the next ``step()``).
        """
        for emb in self._embs:
            emb.drop_gradients()

    def add_param_group(self, param_group: dict) -> None:
        """torch's :meth:`torch.optim.Optimizer.add_param_group` (which ``__init__`` calls),
        run without the wrapper that keeps ``torch.compile`` out of it: that wrapper
        imports ``torch._dynamo`` at its first call, ~1.4 s of CPU in every process that
        makes an optimizer, and a sparse optimizer's steps are never compiled."""
        _TORCH_ADD_PARAM_GROUP(self, param_group)

    def _patch_step_function(self) -> None:
        """Leave ``step()`` unwrapped: torch.optim.Optimizer.__init__ calls this to wrap a
        class's step in a profiler range and its hooks; :meth:`step` runs the hooks
        itself (see the module docstring for why not the range)."""
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def step(self, closure: Optional[Callable] = None):
        """Apply the traced gradients of every table and remove them from the traces.

        Lookups whose backward has not run yet stay traced for the next ``step()``.
        Step pre-hooks run first (one may return new ``(args, kwargs)``), post-hooks
        last, as torch.optim.Optimizer runs them.

        Raises:
            NonFiniteGradientError: with ``check_finite``, a table's gradients hold NaN or
                infinity (the message names it): nothing of the step is applied, on any
                table (in a collective job: on any rank), the step counts stay, and its
                gradients are dropped.
        """
        args, kwargs = (self,), ({} if closure is None else {"closure": closure})
        for hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                          self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{hook} must return None or a tuple of (new_args, "
                                       f"new_kwargs), but got {result}.")
                args, kwargs = result
        loss = self._step(*args[1:], **kwargs)
        for hook in chain(self._optimizer_step_post_hooks.values(),
                          torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, args, kwargs)
        return loss

    def _step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():  # (as a with: torch's decorator clones its context per call)
            self._apply()
        return loss

    def _apply(self) -> None:
        """Push every table's traced gradients (see :meth:`step`)."""
        group = self.param_groups[0]
        # Every table's gradients go to its client in one call per client: a collective
        # client sends all of them in one exchange; the others push table by table.
        by_client = {}
        for emb in self._embs:
            client, ids, grads = emb.take_gradients()
            hyper = self.hyper(group, self._steps[emb.name] + 1)  # should it step
            entry = by_client.setdefault(id(client), (client, emb.weight.context.F, [], []))
            entry[2].append(TableGradients(emb.name, ids, grads, self.rule, hyper,
                                           not self.check_finite or all_finite(grads)))
            entry[3].append(emb.name)
        # A client holding a table whose gradients are not finite goes first: it refuses
        # the step (every rank of a collective job together) before any client applies.
        for client, F, tables, names in sorted(by_client.values(),
                                               key=lambda e: all(t.finite for t in e[2])):
            for name, stepped in zip(names, client.apply_gradients(tables, F)):
                self._steps[name] += bool(stepped)

    def _state_names(self, emb):
        return dict(emb.optm_state or {})

    def state_dict(self):
        """Steps, state (every key's, as torch tensors) and param_groups.

        Every table's entry has its ``"step"``, ``"keys"`` (int64, ascending) and one
        array of rows per state, in that order.
        """
        state = {}
        for emb in self._embs:
            entry = {"step": self._steps[emb.name]}
            rows = emb.kvstore.table_state(emb.name, self._state_names(emb))
            entry.update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rows.items()})
            state[emb.name] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` returned (tables must have the same shapes)."""
        state = state_dict.get("state", {})
        for emb in self._embs:
            if emb.name not in state:
                raise DistEmbError(f"state_dict: no state for table {emb.name!r} "
                                   f"(has {sorted(state)})")
            entry = state[emb.name]
            emb.kvstore.load_table_state(emb.name, self._state_names(emb), entry)
            self._steps[emb.name] = int(entry["step"])
        self._load_groups(state_dict["param_groups"])

    def _load_groups(self, groups):
        if len(groups) != len(self.param_groups):
            raise DistEmbError(f"param_groups: expected {len(self.param_groups)} group(s), "
                               f"got {len(groups)}")
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: (tuple(v) if isinstance(v, list) else v)
                         for k, v in saved.items() if k != "params"})

    def _collective(self):
        """(client whose barrier spans every trainer, whether this process writes)."""
        ctx = self._embs[0].weight.context
        return ctx.client, ctx.rank == 0

    def save(self, path, incremental=False):
        """Save every table's rows and this optimizer's state as checkpoint ``path``.

        Collective, as DGL's: every trainer calls it. After a barrier (every trainer's
        updates have landed), rank 0 alone starts the one checkpoint (the servers write
        their shards, then the manifest), and a second barrier keeps every rank waiting
        until it is complete. A save on rank 0 only waits at the barrier for the others.
        In collective mode every rank writes its own shards and rank 0 the manifest.

        With ``incremental=True``, after a full save (or a load) of ``path``, only the
        rows changed since the last save there, and the keys removed or evicted since,
        are written, as a delta that :meth:`load` replays after the saves before it
        (:mod:`distemb.kvstore.checkpoint.chain`); crash-safe as a full save is.

        Raises:
            DistEmbError: an incremental save where no checkpoint is, of other tables or
                optimizer state than the last save there, or of tables that did not make
                or load that save (make a full save).
        """
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental: expected a bool, got {incremental!r:.40}")
        client, writer = self._collective()
        client.barrier()
        if writer or client.all_ranks_checkpoint:  # collective: each rank its own shards
            items = []
            for emb in self._embs:  # a table and its states: one entry, a column each
                items += [(emb.kvstore, n) for n in
                          [emb.name] + list(self._state_names(emb).values())]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
            checkpoint.save_items(path, items,
                                  {"optimizer": type(self).__name__, "rule": self.rule,
                                   "steps": self._steps, "param_groups": groups},
                                  writer=writer, incremental=incremental)
        client.barrier()

    def load(self, path):
        """Restore rows and state saved by :meth:`save` (the tables may be resharded): a
        full save and every incremental save after it, in order.

        Collective: every trainer calls it, with any number of trainers (not necessarily
        the number that saved). Every rank reads the step counts and hyperparameters;
        rank 0 alone pushes the rows and state (in collective mode every rank reads its
        own shards), between two barriers, so no rank trains on half-restored rows.
        """
        meta = checkpoint.read_meta(path)
        if meta.get("rule") != self.rule:
            raise DistEmbError(f"{path}: saved by {meta.get('optimizer')} (rule "
                               f"{meta.get('rule')!r}), cannot load into {type(self).__name__}")
        missing = [emb.name for emb in self._embs if emb.name not in meta["steps"]]
        if missing:
            raise DistEmbError(f"{path}: has no table(s) {missing} (has {sorted(meta['steps'])})")
        client, writer = self._collective()
        client.barrier()
        for emb in self._embs:
            if writer or client.all_ranks_checkpoint:
                checkpoint.restore(path, emb.kvstore,
                                   [emb.name] + list(self._state_names(emb).values()))
            self._steps[emb.name] = int(meta["steps"][emb.name])
        self._load_groups(meta["param_groups"])
        client.barrier()
