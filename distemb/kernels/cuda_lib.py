"""Loading distemb's CUDA kernel library (``distemb/_cuda_kernels.so``) with ctypes.

The library is a plain shared library built by ``setup.py`` with nvcc from ``csrc/cuda``
(its C API is ``csrc/cuda/distemb_cuda.h``), loaded on first use. This module declares
its C signatures, checks its ABI version and summation chunk, and says why the kernels
cannot run where they cannot; :mod:`distemb.kernels.cuda` wraps the entry points.

Example:
    >>> from distemb.kernels import cuda_lib
    >>> isinstance(cuda_lib.cuda_available(), bool)
    True
"""
import ctypes
import functools
import os

import torch

from distemb.errors import DistEmbError
from distemb.kernels import rule_table

CUDA_LIB_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "_cuda_kernels.so")
# Must equal DISTEMB_CUDA_ABI_VERSION in csrc/cuda/distemb_cuda.h.
ABI_VERSION = 4
MAX_BATCH = 2**31 - 1  # the dedup kernels index positions with int32
# Rows per chunk of dedup_sum's segment sum (kSumChunk in csrc/cuda/common.cuh, checked
# when the library loads): the order of its additions, which tests/cpu_cuda_twin.py mirrors.
SUM_CHUNK = 32
# The flags of gather_rows_checked before any bad id: (count, smallest, largest).
CLEAN_ID_FLAGS = (0, 2**63 - 1, -2**63)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _F64, _SIZE = ctypes.c_float, ctypes.c_double, ctypes.c_size_t
_U64 = ctypes.c_uint64
# Every C entry point: (return type, argument types). Trailing (int device, void* stream).
_SIGNATURES = {
    "distemb_cuda_abi_version": (_INT, []),
    "distemb_cuda_error_string": (ctypes.c_char_p, [_INT]),
    "distemb_cuda_device_count": (_INT, [ctypes.POINTER(_INT)]),
    "distemb_cuda_sum_chunk_rows": (_INT, []),
    "distemb_cuda_dedup_workspace_bytes":
        (_INT, [_I64, _I64, _INT, ctypes.POINTER(_SIZE), _INT]),
    "distemb_cuda_dedup_sort":
        (_INT, [_P, _I64, _I64, _I64, _INT, _P, _SIZE, _P, _P, _INT, _P]),
    "distemb_cuda_dedup_sum": (_INT, [_P, _I64, _I64, _P, _SIZE, _P, _INT, _P]),
    "distemb_cuda_gather_rows": (_INT, [_P, _I64, _P, _I64, _P, _INT, _P]),
    "distemb_cuda_gather_rows_checked": (_INT, [_P, _I64, _I64, _P, _I64, _P, _P, _INT, _P]),
    "distemb_cuda_rowwise_adagrad_update":
        (_INT, [_P, _P, _I64, _I64, _P, _P, _I64, _F32, _F32, _INT, _P]),
    "distemb_cuda_adam_update": (_INT, [_P, _P, _P, _I64, _I64, _P, _P, _I64, _F64, _F64, _F64,
                                        _F64, _I64, _P, _INT, _P]),
    # Half-precision rows (weight bits, kind, seed, ...): distemb.kernels.cuda_half.
    "distemb_cuda_half_gather_rows_checked":
        (_INT, [_P, _INT, _I64, _I64, _P, _I64, _P, _P, _INT, _P]),
    "distemb_cuda_half_rowwise_adagrad_update":
        (_INT, [_P, _INT, _U64, _P, _I64, _I64, _P, _P, _I64, _F32, _F32, _INT, _P]),
    "distemb_cuda_half_adam_update":
        (_INT, [_P, _INT, _U64, _P, _P, _I64, _I64, _P, _P, _I64, _F64, _F64, _F64, _F64,
                _I64, _P, _INT, _P]),
}
_CTYPE = {"float": _F32, "double": _F64}


def _rule_signatures(rule):
    """The C signatures of an element-wise rule's two entry points (csrc/gen/cuda_rules.h,
    generated from the same table entry): weight [kind, seed], its states, num_rows, d,
    rows, grads, n, its hyperparameters, device, stream."""
    states = [_P] * len(rule.states)
    tail = [_I64, _I64, _P, _P, _I64] + [_CTYPE[c] for _, c in rule.hyper] + [_INT, _P]
    return {f"distemb_cuda_{rule.kernel}": (_INT, [_P] + states + tail),
            f"distemb_cuda_half_{rule.kernel}": (_INT, [_P, _INT, _U64] + states + tail)}


for _rule in rule_table.RULES:
    _SIGNATURES.update(_rule_signatures(_rule))
del _rule
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
    chunk = lib.distemb_cuda_sum_chunk_rows()
    if chunk != SUM_CHUNK:
        raise CudaUnavailableError(f"{path} sums in chunks of {chunk} rows, expected "
                                   f"{SUM_CHUNK} (distemb.kernels.cuda.SUM_CHUNK): a stale "
                                   "build. " + _BUILD_HINT)
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
