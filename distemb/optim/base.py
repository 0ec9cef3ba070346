"""SparseOptimizer: collects traces, deduplicates, routes; subclasses own the maths.

``step()`` takes every lookup recorded by each table since the last step, concatenates
ids and gradients, sums the gradients of duplicate ids (as PyTorch does; DGL averages
them), and pushes one update per table to the rows' owner, which runs the subclass's
fused rule in place (:mod:`distemb.rules`). ``step()`` consumes the trace: a second
``step()`` without new lookups is a no-op. In synchronous-exact mode
(``client.needs_every_step``) a table without gradients still pushes an empty update, so
every table's step count advances on every ``step()``.

Where gradients are summed follows the data: a GPU-resident table (``emb.kvstore.device``
set) sums and updates on its device with its client's kernels (``emb.kvstore.ops``); a
host table whose lookups returned rows on a GPU (``emb(ids, device='cuda')``) sums on
that GPU and copies only the unique rows' sums to the host; otherwise everything stays
in numpy on the host.

Optimizers subclass ``torch.optim.Optimizer`` so that LR schedulers drive them through
``param_groups`` (one group; ``params`` is empty because tables are not torch tensors).

Example:
    >>> import torch
    >>> from distemb import DistEmbedding, SparseAdagrad
    >>> opt = SparseAdagrad([DistEmbedding(5, 2, name="doc-base")], lr=1.0)
    >>> isinstance(opt, SparseOptimizer), isinstance(opt, torch.optim.Optimizer)
    (True, True)
"""
import numpy as np
import torch

from distemb import checkpoint, kernels
from distemb.kernels import cuda
from distemb.embedding import DistEmbedding
from distemb.errors import DistEmbError
from distemb.tensor import DistTensor


