"""A CPU stand-in for :mod:`distemb.kernels.cuda`, for testing the device path without a GPU.

``CpuCudaTwin`` has the functions and keywords of :mod:`distemb.kernels.cuda` and checks
its inputs as strictly (torch tensors, exact dtypes, contiguous, one device), but takes
CPU torch tensors and runs :mod:`distemb.kernels.reference` on their numpy views, in
place. A :class:`~distemb.kvstore.device.DeviceKVClient` on device 'cpu' with this as its
``ops`` runs every line of the GPU dispatch except the CUDA kernels themselves. It counts
its calls, so a test can prove the device path (not the host one) ran. Test-only: it is
not part of the package.

``dedup_sum`` adds in the CUDA kernel's order, bit for bit (:func:`chunked_dedup_sum`):
an id's rows in chunks of ``cuda.SUM_CHUNK``, each chunk in batch order, then the chunks'
sums in chunk order. ``gather_rows_checked`` reads zeros for bad ids and records them in
its flags, as the CUDA kernel does, so the deferred id check runs here too.
"""
from collections import Counter

import numpy as np
import torch

from distemb.kernels import cuda, half, reference, rule_table


def chunked_dedup_sum(ids, grads, chunk=cuda.SUM_CHUNK, num_rows=None):
    """Unique ids and summed rows, added in the order of the CUDA segment sum.

    Args:
        ids: (N,) int64 numpy ids.
        grads: (N, D) float32 numpy rows.
        chunk: rows per chunk (the CUDA kernel's ``SUM_CHUNK``).
        num_rows: the table size, if given: ids outside [0, num_rows) count as num_rows.

    Returns:
        ``(uniq, summed)``: ascending unique ids and their (U, D) float32 sums, where a run
        of c rows of one id (in batch order) is cut into ceil(c / chunk) chunks, each summed
        left to right, and the chunks' sums are added left to right.
    """
    if num_rows is not None:
        ids = np.where((ids < 0) | (ids >= num_rows), num_rows, ids)
    order = np.argsort(ids, kind="stable")  # the radix sort is stable: batch order in a run
    uniq, starts, counts = np.unique(ids[order], return_index=True, return_counts=True)
    if uniq.shape[0] == 0:
        return uniq.astype(np.int64), np.zeros((0, grads.shape[1]), np.float32)
    rows = grads[order]
    nch = (counts + chunk - 1) // chunk
    first = np.cumsum(nch) - nch  # the first chunk of each run
    run = np.repeat(np.arange(uniq.shape[0]), nch)
    j = np.arange(run.shape[0]) - first[run]
    begin = starts[run] + j * chunk
    length = np.minimum(chunk, counts[run] - j * chunk)
    partial = rows[begin]  # vectorised over chunks, sequential within each: row q is
    for q in range(1, chunk):  # added to every chunk that has one, in row order
        has = np.flatnonzero(length > q)
        if has.size == 0:
            break
        partial[has] += rows[begin[has] + q]
    summed = partial[first]
    multi = np.flatnonzero(nch > 1)
    for c in range(1, int(nch.max())):  # then the chunks of each run, in chunk order
        multi = multi[nch[multi] > c]
        summed[multi] += partial[first[multi] + c]
    return uniq.astype(np.int64), summed.astype(np.float32, copy=False)


