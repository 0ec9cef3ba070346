"""Update rules: the per-row maths of each sparse optimizer, run by the rows' owner.

A rule names its state tensors, declares its hyperparameters as a frozen dataclass, and
applies one fused, in-place kernel to the rows a push touched. Rules run wherever rows
live (the embedded process, the server owning a shard, or a GPU), so ``apply`` takes the
kernel implementation of those rows' arrays as ``ops`` (any :class:`~distemb.kernels.ops.
KernelOps`: :mod:`distemb.kernels` for numpy arrays, :mod:`distemb.kernels.cuda` for torch
CUDA tensors). Optimizers in :mod:`distemb.optim` choose the rule and compute its
hyperparameters for each step; on the wire they travel as the dataclass's fields and are
checked against the rule on decode (:meth:`UpdateRule.hyper_from`).

Concurrency: ``apply`` assumes it is the only writer of those rows and their state for
its duration (DESIGN.md, Concurrency): the KVServer serialises updates per shard, and a
device client enqueues them on one stream in call order.

Example:
    >>> import numpy as np
    >>> from distemb import kernels
    >>> rule = rule_of("sgd")
    >>> w = np.ones((3, 2), np.float32)
    >>> rule.apply(kernels, w, {}, np.array([1]), np.ones((1, 2), np.float32), SGDHyper(lr=0.5))
    >>> w[1].tolist()
    [0.5, 0.5]
"""
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type

import numpy as np

from distemb.arrays import Array, Rows, UniqueIds
from distemb.enums import Choice
from distemb.errors import KVStoreError


class RuleName(Choice):
    """The update rules a table can be optimised with (the wire carries ``.value``)."""

    #: plain SGD: ``w -= lr * g``; no state.
    SGD = "sgd"
    #: torch.optim.Adagrad: one accumulator per element.
    ADAGRAD = "adagrad"
    #: row-wise Adagrad (PyTorch-BigGraph, FBGEMM): one accumulator per row.
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    #: torch.optim.SparseAdam: bias correction by the optimizer's global step count.
    ADAM = "adam"
    #: lazy Adam whose bias correction counts each row's own updates (DGL's SparseAdam).
    ADAM_ROW_STEP = "adam_row_step"
    #: FTRL-Proximal as tf.keras.optimizers.Ftrl: an accumulator and a linear term per
    #: element.
    FTRL = "ftrl"


@dataclass(frozen=True)
class Hyper:
    """Base of the hyperparameters of one update of one table (plain numbers).

    Every field is a float unless annotated ``int``; :meth:`UpdateRule.hyper_from` checks
    a decoded dict against the fields and names the one that is wrong.
    """

    def fields(self) -> Dict[str, Any]:
        """The fields as a plain dict (what the wire carries)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SGDHyper(Hyper):
    lr: float


@dataclass(frozen=True)
class AdagradHyper(Hyper):
    #: the learning rate of this step, lr decay applied: ``lr / (1 + (step - 1) * decay)``.
    clr: float
    eps: float


@dataclass(frozen=True)
class AdamHyper(Hyper):
    lr: float
    beta1: float
    beta2: float
    eps: float
    #: the optimizer's step count of this table (the first step is 1); per-row-step Adam
    #: ignores it.
    step: int


@dataclass(frozen=True)
class FtrlHyper(Hyper):
    lr: float
    #: the accumulator's power (Keras' learning_rate_power, <= 0): -0.5 scales like
    #: Adagrad, 0 keeps the rate fixed.
    lr_power: float
    l1: float
    l2: float
    l2_shrinkage: float
    #: Keras' beta: adds ``beta / (2 lr)`` to ``l2``.
    beta: float


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor kept beside each row: per element or per row."""

    name: str
    per_row: bool
    dtype: str = "float32"
    init_option: str = ""  # option naming the initial value; 0 when empty

    def shape(self, dim: int) -> Tuple[int, ...]:
        return () if self.per_row else (dim,)


@functools.lru_cache(maxsize=None)
def _declared_fields(hyper_type) -> Dict[str, Any]:
    """{field name: its type} of a hyperparameter dataclass (read once per type: every
    update a server decodes checks its fields against them)."""
    return {f.name: f.type for f in dataclasses.fields(hyper_type)}


@functools.lru_cache(maxsize=256)
def _cached_hyper(rule: "UpdateRule", key) -> Hyper:
    """``rule``'s checked hyperparameters of the fields ``key`` lists as (name, type,
    value) (:meth:`UpdateRule.hyper_from`; a refused dict raises and is not kept)."""
    return rule._hyper_from({name: value for name, _, value in key})


class UpdateRule:
    """Interface: ``states`` (what to keep per row), ``hyper_type`` and the fused ``apply``."""

    name: ClassVar[RuleName]
    states: ClassVar[Tuple[StateSpec, ...]] = ()
    hyper_type: ClassVar[Type[Hyper]] = Hyper

    def apply(self, ops, weight: Rows, states: Mapping[str, Array], rows: UniqueIds,
              grads: Rows, hyper: Hyper, num_threads: int = 1) -> None:
        """Update unique ``rows`` of ``weight`` and ``states`` in place.

        Args:
            ops: the kernel implementation of these arrays.
            weight: (R, D) float32 table.
            states: dict state name -> array, as named by ``self.states``.
            rows: (N,) int64 unique row ids in [0, R).
            grads: (N, D) float32 summed gradients.
            hyper: an instance of ``self.hyper_type``.
            num_threads: OpenMP threads of the CPU kernels (the CUDA ones ignore it).
        """
        raise NotImplementedError

    def hyper_from(self, fields: Mapping[str, Any]) -> Hyper:
        """This rule's hyperparameters from a decoded dict, every field checked.

        A server decodes the same few dicts every step: a valid one is answered from a
        small cache keyed by its fields, their types and values (so ``True`` never
        passes for ``1``, nor ``1.0`` for an int field).

        Raises:
            KVStoreError: a field is missing, unknown or not a number of its type; the
                message names the rule and the field.
        """
        try:
            key = tuple(sorted((k, type(v), v) for k, v in fields.items()))
            hash(key)
        except (AttributeError, TypeError):  # not a dict of scalars: checked the long way
            return self._hyper_from(fields)
        return _cached_hyper(self, key)

    def _hyper_from(self, fields: Mapping[str, Any]) -> Hyper:
        if not isinstance(fields, Mapping):
            raise KVStoreError(f"hyper of rule {self.name.value!r}: expected a mapping, got "
                               f"{type(fields).__name__}")
        declared = _declared_fields(self.hyper_type)
        unknown = sorted(set(fields) - set(declared))
        if unknown:
            raise KVStoreError(f"hyper.{unknown[0]}: unknown field for rule "
                               f"{self.name.value!r} (expected {sorted(declared)})")
        values = {}
        for name, kind in declared.items():
            if name not in fields:
                raise KVStoreError(f"hyper.{name}: missing for rule {self.name.value!r}")
            v = fields[name]
            want_int = kind in (int, "int")
            ok = isinstance(v, int) if want_int else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or (not want_int and not math.isfinite(v)):
                kind_text = "an int" if want_int else "a finite number"
                raise KVStoreError(f"hyper.{name}: expected {kind_text} for rule "
                                   f"{self.name.value!r}, got {v!r}")
            values[name] = int(v) if want_int else float(v)
        return self.hyper_type(**values)

    def options_from(self, options: Mapping[str, Any]) -> Dict[str, float]:
        """The options this rule's states start from (``initial_accumulator_value``),
        each checked: one a state of the rule reads, a finite number.

        Raises:
            KVStoreError: an option no state of the rule reads (a typo would be ignored),
                or one that is not a finite number (NaN or inf would poison every row it
                touches); the message names the option and the rule.
        """
        if not isinstance(options, Mapping):
            raise KVStoreError(f"options of rule {self.name.value!r}: expected a mapping, "
                               f"got {type(options).__name__}")
        known = sorted({s.init_option for s in self.states if s.init_option})
        out = {}
        for name, v in options.items():
            if name not in known:
                raise KVStoreError(f"options.{name}: unknown option of rule "
                                   f"{self.name.value!r} (expected one of {known})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                raise KVStoreError(f"options.{name}: expected a finite number for rule "
                                   f"{self.name.value!r}, got {v!r}")
            out[name] = float(v)
        return out

    def check_hyper(self, hyper: Hyper) -> Hyper:
        """``hyper`` itself when it is this rule's type; KVStoreError naming both otherwise."""
        if type(hyper) is not self.hyper_type:
            raise KVStoreError(f"hyper: rule {self.name.value!r} takes "
                               f"{self.hyper_type.__name__}, got {type(hyper).__name__}")
        return hyper


class SGDRule(UpdateRule):
    name = RuleName.SGD
    hyper_type = SGDHyper

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.sgd_update(weight, rows, grads, hyper.lr, num_threads=num_threads)