def check_hyper(name, value, low=0.0, high=None, low_open=False):
    """Validate one hyperparameter; the error names it and its range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        rng = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and < {high}")
        raise ValueError(f"{name}: expected a number {rng}, got {value!r}")
    return float(value)


class SparseOptimizer(torch.optim.Optimizer):
    """Base of distemb's sparse optimizers.

    Subclasses set ``rule`` (a key of :data:`distemb.rules.RULES`), optionally
    ``rule_options()`` (state initialisation), and ``hyper(group, step)`` (the plain-float
    hyperparameters of one step of one table).

    Args:
        params: list of :class:`~distemb.embedding.DistEmbedding` to optimise.
        defaults: hyperparameters of the one param group (``lr`` among them).
    """

    rule = ""

    def __init__(self, params, defaults):
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
        self._embs = params
        self._steps = {p.name: 0 for p in params}
        self._sum_buffers = {}
        for emb in params:
            emb._optm_state = emb.kvstore.init_optimizer(emb.name, self.rule,
                                                         self.rule_options())

    def rule_options(self):
        """Options the rule's state initialisation reads (e.g. initial accumulator)."""
        return {}

    def hyper(self, group, step):
        """The hyperparameters of one update at global step ``step``."""
        raise NotImplementedError

    @property
    def embeddings(self):
        return list(self._embs)

    # Compatibility aliases of dgl.distributed.optim's attributes, which DGL code (its
    # own tests among it) reads and sets; the param group stays the one source of truth.
    @property
    def _lr(self):
        return self.param_groups[0]["lr"]

    @_lr.setter
    def _lr(self, value):
        self.param_groups[0]["lr"] = check_hyper("_lr", value)

    @property
    def _eps(self):
        if "eps" not in self.param_groups[0]:
            raise AttributeError(f"{type(self).__name__} has no eps (no _eps)")
        return self.param_groups[0]["eps"]

    @_eps.setter
    def _eps(self, value):
        self.param_groups[0]["eps"] = check_hyper("_eps", value)

    @property
    def _state(self):
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
                meta = emb.kvstore.data_meta(names[sname])
                tensors.append(DistTensor(meta.shape, meta.dtype, name=names[sname],
                                          part_policy=emb.part_policy,
                                          context=emb.weight.context, device=emb.device))
            out[emb.name] = tensors[0] if len(tensors) == 1 else tuple(tensors)
        return out

    def zero_grad(self, set_to_none=True):
        """Drop the gradients of earlier backward passes, wherever it sits in the loop.

        Lookups whose backward has not run yet are kept, so ``out = model(x);
        opt.zero_grad(); loss.backward(); opt.step()`` trains (DGL 1.1.3 gets there by
        clearing its trace only after the next ``step()``).
        """
        for emb in self._embs:
            emb.drop_gradients()

    @staticmethod
    def _gradients(emb):
        """(ids, grads) lists of the traced lookups of ``emb`` whose backward has run."""
        done = emb.pop_gradients()
        return [i for i, _ in done], [g for _, g in done]

    @staticmethod
    def _host_arrays(ids, grads):
        """The traced ids and gradients as numpy arrays, concatenated."""
        g = grads[0] if len(grads) == 1 else torch.cat(grads)
        g = g.detach().to("cpu", torch.float32).contiguous().numpy()
        return (ids[0] if len(ids) == 1 else np.concatenate(ids)), g

    @staticmethod
    def _device_dedup(ops, device, ids, grads, emb, num_threads):
        """Sum duplicate ids' gradients on ``device`` with ``ops.dedup_sum``."""
        ids = [torch.as_tensor(i).to(device) for i in ids]  # host ids: numpy int64
        grads = [g.to(device) for g in grads]
        ids = ids[0] if len(ids) == 1 else torch.cat(ids)
        g = (grads[0] if len(grads) == 1 else torch.cat(grads)).to(torch.float32).contiguous()
        return ops.dedup_sum(ids, g, num_rows=emb.num_embeddings, num_threads=num_threads)

    def _summed(self, emb, ids, grads):
        """(unique ids, summed gradients) in the arrays of ``emb.kvstore``; None if empty."""
        kv, nt = emb.kvstore, emb.weight.context.num_threads
        if kv.device is not None:  # a GPU-resident table: never leave its device
            return self._device_dedup(kv.ops, kv.device, ids, grads, emb, nt) if ids else None
        on_gpu = [g.device for g in grads if g.is_cuda]
        if on_gpu:  # rows were looked up onto a GPU: sum there, move only the sums
            uniq, summed = self._device_dedup(cuda, on_gpu[0], ids, grads, emb, nt)
            return uniq.cpu().numpy(), summed.cpu().numpy()
        if not ids:
            if not kv.needs_every_step:
                return None
            # sync_exact: the servers wait for every trainer's push of this step, so a
            # trainer without rows pushes an empty one (and counts the step like the rest).
            return np.empty(0, np.int64), np.empty((0, emb.embedding_dim), np.float32)
        host_ids, host_grads = self._host_arrays(ids, grads)
        return kernels.dedup_sum(host_ids, host_grads, nt,
                                 out=self._sum_buffer(emb, len(host_ids)))

    @torch.no_grad()
    def step(self, closure=None):
        """Apply the traced gradients of every table and remove them from the traces."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        for emb in self._embs:
            ids, grads = self._gradients(emb)  # lookups awaiting backward stay traced
            summed = self._summed(emb, ids, grads)
            if summed is None:
                continue
            uniq, summed = summed
            self._steps[emb.name] += 1
            emb.kvstore.push_update(emb.name, uniq, summed, self.rule,
                                    self.hyper(group, self._steps[emb.name]))
        return loss

    def _sum_buffer(self, emb, n):
        """This table's reusable buffer for summed gradients, at least ``n`` rows.

        Reuse is safe: ``push_update`` consumes the sums before it returns (KVClient
        contract); it spares a fresh (N, D) allocation, and its first touch, every step.
        """
        buf = self._sum_buffers.get(emb.name)
        if buf is None or buf.shape[0] < n:
            buf = np.empty((n, emb.embedding_dim), dtype=np.float32)
            self._sum_buffers[emb.name] = buf
        return buf

    def _state_names(self, emb):
        return dict(emb.optm_state or {})

    def state_dict(self):
        """Steps, state tensors (whole, as torch tensors) and param_groups."""
        state = {}
        for emb in self._embs:
            entry = {"step": self._steps[emb.name]}
            for sname, kvname in self._state_names(emb).items():
                entry[sname] = torch.from_numpy(checkpoint._all_rows(emb.kvstore, kvname))
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
            for sname, kvname in self._state_names(emb).items():
                if sname not in entry:
                    raise DistEmbError(f"state_dict: table {emb.name!r} lacks state {sname!r}")
                arr = np.ascontiguousarray(np.asarray(entry[sname]))
                meta = emb.kvstore.data_meta(kvname)
                if arr.shape != meta.shape:
                    raise DistEmbError(f"state_dict: state {sname!r} of {emb.name!r} has shape "
                                       f"{arr.shape}, expected {meta.shape}")
                kv = emb.kvstore
                kv.push(kvname, kv.from_host(np.arange(arr.shape[0], dtype=np.int64)),
                        kv.from_host(arr.astype(meta.dtype, copy=False)))
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

    def save(self, path):
        """Save every table's rows and this optimizer's state to ``path`` (.npz).

        Collective, as DGL's: every trainer calls it. After a barrier (every trainer's
        updates have landed), rank 0 alone writes the one checkpoint (a temporary file,
        then a rename), and a second barrier keeps every rank waiting until the file is
        complete. A save on rank 0 only waits at the barrier for the others.
        """
        client, writer = self._collective()
        client.barrier()
        if writer:
            names = []
            for emb in self._embs:
                names += [emb.name] + list(self._state_names(emb).values())
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
            checkpoint.save(path, self._embs[0].kvstore, names,
                            {"optimizer": type(self).__name__, "rule": self.rule,
                             "steps": self._steps, "param_groups": groups})
        client.barrier()

    def load(self, path):
        """Restore rows and state saved by :meth:`save` (the tables may be resharded).

        Collective: every trainer calls it, with any number of trainers (not necessarily
        the number that saved). Every rank reads the step counts and hyperparameters;
        rank 0 alone pushes the rows and state, between two barriers, so no rank trains
        on half-restored rows.
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
            if writer:
                names = [emb.name] + list(self._state_names(emb).values())
                checkpoint.restore(path, emb.kvstore, names)
            self._steps[emb.name] = int(meta["steps"][emb.name])
        self._load_groups(meta["param_groups"])
        client.barrier()