def _tensor(name, t, dtype, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous():
        raise TypeError(f"{name}: expected a contiguous {dtype} tensor of {ndim} dims, got "
                        f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: the CPU twin takes CPU tensors, got {t.device}")
    return t.numpy()


def _in_table(weight, rows, grads):
    """The rows (and their gradients) inside the table: the CUDA updates skip the others."""
    rows_np = _tensor("rows", rows, torch.int64, 1)
    grads_np = _tensor("grads", grads, torch.float32, 2)
    inside = (rows_np >= 0) & (rows_np < weight.shape[0])
    if inside.all():
        return rows_np, grads_np
    return rows_np[inside], grads_np[inside]


class CpuCudaTwin:
    """The kernels.cuda functions on CPU torch tensors (see the module docstring)."""

    def __init__(self):
        self.calls = Counter()

    def dedup_sum(self, ids, grads, num_rows=None, out=None, num_threads=1):
        self.calls["dedup_sum"] += 1
        ids_np = _tensor("ids", ids, torch.int64, 1)
        grads_np = _tensor("grads", grads, torch.float32, 2)
        if out is not None:
            _tensor("out", out, torch.float32, 2)
            if out.shape[0] < ids_np.shape[0] or out.shape[1] != grads_np.shape[1]:
                raise ValueError(f"out: expected a (>= {ids_np.shape[0]}, "
                                 f"{grads_np.shape[1]}) tensor, got {tuple(out.shape)}")
        uniq, summed = chunked_dedup_sum(ids_np, grads_np, num_rows=num_rows)
        if out is None:
            return torch.from_numpy(uniq), torch.from_numpy(summed)
        out[:uniq.shape[0]] = torch.from_numpy(summed)
        return torch.from_numpy(uniq), out[:uniq.shape[0]]

    def dedup_sum_padded(self, ids, grads, num_rows, out=None, num_threads=1):
        self.calls["dedup_sum_padded"] += 1
        if num_rows is None:
            raise ValueError("num_rows: expected the table size (>= 1), got None")
        uniq, summed = self.dedup_sum(ids, grads, num_rows=num_rows, out=out)
        self.calls["dedup_sum"] -= 1
        n, u = ids.shape[0], uniq.shape[0]
        padded_ids = torch.full((n,), num_rows, dtype=torch.int64)
        padded_ids[:u] = uniq
        padded = torch.zeros((n, grads.shape[1]), dtype=torch.float32) if out is None \
            else out[:n]
        padded[:u] = summed
        return padded_ids, padded

    def gather_rows(self, table, rows, out=None, num_threads=1):
        self.calls["gather_rows"] += 1
        if out is None:
            out = torch.empty((rows.shape[0], table.shape[1]), dtype=torch.float32)
        reference.gather_rows(_tensor("table", table, torch.float32, 2),
                              _tensor("rows", rows, torch.int64, 1),
                              _tensor("out", out, torch.float32, 2))
        return out

    def gather_rows_checked(self, table, rows, flags, out=None, num_threads=1):
        self.calls["gather_rows_checked"] += 1
        table_np = _tensor("table", table, torch.float32, 2)
        rows_np = _tensor("rows", rows, torch.int64, 1)
        flags_np = _tensor("flags", flags, torch.int64, 1)
        if out is None:
            out = torch.empty((rows.shape[0], table.shape[1]), dtype=torch.float32)
        out_np = _tensor("out", out, torch.float32, 2)
        bad = (rows_np < 0) | (rows_np >= table_np.shape[0])
        reference.gather_rows(table_np, np.where(bad, 0, rows_np), out_np)
        if bad.any():
            out_np[bad] = 0
            flags_np[0] += int(bad.sum())
            flags_np[1] = min(flags_np[1], rows_np[bad].min())
            flags_np[2] = max(flags_np[2], rows_np[bad].max())
        return out

    def rowwise_adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        self.calls["rowwise_adagrad_update"] += 1
        w = _tensor("weight", weight, torch.float32, 2)
        rows_np, grads_np = _in_table(w, rows, grads)
        reference.rowwise_adagrad_update(w, _tensor("state_sum", state_sum, torch.float32, 1),
                                         rows_np, grads_np, clr, eps)

    def adam_update(self, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                    step, row_steps=None, num_threads=1):
        self.calls["adam_update"] += 1
        steps = None if row_steps is None else _tensor("row_steps", row_steps, torch.int64, 1)
        w = _tensor("weight", weight, torch.float32, 2)
        rows_np, grads_np = _in_table(w, rows, grads)
        reference.adam_update(w, _tensor("exp_avg", exp_avg, torch.float32, 2),
                              _tensor("exp_avg_sq", exp_avg_sq, torch.float32, 2),
                              rows_np, grads_np, lr, beta1, beta2, eps, step, row_steps=steps)


def _half_bits(name, t):
    """A CPU bfloat16/float16 torch tensor as the numpy half array of distemb.kernels.half
    (a view: in-place updates land in the tensor)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.bfloat16, torch.float16) \
            or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
        raise TypeError(f"{name}: expected a contiguous 2-d CPU bfloat16/float16 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dtype == torch.float16:
        return t.numpy()
    return t.view(torch.int16).numpy().view(half.BFLOAT16)


class CpuCudaHalfTwin:
    """:class:`distemb.kernels.cuda_half.CudaHalfOps` on CPU torch tensors: the CPU half
    kernels (:mod:`distemb.kernels.half`) on numpy views of the bits, ids outside the table
    skipped by the updates and read as zeros (flagged) by the checked gather, as on the GPU.
    The float32 kernels (the gradient sums) are :class:`CpuCudaTwin`'s."""

    def __init__(self, rounding_seed=None):
        self.twin = CpuCudaTwin()
        self.calls = self.twin.calls
        self._next = rounding_seed
        self.dedup_sum = self.twin.dedup_sum
        self.dedup_sum_padded = self.twin.dedup_sum_padded

    def _seed(self):
        if self._next is None:
            return None
        self._next += 1
        return self._next - 1

    def gather_rows(self, table, rows, out=None, num_threads=1):
        flags = torch.tensor(cuda.CLEAN_ID_FLAGS, dtype=torch.int64)
        return self.gather_rows_checked(table, rows, flags, out)

    def gather_rows_checked(self, table, rows, flags, out=None, num_threads=1):
        self.calls["half_gather_rows_checked"] += 1
        bits = _half_bits("table", table)
        rows_np = _tensor("rows", rows, torch.int64, 1)
        flags_np = _tensor("flags", flags, torch.int64, 1)
        if out is None:
            out = torch.empty((rows.shape[0], table.shape[1]), dtype=torch.float32)
        out_np = _tensor("out", out, torch.float32, 2)
        bad = (rows_np < 0) | (rows_np >= bits.shape[0])
        half.gather_rows(bits, np.where(bad, 0, rows_np), out_np)
        if bad.any():
            out_np[bad] = 0
            flags_np[0] += int(bad.sum())
            flags_np[1] = min(flags_np[1], rows_np[bad].min())
            flags_np[2] = max(flags_np[2], rows_np[bad].max())
        return out

    def _args(self, weight, rows, grads):
        w = _half_bits("weight", weight)
        rows_np, grads_np = _in_table(w, rows, grads)
        return w, rows_np, np.ascontiguousarray(grads_np)

    def rowwise_adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        self.calls["half_rowwise_adagrad_update"] += 1
        w, r, g = self._args(weight, rows, grads)
        half.seeded_rowwise_adagrad_update(w, _tensor("state_sum", state_sum, torch.float32, 1),
                                           r, g, clr, eps, rounding_seed=self._seed())

    def adam_update(self, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                    step, row_steps=None, num_threads=1):
        self.calls["half_adam_update"] += 1
        steps = None if row_steps is None else _tensor("row_steps", row_steps, torch.int64, 1)
        w, r, g = self._args(weight, rows, grads)
        half.seeded_adam_update(w, _tensor("exp_avg", exp_avg, torch.float32, 2),
                                _tensor("exp_avg_sq", exp_avg_sq, torch.float32, 2), r, g,
                                lr, beta1, beta2, eps, step, steps, rounding_seed=self._seed())


def _elementwise(rule):
    """The twins' methods of an element-wise rule, made from its table entry: the float32
    one runs the numpy twin, the half one the CPU half kernels, both skipping rows outside
    the table as the CUDA kernels do."""
    states = "".join(f"_tensor({s!r}, {s}, torch.float32, 2), " for s in rule.states)
    hyper = ", ".join(rule.hyper_names)
    f32 = (f"def {rule.kernel}(self, {rule.params()}):\n"
           f"    self.calls[{rule.kernel!r}] += 1\n"
           "    w = _tensor('weight', weight, torch.float32, 2)\n"
           "    rows_np, grads_np = _in_table(w, rows, grads)\n"
           f"    reference.{rule.kernel}(w, {states}rows_np, grads_np, {hyper})\n")
    f16 = (f"def {rule.kernel}(self, {rule.params()}):\n"
           f"    self.calls['half_{rule.kernel}'] += 1\n"
           "    w, r, g = self._args(weight, rows, grads)\n"
           f"    half.seeded_{rule.kernel}(w, {states}r, g, {hyper},\n"
           "                             rounding_seed=self._seed())\n")
    setattr(CpuCudaTwin, rule.kernel, rule_table.define(f32, globals(), rule.kernel))
    setattr(CpuCudaHalfTwin, rule.kernel, rule_table.define(f16, globals(), rule.kernel))


for _rule in rule_table.RULES:
    _elementwise(_rule)
del _rule