class AdagradRule(UpdateRule):
    name = RuleName.ADAGRAD
    states = (StateSpec("sum", per_row=False, init_option="initial_accumulator_value"),)
    hyper_type = AdagradHyper

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adagrad_update(weight, states["sum"], rows, grads, hyper.clr, hyper.eps,
                           num_threads=num_threads)


class RowWiseAdagradRule(UpdateRule):
    name = RuleName.ROWWISE_ADAGRAD
    states = (StateSpec("sum", per_row=True, init_option="initial_accumulator_value"),)
    hyper_type = AdagradHyper

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.rowwise_adagrad_update(weight, states["sum"], rows, grads, hyper.clr, hyper.eps,
                                   num_threads=num_threads)


class AdamRule(UpdateRule):
    name = RuleName.ADAM
    states = (StateSpec("exp_avg", per_row=False), StateSpec("exp_avg_sq", per_row=False))
    hyper_type = AdamHyper

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adam_update(weight, states["exp_avg"], states["exp_avg_sq"], rows, grads,
                        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.step,
                        num_threads=num_threads)


class RowStepAdamRule(AdamRule):
    """Adam whose bias correction counts each row's own updates (DGL's SparseAdam)."""

    name = RuleName.ADAM_ROW_STEP
    states = AdamRule.states + (StateSpec("row_step", per_row=True, dtype="int64"),)

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adam_update(weight, states["exp_avg"], states["exp_avg_sq"], rows, grads,
                        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, 0,
                        row_steps=states["row_step"], num_threads=num_threads)


class FtrlRule(UpdateRule):
    """FTRL-Proximal, per element: see :meth:`distemb.kernels.ops.KernelOps.ftrl_update`."""

    name = RuleName.FTRL
    states = (StateSpec("accum", per_row=False, init_option="initial_accumulator_value"),
              StateSpec("linear", per_row=False))
    hyper_type = FtrlHyper

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.ftrl_update(weight, states["accum"], states["linear"], rows, grads, hyper.lr,
                        hyper.lr_power, hyper.l1, hyper.l2, hyper.l2_shrinkage, hyper.beta,
                        num_threads=num_threads)


RULES: Dict[RuleName, UpdateRule] = {r.name: r for r in (
    SGDRule(), AdagradRule(), RowWiseAdagradRule(), AdamRule(), RowStepAdamRule(),
    FtrlRule())}


def rule_of(name) -> UpdateRule:
    """The rule called ``name`` (a :class:`RuleName` or its value).

    Raises:
        KVStoreError: no such rule; the message lists the known ones.
    """
    try:
        return RULES[RuleName(name)]
    except ValueError:
        raise KVStoreError(f"rule: expected one of {RuleName.values()}, got {name!r}") from None


#: What joins a table's name and its state's in a state's name (reserved in table names).
STATE_SEP = "~opt~"


def state_name(table: str, state: str) -> str:
    """Name under which a table's optimizer state is stored in the KVStore."""
    return f"{table}{STATE_SEP}{state}"


def check_name(name: Optional[str]) -> Optional[str]:
    """``name`` as a table's constructor takes it: a non-empty str, or None (anonymous).

    Raises:
        TypeError: not a str (a tuple, an int: names are compared and sent as text).
        ValueError: the empty str (None, not "", asks for an anonymous table).
    """
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str (or None for an anonymous table), got "
                        f"{type(name).__name__} {name!r}")
    if not name:
        raise ValueError("name: expected a non-empty str (None for an anonymous table), "
                         "got ''")
    return name


def check_table_name(name: str) -> str:
    """``name`` for a new table; ValueError when it holds the reserved ``"~opt~"`` that
    names optimizer state (:func:`state_name`): a table so named would be taken for the
    state of another (a peer could pair a 1-row array with a 100,000-row table)."""
    if STATE_SEP in name:
        raise ValueError(f"name: {name!r} contains {STATE_SEP!r}, which is reserved for the "
                         "names of optimizer state; pick another name")
    return name


def state_owner(name: str) -> Optional[str]:
    """The table whose optimizer state ``name`` is (see :func:`state_name`), else None."""
    table, sep, _ = name.partition(STATE_SEP)
    return table if sep else None


def state_init(spec: StateSpec, shape: Tuple[int, ...], options: Mapping[str, float]):
    """Initial array of one shard of a state tensor."""
    value = options.get(spec.init_option, 0) if spec.init_option else 0
    return np.full(shape, value, dtype=spec.dtype)
