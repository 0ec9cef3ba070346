"""CUDA kernels for tables held in torch CUDA tensors, called through ctypes.

The kernels live in ``distemb/_cuda_kernels.so``, a plain shared library built by
``setup.py`` with nvcc from ``csrc/cuda`` (its C API is ``csrc/cuda/distemb_cuda.h``),
loaded by :mod:`distemb.kernels.cuda_lib` (whose names are re-exported here) on first
use, never when :mod:`distemb` or :mod:`distemb.kernels` is imported.
The functions here have the names and semantics of :mod:`distemb.kernels` (the numpy
twins in :mod:`distemb.kernels.reference` define them) but take torch CUDA tensors and
enqueue their work on the current CUDA stream of the tensors' device.

Every function also takes the ``num_threads`` keyword of its CPU twin and ignores it, so
code written against one kernel module runs with either (the update rules of
:mod:`distemb.rules` take the module as an argument).

Inputs must already have the exact dtype (int64 ids, float32 rows) and be contiguous:
nothing is copied or converted behind the caller's back. As on the CPU, rows passed to
the updates must be unique. Ids are not range-checked on the host (that would make the
host wait for the device): :func:`gather_rows_checked` validates them on the device and
the updates skip rows outside the table, so a bad id never touches memory outside it.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from distemb import kernels
    >>> from distemb.kernels import cuda
    >>> if cuda.cuda_available():
    ...     ids = torch.tensor([3, 1, 3], device="cuda")
    ...     uniq, summed = cuda.dedup_sum(ids, torch.ones(3, 2, device="cuda"))
    ... else:  # the CPU kernels give the same results
    ...     uniq, summed = kernels.dedup_sum([3, 1, 3], np.ones((3, 2), np.float32))
    >>> uniq.tolist(), summed.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
"""
import ctypes
import functools

import torch

from distemb.kernels import rule_table
from distemb.kernels.cuda_lib import (ABI_VERSION, CLEAN_ID_FLAGS, CUDA_LIB_PATH,  # noqa: F401
                                      MAX_BATCH, SUM_CHUNK, SYMBOLS, CudaKernelError,
                                      CudaUnavailableError, check_status, cuda_available,
                                      load_library, require_cuda)

_SIZE = ctypes.c_size_t


