"""CUDA kernels for tables whose rows are stored in half precision on a GPU.

:class:`CudaHalfOps` has the functions and keywords of :mod:`distemb.kernels.cuda` (the
update rules take it as their ``ops``), but its tables and weights are ``torch.bfloat16``
or ``torch.float16`` CUDA tensors: lookups return float32 rows, gradients, optimizer state
and every operation stay float32, and each updated weight is rounded into 16 bits on
store, to nearest-even, or (bfloat16, with a ``rounding_seed``) stochastically. The
kernels (``csrc/cuda/half_kernels.cuh``) follow the CPU half kernels
(:mod:`distemb.kernels.half`) expression by expression: a GPU update equals the CPU one
bit for bit, stochastic rounding included (same seed, same row ids).

Example:
    >>> import torch
    >>> from distemb.kernels import cuda, rule_table
    >>> ops = CudaHalfOps(rounding_seed=None)
    >>> if cuda.cuda_available():
    ...     w = torch.ones(4, 8, dtype=torch.bfloat16, device="cuda")
    ...     ops.sgd_update(w, torch.tensor([1], device="cuda"),
    ...                    torch.ones(1, 8, device="cuda"), lr=0.5)
    ...     row = ops.gather_rows(w, torch.tensor([1], device="cuda")).tolist()[0][0]
    ... else:
    ...     row = 0.5
    >>> row
    0.5
"""
from typing import Optional

import torch

from distemb.kernels import cuda, rule_table
from distemb.kernels.cuda import _call, _same_device, _shape, _tensor
from distemb.kernels.cuda_lib import CLEAN_ID_FLAGS, require_cuda

#: The ``kind`` of the C API for each weight dtype (2: bfloat16, stochastic rounding).
KINDS = {torch.bfloat16: 0, torch.float16: 1}
BF16_STOCHASTIC = 2


def _weight(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KINDS:
        raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got "
                        f"{t.dtype} (float32 tables use distemb.kernels.cuda)")
    return _tensor(name, t, t.dtype, 2)


