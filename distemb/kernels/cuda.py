"""CUDA kernels for tables held in torch CUDA tensors, called through ctypes.

The kernels live in ``distemb/_cuda_kernels.so``, a plain shared library built by
``setup.py`` with nvcc from ``csrc/cuda`` (its C API is ``csrc/cuda/distemb_cuda.h``). It
is loaded on first use, never when :mod:`distemb` or :mod:`distemb.kernels` is imported.
The functions here have the names and semantics of :mod:`distemb.kernels` (the numpy
twins in :mod:`distemb.kernels.reference` define them) but take torch CUDA tensors and
enqueue their work on the current CUDA stream of the tensors' device.

Every function also takes the ``num_threads`` keyword of its CPU twin and ignores it, so
code written against one kernel module runs with either (the update rules of
:mod:`distemb.rules` take the module as an argument).

Inputs must already have the exact dtype (int64 ids, float32 rows) and be contiguous:
nothing is copied or converted behind the caller's back. As on the CPU, row ids must be
in range and, for the updates, unique; that is the caller's contract, not checked here.

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
import os

import torch

from distemb.errors import DistEmbError

CUDA_LIB_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "_cuda_kernels.so")
# Must equal DISTEMB_CUDA_ABI_VERSION in csrc/cuda/distemb_cuda.h.
ABI_VERSION = 2
MAX_BATCH = 2**31 - 1  # the dedup kernels index positions with int32

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _F64, _SIZE = ctypes.c_float, ctypes.c_double, ctypes.c_size_t
# Every C entry point: (return type, argument types). Trailing (int device, void* stream).
_SIGNATURES = {
    "distemb_cuda_abi_version": (_INT, []),
    "distemb_cuda_error_string": (ctypes.c_char_p, [_INT]),
    "distemb_cuda_device_count": (_INT, [ctypes.POINTER(_INT)]),
    "distemb_cuda_dedup_workspace_bytes": (_INT, [_I64, _INT, ctypes.POINTER(_SIZE), _INT]),
    "distemb_cuda_dedup_sort": (_INT, [_P, _I64, _INT, _P, _SIZE, _P, _P, _INT, _P]),
    "distemb_cuda_dedup_sum": (_INT, [_P, _I64, _I64, _P, _SIZE, _I64, _P, _INT, _P]),
    "distemb_cuda_gather_rows": (_INT, [_P, _I64, _P, _I64, _P, _INT, _P]),
    "distemb_cuda_sgd_update": (_INT, [_P, _I64, _P, _P, _I64, _F32, _INT, _P]),
    "distemb_cuda_adagrad_update": (_INT, [_P, _P, _I64, _P, _P, _I64, _F32, _F32, _INT, _P]),
    "distemb_cuda_rowwise_adagrad_update":
        (_INT, [_P, _P, _I64, _P, _P, _I64, _F32, _F32, _INT, _P]),
    "distemb_cuda_adam_update": (_INT, [_P, _P, _P, _I64, _P, _P, _I64, _F64, _F64, _F64, _F64,
                                        _I64, _P, _INT, _P]),
}
SYMBOLS = tuple(sorted(_SIGNATURES))

_BUILD_HINT = ("Build it with the CUDA toolkit's nvcc on PATH (or NVCC=/path/to/nvcc) by "
               "reinstalling distemb (`pip install -e .` or `python setup.py build_ext "
               "--inplace`; DISTEMB_REQUIRE_CUDA=1 makes a failed CUDA build an error). "
               "DISTEMB_NO_CUDA=1 skips the CUDA build on purpose.")


class CudaUnavailableError(DistEmbError, RuntimeError):
    """The CUDA kernels cannot run here: library not built, no GPU, or CPU-only torch."""


class CudaKernelError(DistEmbError, RuntimeError):
    """A CUDA kernel entry point returned a CUDA error code."""


@functools.lru_cache(maxsize=None)
def load_library(path=CUDA_LIB_PATH):
    """Load the CUDA kernel library once per path and declare its C signatures.

    Loading needs no GPU: the library links the CUDA runtime statically and only talks
    to the driver when a kernel entry point runs. A failed load is not cached, so a
    library built later in the same process is found.

    Args:
        path: the shared library, by default the one ``setup.py`` builds in the package.

    Returns:
        The ``ctypes.CDLL``.

    Raises:
        CudaUnavailableError: the library is missing, cannot be loaded, lacks a symbol or
            was built for another ABI version (a stale build).
    """
    if not os.path.exists(path):
        raise CudaUnavailableError(f"distemb CUDA kernels not built: {path} does not exist. "
                                   + _BUILD_HINT)
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise CudaUnavailableError(f"cannot load distemb CUDA kernels from {path}: {exc}. "
                                   + _BUILD_HINT) from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise CudaUnavailableError(f"{path} lacks symbol {name}: a stale build. "
                                       + _BUILD_HINT) from exc
        fn.restype, fn.argtypes = restype, argtypes
    version = lib.distemb_cuda_abi_version()
    if version != ABI_VERSION:
        raise CudaUnavailableError(f"{path} has ABI version {version}, expected {ABI_VERSION}: "
                                   "a stale build. " + _BUILD_HINT)
    return lib


def require_cuda(path=CUDA_LIB_PATH):
    """Return the loaded library if the CUDA kernels can run here, else raise why not.

    Args:
        path: the shared library to load.

    Returns:
        The ``ctypes.CDLL`` of :func:`load_library`.

    Raises:
        CudaUnavailableError: the library is not built, torch was built without CUDA,
            no CUDA device is visible, or the driver is too old for the library.
    """
    lib = load_library(path)
    if torch.version.cuda is None:
        raise CudaUnavailableError(f"torch {torch.__version__} is a CPU-only build, so there "
                                   "are no CUDA tensors for the distemb CUDA kernels; install "
                                   "a CUDA build of torch or use the CPU kernels "
                                   "(distemb.kernels).")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise CudaUnavailableError(
            f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible!r}); use the CPU "
            "kernels (distemb.kernels).")
    # torch may ship an older CUDA runtime than the one linked into the library, so the
    # driver can suit torch and still be too old for these kernels.
    count = ctypes.c_int(0)
    code = lib.distemb_cuda_device_count(ctypes.byref(count))
    if code != 0 or count.value == 0:
        text = lib.distemb_cuda_error_string(code).decode(errors="replace")
        raise CudaUnavailableError(
            f"the distemb CUDA kernels see no usable GPU although torch does: {text} "
            f"(CUDA error {code}). The library links nvcc's CUDA runtime statically; the "
            "NVIDIA driver must support that CUDA version (see `nvcc --version`).")
    return lib


def cuda_available(path=CUDA_LIB_PATH):
    """Say whether the CUDA kernels can run here (see :func:`require_cuda` for why not).

    Args:
        path: the shared library to load.

    Returns:
        True when the library loads and torch sees a CUDA device.
    """
    try:
        require_cuda(path)
    except CudaUnavailableError:
        return False
    return True


def check_status(lib, name, code):
    """Raise if a C entry point returned a CUDA error.

    Args:
        lib: the loaded library (for its error strings).
        name: the entry point, for the message.
        code: its return value (a ``cudaError_t``).

    Raises:
        CudaKernelError: ``code`` is not 0 (cudaSuccess).
    """
    if code != 0:
        text = lib.distemb_cuda_error_string(code).decode(errors="replace")
        raise CudaKernelError(f"{name} failed with CUDA error {code}: {text}")


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
    # torch.cuda.device keeps torch's idea of the current device in step with the one the
    # library sets, and restores the caller's device afterwards.
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        check_status(lib, name, getattr(lib, name)(*args, device, stream))


def dedup_sum(ids, grads, num_rows=None, out=None, num_threads=1):
    """Deduplicate ``ids`` and sum the gradient rows of each duplicate, on the GPU.

    Sums accumulate in batch order, so results are deterministic. Synchronises once with
    the current stream, to read the number of unique ids that sizes the output.

    Args:
        ids: (N,) int64 CUDA tensor of ids, any order, duplicates allowed.
        grads: (N, D) float32 CUDA tensor, one gradient row per id.
        num_rows: optional table size. When given, every id must lie in [0, num_rows)
            (not checked): the sort then reads only the bits that range needs, in fewer
            passes. Ids outside it give wrong results.
        out: optional reusable (M >= N, D) float32 CUDA tensor; the sums go to its first
            U rows and a view of them is returned.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Returns:
        (uniq, summed): ascending unique ids (int64, (U,)) and their (U, D) float32 sums.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous, mixed devices, more than MAX_BATCH ids
            or ``num_rows`` < 1.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: a kernel failed.
    """
    _tensor("ids", ids, torch.int64, 1)
    _tensor("grads", grads, torch.float32, 2)
    n, d = ids.shape[0], grads.shape[1]
    _shape("grads", grads, (n, d))
    if n > MAX_BATCH:
        raise ValueError(f"ids: at most {MAX_BATCH} ids per call, got {n}")
    if num_rows is not None and int(num_rows) < 1:
        raise ValueError(f"num_rows: expected >= 1 (the table size), got {num_rows}")
    end_bit = 64 if num_rows is None else max(1, (int(num_rows) - 1).bit_length())
    device = _same_device(ids=ids, grads=grads)
    lib = require_cuda()
    if n == 0:
        return ids.new_empty(0), grads.new_empty((0, d))
    nbytes = _SIZE(0)
    with torch.cuda.device(device):
        check_status(lib, "distemb_cuda_dedup_workspace_bytes",
                     lib.distemb_cuda_dedup_workspace_bytes(n, end_bit, ctypes.byref(nbytes),
                                                            device))
    workspace = torch.empty(nbytes.value, dtype=torch.uint8, device=ids.device)
    uniq = torch.empty(n, dtype=torch.int64, device=ids.device)
    count = torch.empty(1, dtype=torch.int64, device=ids.device)
    _call(lib, "distemb_cuda_dedup_sort", device, ids.data_ptr(), n, end_bit,
          workspace.data_ptr(), nbytes.value, uniq.data_ptr(), count.data_ptr())
    num_unique = int(count.item())
    if out is None:
        summed = torch.empty((num_unique, d), dtype=torch.float32, device=ids.device)
    else:
        _tensor("out", out, torch.float32, 2)
        if out.shape[0] < n or out.shape[1] != d or out.device != ids.device:
            raise ValueError(f"out: expected a ({'>='} {n}, {d}) tensor on {ids.device}, got "
                             f"{tuple(out.shape)} on {out.device}")
        summed = out[:num_unique]
    if d > 0:
        _call(lib, "distemb_cuda_dedup_sum", device, grads.data_ptr(), n, d,
              workspace.data_ptr(), nbytes.value, num_unique, summed.data_ptr())
    return uniq[:num_unique], summed


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


def sgd_update(weight, rows, grads, lr, num_threads=1):
    """In place on the GPU: ``weight[rows] -= lr * grads``. ``rows`` must be unique.

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        rows: (N,) int64 CUDA tensor of unique row ids in [0, R).
        grads: (N, D) float32 CUDA tensor.
        lr: learning rate.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous or mixed devices.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _check_update(weight, rows, grads)
    device = _same_device(weight=weight, rows=rows, grads=grads)
    lib = require_cuda()
    if grads.numel() > 0:
        _call(lib, "distemb_cuda_sgd_update", device, weight.data_ptr(), weight.shape[1],
              rows.data_ptr(), grads.data_ptr(), rows.shape[0], float(lr))


def adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place on the GPU, torch.optim.Adagrad's sparse rule on unique ``rows``.

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        state_sum: (R, D) float32 CUDA tensor of summed squared gradients, in place.
        rows: (N,) int64 CUDA tensor of unique row ids in [0, R).
        grads: (N, D) float32 CUDA tensor.
        clr: the step's learning rate (after torch's lr_decay).
        eps: added to the root of the state.
        num_threads: ignored; the CPU twin's keyword, accepted so callers can swap modules.

    Raises:
        TypeError: wrong type, dtype or a CPU tensor.
        ValueError: wrong shape, non-contiguous or mixed devices.
        CudaUnavailableError: the CUDA kernels cannot run here.
        CudaKernelError: the kernel failed.
    """
    _check_update(weight, rows, grads)
    _tensor("state_sum", state_sum, torch.float32, 2)
    _shape("state_sum", state_sum, weight.shape)
    device = _same_device(weight=weight, state_sum=state_sum, rows=rows, grads=grads)
    lib = require_cuda()
    if grads.numel() > 0:
        _call(lib, "distemb_cuda_adagrad_update", device, weight.data_ptr(),
              state_sum.data_ptr(), weight.shape[1], rows.data_ptr(), grads.data_ptr(),
              rows.shape[0], float(clr), float(eps))


def rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place on the GPU, row-wise Adagrad (one accumulator per row: the mean of g^2).

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        state_sum: (R,) float32 CUDA tensor, one accumulator per row, in place.
        rows: (N,) int64 CUDA tensor of unique row ids in [0, R).
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
              state_sum.data_ptr(), weight.shape[1], rows.data_ptr(), grads.data_ptr(),
              rows.shape[0], float(clr), float(eps))


def adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, num_threads=1):
    """In place on the GPU, torch.optim.SparseAdam's rule on unique ``rows``.

    ``step`` is the global step (torch semantics); with ``row_steps`` each row counts and
    bias-corrects its own steps instead (incremented here, in place).

    Args:
        weight: (R, D) float32 CUDA tensor, updated in place.
        exp_avg: (R, D) float32 CUDA tensor, first moments, in place.
        exp_avg_sq: (R, D) float32 CUDA tensor, second moments, in place.
        rows: (N,) int64 CUDA tensor of unique row ids in [0, R).
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
              exp_avg_sq.data_ptr(), weight.shape[1], rows.data_ptr(), grads.data_ptr(),
              rows.shape[0], float(lr), float(beta1), float(beta2), float(eps), int(step),
              steps_ptr)
