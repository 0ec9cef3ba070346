"""Update rules: the per-row maths of each sparse optimizer, run by the rows' owner.

A rule names its state tensors and applies one fused, in-place kernel to the rows a
push touched. Rules run wherever rows live (the embedded process, the server owning a
shard, or a GPU), so ``apply`` takes the kernel module of those rows' arrays as ``ops``:
:mod:`distemb.kernels` for numpy arrays, :mod:`distemb.kernels.cuda` for torch CUDA
tensors (the two have the same functions and keywords). Hyperparameters are plain floats;
optimizers in :mod:`distemb.optim` choose the rule and compute them for each step.

Concurrency: ``apply`` assumes it is the only writer of those rows and their state for
its duration (DESIGN.md, Concurrency): the KVServer serialises updates per shard.

Example:
    >>> import numpy as np
    >>> from distemb import kernels
    >>> rule = RULES["sgd"]
    >>> w = np.ones((3, 2), np.float32)
    >>> rule.apply(kernels, w, {}, np.array([1]), np.ones((1, 2), np.float32), {"lr": 0.5})
    >>> w[1].tolist()
    [0.5, 0.5]
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor kept beside each row: per element or per row."""

    name: str
    per_row: bool
    dtype: str = "float32"
    init_option: str = ""  # option naming the initial value; 0 when empty

    def shape(self, dim):
        return () if self.per_row else (dim,)


class UpdateRule:
    """Interface: ``states`` (what to keep per row) and ``apply`` (the fused update)."""

    name = ""
    states = ()

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        """Update unique ``rows`` of ``weight`` and ``states`` in place.

        Args:
            ops: the kernel module of these arrays (:mod:`distemb.kernels` for numpy,
                :mod:`distemb.kernels.cuda` for torch CUDA tensors).
            weight: (R, D) float32 table.
            states: dict state name -> array, as named by ``self.states``.
            rows: (N,) int64 unique row ids in [0, R).
            grads: (N, D) float32 summed gradients.
            hyper: plain-float hyperparameters of this step.
            num_threads: OpenMP threads of the CPU kernels (the CUDA ones ignore it).
        """
        raise NotImplementedError


class SGDRule(UpdateRule):
    name = "sgd"

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.sgd_update(weight, rows, grads, hyper["lr"], num_threads=num_threads)


class AdagradRule(UpdateRule):
    name = "adagrad"
    states = (StateSpec("sum", per_row=False, init_option="initial_accumulator_value"),)

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adagrad_update(weight, states["sum"], rows, grads, hyper["clr"],
                           hyper["eps"], num_threads=num_threads)


class RowWiseAdagradRule(UpdateRule):
    name = "rowwise_adagrad"
    states = (StateSpec("sum", per_row=True, init_option="initial_accumulator_value"),)

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.rowwise_adagrad_update(weight, states["sum"], rows, grads, hyper["clr"],
                                   hyper["eps"], num_threads=num_threads)


class AdamRule(UpdateRule):
    name = "adam"
    states = (StateSpec("exp_avg", per_row=False), StateSpec("exp_avg_sq", per_row=False))

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adam_update(weight, states["exp_avg"], states["exp_avg_sq"], rows, grads,
                        hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"],
                        hyper["step"], num_threads=num_threads)


class RowStepAdamRule(AdamRule):
    """Adam whose bias correction counts each row's own updates (DGL's SparseAdam)."""

    name = "adam_row_step"
    states = AdamRule.states + (StateSpec("row_step", per_row=True, dtype="int64"),)

    def apply(self, ops, weight, states, rows, grads, hyper, num_threads=1):
        ops.adam_update(weight, states["exp_avg"], states["exp_avg_sq"], rows, grads,
                        hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], 0,
                        row_steps=states["row_step"], num_threads=num_threads)


RULES = {r.name: r for r in (SGDRule(), AdagradRule(), RowWiseAdagradRule(), AdamRule(),
                             RowStepAdamRule())}


def state_name(table, state):
    """Name under which a table's optimizer state is stored in the KVStore."""
    return f"{table}~opt~{state}"


def state_init(spec, shape, options):
    """Initial array of one shard of a state tensor."""
    value = options.get(spec.init_option, 0) if spec.init_option else 0
    return np.full(shape, value, dtype=spec.dtype)