class CudaHalfOps:
    """The CUDA kernels of one half-precision table (see the module docstring).

    Args:
        rounding_seed: None rounds updates to nearest-even; an int rounds bfloat16 rows
            stochastically, each update call with the next seed of a counter started
            there (as :class:`distemb.kernels.half.StochasticRounding` on the CPU).

    Example:
        >>> CudaHalfOps(rounding_seed=3).next_seed()
        3
    """

    def __init__(self, rounding_seed: Optional[int] = None):
        self._next = None if rounding_seed is None else int(rounding_seed)

    def next_seed(self):
        """The seed of the next update call (None: nearest-even), then advance."""
        if self._next is None:
            return None
        self._next += 1
        return self._next - 1

    def _kind_seed(self, weight):
        seed = self.next_seed()
        if seed is None:
            return KINDS[weight.dtype], 0
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"rounding_seed: stochastic rounding is for bfloat16 rows, got "
                             f"{weight.dtype} rows")
        return BF16_STOCHASTIC, seed & (2 ** 64 - 1)

    # float32 gradients whatever the rows: the float32 kernels
    dedup_sum = staticmethod(cuda.dedup_sum)
    dedup_sum_padded = staticmethod(cuda.dedup_sum_padded)

    def gather_rows(self, table, rows, out=None, num_threads=1):
        """``table[rows]`` as float32 rows (ids must be in range; see the checked one)."""
        flags = torch.tensor(CLEAN_ID_FLAGS, dtype=torch.int64, device=table.device)
        return self.gather_rows_checked(table, rows, flags, out, num_threads)

    def gather_rows_checked(self, table, rows, flags, out=None, num_threads=1):
        """As :func:`distemb.kernels.cuda.gather_rows_checked`, from half rows to float32."""
        _weight("table", table)
        _tensor("rows", rows, torch.int64, 1)
        _tensor("flags", flags, torch.int64, 1)
        _shape("flags", flags, (3,))
        n, d = rows.shape[0], table.shape[1]
        if out is None:
            out = torch.empty((n, d), dtype=torch.float32, device=table.device)
        _tensor("out", out, torch.float32, 2)
        _shape("out", out, (n, d))
        device = _same_device(table=table, rows=rows, flags=flags, out=out)
        lib = require_cuda()
        if n * d > 0:
            _call(lib, "distemb_cuda_half_gather_rows_checked", device, table.data_ptr(),
                  KINDS[table.dtype], table.shape[0], d, rows.data_ptr(), n, out.data_ptr(),
                  flags.data_ptr())
        return out

    def _check(self, weight, rows, grads, **states):
        _weight("weight", weight)
        _tensor("rows", rows, torch.int64, 1)
        _tensor("grads", grads, torch.float32, 2)
        _shape("grads", grads, (rows.shape[0], weight.shape[1]))
        for name, (t, shape) in states.items():
            _tensor(name, t, t.dtype if name == "row_steps" else torch.float32, len(shape))
            _shape(name, t, shape)
        device = _same_device(weight=weight, rows=rows, grads=grads,
                              **{k: t for k, (t, _) in states.items()})
        kind, seed = self._kind_seed(weight)
        return device, require_cuda(), kind, seed

    def rowwise_adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        """In place, row-wise Adagrad with one float32 accumulator per row, half rows."""
        device, lib, kind, seed = self._check(weight, rows, grads,
                                              state_sum=(state_sum, weight.shape[:1]))
        if grads.numel() > 0:
            _call(lib, "distemb_cuda_half_rowwise_adagrad_update", device, weight.data_ptr(),
                  kind, seed, state_sum.data_ptr(), weight.shape[0], weight.shape[1],
                  rows.data_ptr(), grads.data_ptr(), rows.shape[0], float(clr), float(eps))

    def adam_update(self, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                    step, row_steps=None, num_threads=1):
        """In place, SparseAdam with float32 moments and half rows (see cuda.adam_update)."""
        states = {"exp_avg": (exp_avg, weight.shape), "exp_avg_sq": (exp_avg_sq, weight.shape)}
        if row_steps is None:
            if int(step) < 1:
                raise ValueError(f"step: expected >= 1 (the count of steps taken), got {step}")
        else:
            _tensor("row_steps", row_steps, torch.int64, 1)
            states["row_steps"] = (row_steps, weight.shape[:1])
        device, lib, kind, seed = self._check(weight, rows, grads, **states)
        if grads.numel() > 0:
            _call(lib, "distemb_cuda_half_adam_update", device, weight.data_ptr(), kind, seed,
                  exp_avg.data_ptr(), exp_avg_sq.data_ptr(), weight.shape[0], weight.shape[1],
                  rows.data_ptr(), grads.data_ptr(), rows.shape[0], float(lr), float(beta1),
                  float(beta2), float(eps), int(step),
                  None if row_steps is None else row_steps.data_ptr())


def _elementwise(rule: rule_table.ElementwiseRule):
    """CudaHalfOps' method of an element-wise rule, made from its table entry: the positive
    hyperparameters, the common checks, then one call of distemb_cuda_half_<rule>_update."""
    states = "".join(f"{s}.data_ptr(), " for s in rule.states)
    shapes = "".join(f", {s}=({s}, weight.shape)" for s in rule.states)
    source = (
        f"def {rule.kernel}(self, {rule.params()}):\n"
        + rule_table.checks(rule)
        + f"    device, lib, kind, seed = self._check(weight, rows, grads{shapes})\n"
          "    if grads.numel() > 0:\n"
          f"        _call(lib, 'distemb_cuda_half_{rule.kernel}', device, weight.data_ptr(), "
          f"kind, seed, {states}\n"
          "              weight.shape[0], weight.shape[1], rows.data_ptr(), grads.data_ptr(),\n"
          f"              rows.shape[0], {rule_table.floats(rule)})\n")
    return rule_table.define(source, globals(), rule.kernel,
                             f"In place on half rows: {rule.summary} (float32 states "
                             f"{', '.join(rule.states) or '(none)'}, (R, D) each).")


# sgd_update, adagrad_update, ftrl_update, ...: one per rule of the table.
for _rule in rule_table.RULES:
    setattr(CudaHalfOps, _rule.kernel, _elementwise(_rule))
del _rule