def cuda_device(device):
    """The ``torch.device`` (with its index) of a CUDA device the kernels can run on.

    Args:
        device: 'cuda', 'cuda:N' or a ``torch.device`` of type cuda.

    Returns:
        ``torch.device('cuda', N)``; ``N`` is torch's current device when not given.

    Raises:
        ValueError: ``device`` is not a CUDA device.
        CudaUnavailableError: the CUDA kernels cannot run here (the reason of
            :func:`distemb.kernels.cuda.require_cuda`).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected None, 'cpu' or a CUDA device such as 'cuda:0', "
                         f"got {device!r} ({exc})") from None
    if dev.type != "cuda":
        raise ValueError(f"device: expected None, 'cpu' or a CUDA device such as 'cuda:0', "
                         f"got {device!r}")
    require_cuda()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} does not exist, this process sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def _tensor(name, t, dtype, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    return t


def _same_device(**tensors):
    """Check that all tensors sit on one CUDA device and return its index."""
    (first_name, first), *rest = tensors.items()
    if first.device.type != "cuda":
        raise TypeError(f"{first_name}: expected a CUDA tensor, got device {first.device} "
                        "(distemb.kernels handles CPU arrays)")
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (that of {first_name}), "
                             f"got {t.device}")
    return first.device.index


def _shape(name, t, expected):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def _check_update(weight, rows, grads):
    _tensor("weight", weight, torch.float32, 2)
    _tensor("rows", rows, torch.int64, 1)
    _tensor("grads", grads, torch.float32, 2)
    _shape("grads", grads, (rows.shape[0], weight.shape[1]))


def _call(lib, name, device, *args):
    """Run entry point ``name`` on ``device`` and the current stream of that device."""
    stream = torch.cuda.current_stream(device).cuda_stream
    if device == torch.cuda.current_device():  # the common case: no device switch
        check_status(lib, name, getattr(lib, name)(*args, device, stream))
        return
    # torch.cuda.device keeps torch's idea of the current device in step with the one the
    # library sets, and restores the caller's device afterwards.
    with torch.cuda.device(device):
        check_status(lib, name, getattr(lib, name)(*args, device, stream))


@functools.lru_cache(maxsize=64)
def _workspace_bytes(lib, n, d, end_bit, device):
    """The dedup's scratch bytes for a batch shape (a pure function: asked once per shape,
    as a training loop repeats its batch shape every step)."""
    nbytes = _SIZE(0)
    check_status(lib, "distemb_cuda_dedup_workspace_bytes",
                 lib.distemb_cuda_dedup_workspace_bytes(n, d, end_bit, ctypes.byref(nbytes),
                                                        device))
    return nbytes.value


def _dedup(ids, grads, num_rows, out):
    """Enqueue the whole dedup; returns (uniq, summed, count) sized for N unique ids."""
    _tensor("ids", ids, torch.int64, 1)
    _tensor("grads", grads, torch.float32, 2)
    n, d = ids.shape[0], grads.shape[1]
    _shape("grads", grads, (n, d))
    if n > MAX_BATCH:
        raise ValueError(f"ids: at most {MAX_BATCH} ids per call, got {n}")
    if num_rows is not None and int(num_rows) < 1:
        raise ValueError(f"num_rows: expected >= 1 (the table size), got {num_rows}")
    # With the table size, ids outside it are sorted as the key num_rows: it must fit.
    end_bit = 64 if num_rows is None else max(1, min(64, int(num_rows).bit_length()))
    tensors = dict(ids=ids, grads=grads)
    if out is not None:
        _tensor("out", out, torch.float32, 2)
        if out.shape[0] < n or out.shape[1] != d:
            raise ValueError(f"out: expected a (>= {n}, {d}) tensor, got {tuple(out.shape)}")
        tensors["out"] = out
    device = _same_device(**tensors)
    lib = require_cuda()
    summed = torch.empty((n, d), dtype=torch.float32, device=ids.device) if out is None else out
    if n == 0:
        return ids.new_empty(0), summed[:0], torch.zeros(1, dtype=torch.int64,
                                                         device=ids.device)
    count = torch.empty(1, dtype=torch.int64, device=ids.device)  # written by the sort
    nbytes = _workspace_bytes(lib, n, d, end_bit, device)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=ids.device)
    uniq = torch.empty(n, dtype=torch.int64, device=ids.device)
    _call(lib, "distemb_cuda_dedup_sort", device, ids.data_ptr(), n, d,
          0 if num_rows is None else int(num_rows), end_bit, workspace.data_ptr(),
          nbytes, uniq.data_ptr(), count.data_ptr())
    if d > 0:
        _call(lib, "distemb_cuda_dedup_sum", device, grads.data_ptr(), n, d,
              workspace.data_ptr(), nbytes, summed.data_ptr())
    return uniq, summed[:n], count


def dedup_sum(ids, grads, num_rows=None, out=None, num_threads=1):
    """Deduplicate ``ids`` and sum the gradient rows of each duplicate, on the GPU.

    The rows of one id are summed in chunks of :data:`SUM_CHUNK` rows, each chunk in batch
    order and all chunks at once, then the chunks' sums in chunk order: a fixed order, so
    results are identical run to run, and a hot id with thousands of rows is summed by
    many threads (the order differs from the CPU kernels' by rounding only). Every kernel
    is enqueued before the host waits, once, to read the unique count that sizes the
    returned views (:func:`dedup_sum_padded` does not wait at all).

    Args:
        ids: (N,) int64 CUDA tensor of ids, any order, duplicates allowed.
        grads: (N, D) float32 CUDA tensor, one gradient row per id.
        num_rows: optional table size. When given, the sort reads only the bits that
            range needs (fewer passes), and ids outside [0, num_rows) are summed together
            as the one id ``num_rows``, which the updates skip.
        out: optional reusable (M >= N, D) float32 CUDA tensor; the sums go to its first
            U rows and a view of them is returned.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Returns:
        (uniq, summed): ascending unique ids (int64, (U,)) and their (U, D) float32 sums.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous, mixed devices, more than MAX_BATCH ids,
            ``num_rows`` < 1 or an ``out`` too small.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: a kernel failed.
    """
    uniq, summed, count = _dedup(ids, grads, num_rows, out)
    num_unique = int(count.item())  # the one wait, after every kernel is enqueued
    return uniq[:num_unique], summed[:num_unique]


def dedup_sum_padded(ids, grads, num_rows, out=None, num_threads=1):
    """:func:`dedup_sum` for a table of ``num_rows`` rows, without any wait for the GPU.

    Returns all N slots: the U unique ids ascending, then ``num_rows`` (outside the table)
    in every unused slot, whose sums are unspecified. The update kernels skip rows outside
    the table, so the result goes to them as it is, and the host never learns U.

    Args:
        ids: (N,) int64 CUDA tensor of ids, any order, duplicates allowed.
        grads: (N, D) float32 CUDA tensor, one gradient row per id.
        num_rows: the table size, >= 1; ids outside [0, num_rows) are summed as the id
            ``num_rows`` (skipped by the updates, like the padding).
        out: optional reusable (M >= N, D) float32 CUDA tensor for the sums.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Returns:
        (uniq, summed): (N,) int64 and (N, D) float32, padded as said above.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: as :func:`dedup_sum`.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: a kernel failed.
    """
    if num_rows is None:
        raise ValueError("num_rows: expected the table size (>= 1), got None")
    uniq, summed, _ = _dedup(ids, grads, num_rows, out)
    return uniq, summed


def gather_rows(table, rows, out=None, num_threads=1):
    """Copy ``table[rows]`` into ``out`` (allocated when None) on the GPU and return it.

    Args:
        table: (R, D) float32 CUDA tensor.
        rows: (N,) int64 CUDA tensor of row ids in [0, R).
        out: optional (N, D) float32 CUDA tensor to write into.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Returns:
        ``out``.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous or mixed devices.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _tensor("table", table, torch.float32, 2)
    _tensor("rows", rows, torch.int64, 1)
    n, d = rows.shape[0], table.shape[1]
    if out is None:
        out = torch.empty((n, d), dtype=torch.float32, device=table.device)
    _tensor("out", out, torch.float32, 2)
    _shape("out", out, (n, d))
    device = _same_device(table=table, rows=rows, out=out)
    lib = require_cuda()
    if n * d > 0:
        _call(lib, "distemb_cuda_gather_rows", device, table.data_ptr(), d, rows.data_ptr(), n,
              out.data_ptr())
    return out


def gather_rows_checked(table, rows, flags, out=None, num_threads=1):
    """As :func:`gather_rows`, validating ``rows`` on the GPU without stopping the stream.

    A row id outside [0, R) reads a row of zeros instead of faulting, and is recorded in
    ``flags``: (count, smallest, largest) of the bad ids seen, accumulated over calls
    until the caller resets them to :data:`CLEAN_ID_FLAGS`. The caller reads ``flags``
    when it next waits for the device anyway and reports the bad ids then.

    Args:
        table: (R, D) float32 CUDA tensor.
        rows: (N,) int64 CUDA tensor of row ids, any values.
        flags: (3,) int64 CUDA tensor, updated in place (start: :data:`CLEAN_ID_FLAGS`).
        out: optional (N, D) float32 CUDA tensor to write into.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Returns:
        ``out``.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous or mixed devices.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _tensor("table", table, torch.float32, 2)
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
        _call(lib, "distemb_cuda_gather_rows_checked", device, table.data_ptr(),
              table.shape[0], d, rows.data_ptr(), n, out.data_ptr(), flags.data_ptr())
    return out


def rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place on the GPU, row-wise Adagrad (one accumulator per row: the mean of g^2).

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        state_sum: (R,) float32 CUDA tensor, one accumulator per row, in place.
        rows: (N,) int64 CUDA tensor of unique row ids; ids outside [0, R) are skipped.
        grads: (N, D) float32 CUDA tensor.
        clr: the step's learning rate.
        eps: added to the root of the state.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous or mixed devices.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _check_update(weight, rows, grads)
    _tensor("state_sum", state_sum, torch.float32, 1)
    _shape("state_sum", state_sum, weight.shape[:1])
    device = _same_device(weight=weight, state_sum=state_sum, rows=rows, grads=grads)
    lib = require_cuda()
    if grads.numel() > 0:
        _call(lib, "distemb_cuda_rowwise_adagrad_update", device, weight.data_ptr(),
              state_sum.data_ptr(), weight.shape[0], weight.shape[1], rows.data_ptr(),
              grads.data_ptr(), rows.shape[0], float(clr), float(eps))


def adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, num_threads=1):
    """In place on the GPU, torch.optim.SparseAdam's rule on unique ``rows``.

    ``step`` is the global step (torch semantics); with ``row_steps`` each row counts and
    bias-corrects its own steps instead (incremented here, in place).

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        exp_avg: (R, D) float32 CUDA tensor, first moments, in place.
        exp_avg_sq: (R, D) float32 CUDA tensor, second moments, in place.
        rows: (N,) int64 CUDA tensor of unique row ids; ids outside [0, R) are skipped.
        grads: (N, D) float32 CUDA tensor.
        lr: learning rate.
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        eps: added to the root of the second moment.
        step: the optimizer's step count, >= 1; ignored when ``row_steps`` is given.
        row_steps: optional (R,) int64 CUDA tensor of per-row step counts, in place.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous, mixed devices or ``step`` < 1.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _check_update(weight, rows, grads)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _tensor(name, t, torch.float32, 2)
        _shape(name, t, weight.shape)
    tensors = dict(weight=weight, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, rows=rows,
                   grads=grads)
    if row_steps is None:
        if int(step) < 1:
            raise ValueError(f"step: expected >= 1 (the count of steps taken), got {step}")
        steps_ptr = None
    else:
        _tensor("row_steps", row_steps, torch.int64, 1)
        _shape("row_steps", row_steps, weight.shape[:1])
        tensors["row_steps"] = row_steps
        steps_ptr = row_steps.data_ptr()
    device = _same_device(**tensors)
    lib = require_cuda()
    if grads.numel() > 0:
        _call(lib, "distemb_cuda_adam_update", device, weight.data_ptr(), exp_avg.data_ptr(),
              exp_avg_sq.data_ptr(), weight.shape[0], weight.shape[1], rows.data_ptr(),
              grads.data_ptr(), rows.shape[0], float(lr), float(beta1), float(beta2),
              float(eps), int(step), steps_ptr)


def _elementwise(rule: rule_table.ElementwiseRule):
    """The wrapper of an element-wise rule's CUDA update, made from its table entry: the
    checks of every update here (weight, rows, grads, each (R, D) float32 state, one
    device), the positive hyperparameters, then one call of distemb_cuda_<rule>_update."""
    states = "".join(f"{s}.data_ptr(), " for s in rule.states)
    tensors = ", ".join(["weight=weight"] + [f"{s}={s}" for s in rule.states]
                        + ["rows=rows", "grads=grads"])
    source = (
        f"def {rule.kernel}({rule.params()}):\n"
        "    _check_update(weight, rows, grads)\n"
        + "".join(f"    _tensor({s!r}, {s}, torch.float32, 2)\n"
                  f"    _shape({s!r}, {s}, weight.shape)\n" for s in rule.states)
        + rule_table.checks(rule)
        + f"    device = _same_device({tensors})\n"
          "    lib = require_cuda()\n"
          "    if grads.numel() > 0:\n"
          f"        _call(lib, 'distemb_cuda_{rule.kernel}', device, weight.data_ptr(), {states}\n"
          "              weight.shape[0], weight.shape[1], rows.data_ptr(), grads.data_ptr(),\n"
          f"              rows.shape[0], {rule_table.floats(rule)})\n")
    doc = (f"In place on the GPU, on unique ``rows``: {rule.summary}\n\n"
           "Args:\n"
           "    weight: (R, D) float32 CUDA tensor, updated in place.\n"
           + "".join(f"    {s}: (R, D) float32 CUDA tensor of state, in place.\n"
                     for s in rule.states)
           + "    rows: (N,) int64 CUDA tensor of unique row ids; ids outside [0, R) are "
             "skipped.\n"
             "    grads: (N, D) float32 CUDA tensor.\n"
           + "".join(f"    {h}: see :mod:`distemb.kernels.ops`.\n" for h in rule.hyper_names)
           + "    num_threads: ignored; the CPU twin's keyword, accepted so callers can swap "
             "modules.\n\n"
             "Raises:\n"
             "    TypeError: wrong type, dtype or a CPU tensor.\n"
             "    ValueError: wrong shape, non-contiguous, mixed devices or a hyperparameter "
             "that must be positive is not.\n"
             "    CudaUnavailableError: the CUDA kernels cannot run here.\n"
             "    CudaKernelError: the kernel failed.")
    return rule_table.define(source, globals(), rule.kernel, doc)


# sgd_update, adagrad_update, ftrl_update, ...: one per rule of the table.
for _rule in rule_table.RULES:
    globals()[_rule.kernel] = _elementwise(_rule)
del _rule
