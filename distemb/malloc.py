"""glibc malloc tuned for a training loop's large, short-lived buffers.

Every step allocates and frees the same few large arrays: looked-up rows, their
gradients, the rows of a request (2 MiB for 4,096 rows of 128 floats). glibc's malloc
adapts its mmap threshold to the largest freed chunk and then trims the top of the heap
whenever more than twice that is free. With two such buffers freed per step, the same
pages go back to the kernel and are faulted in again every step: 512 minor faults per
2 MiB buffer. Whether a process falls into this depends on the order of its first
allocations, so the same job runs at two speeds. Measured on the co-located 1 server x
1 trainer job (B=4096, D=128, 600 steps): 795,000 minor faults and 311-365 steps/s
untuned, 180,000 faults and 821-912 steps/s tuned, in turns on the same machine.

:func:`tune` (called when :mod:`distemb` is imported, in trainers and servers alike)
fixes the mmap threshold at 32 MiB (glibc's upper bound for it) and the trim threshold
at 256 MiB, so buffers up to 32 MiB are reused from the heap and a process keeps at
most 256 MiB of freed heap before returning it. It changes nothing where the user has
chosen: a ``MALLOC_*_`` variable or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``,
``DISTEMB_MALLOC=default``, or a C library other than glibc (jemalloc or tcmalloc
preloaded do their own caching).

Example:
    >>> import distemb  # tunes this process's malloc, once
    >>> distemb.malloc.MMAP_THRESHOLD >> 20, distemb.malloc.TRIM_THRESHOLD >> 20
    (32, 256)
"""
import ctypes
import os

#: mallopt parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap (glibc refuses more than 32 MiB).
MMAP_THRESHOLD = 32 << 20
#: Freed heap kept before it is returned to the kernel.
TRIM_THRESHOLD = 256 << 20

#: Environment variables by which a user tunes glibc malloc; any of them set: hands off.
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")

_tuned = None


def _user_chose() -> bool:
    if os.environ.get("DISTEMB_MALLOC", "") == "default":
        return True
    if any(v in os.environ for v in USER_SETTINGS):
        return True
    return "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _glibc_mallopt():
    """libc's ``mallopt`` when this process runs glibc's malloc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl has no mallopt parameters like these)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def tune() -> bool:
    """Fix glibc malloc's thresholds (once per process); see the module docstring.

    Returns:
        whether this process's malloc is tuned by distemb.
    """
    global _tuned
    if _tuned is None:
        mallopt = None if _user_chose() else _glibc_mallopt()
        _tuned = bool(mallopt and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                      and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned
