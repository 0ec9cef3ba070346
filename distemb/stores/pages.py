"""Back a large in-memory table with 2 MiB pages, whatever the memory looked like at its
first touch.

A step gathers and updates random rows of tables far larger than the TLB's reach: on
4 KiB pages nearly every row costs a page walk, on 2 MiB pages almost none. numpy asks for
transparent huge pages on large arrays (``madvise(MADV_HUGEPAGE)``), but whether the
kernel has free 2 MiB blocks when the pages are first touched depends on the machine's
history (fragmentation), so a table may land on huge pages in one process and on 4 KiB
pages in the next: the same step then ran 1.3-2x slower (benchmarks/README.md,
bench_step's spread across fresh processes). :func:`back_with_huge_pages` asks again, and
synchronously: ``MADV_COLLAPSE`` (Linux 6.1+) moves the pages already touched onto huge
pages (compacting memory if it must), a no-op for the parts already on them. Best effort:
on other systems, or when the kernel refuses, nothing changes (not an error). Only a
process's own (anonymous) memory is asked for: the pages of a file (a server's shared
memory, a memory-mapped file) are other processes' too, and are left as they are.

Example:
    >>> import numpy as np
    >>> back_with_huge_pages(np.zeros(4))  # small arrays are left alone
    False
"""
import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

#: Arrays smaller than this are left alone (a few pages: no TLB pressure to relieve).
MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    return _madvise


def _file_backed(array):
    """Whether ``array``'s memory is a mapped file (np.memmap or mmap somewhere below)."""
    base = array
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def back_with_huge_pages(array: np.ndarray) -> bool:
    """Ask the kernel to keep ``array``'s memory on 2 MiB pages, now; True if it agreed.

    Only the whole 2 MiB blocks inside the array are asked for (the kernel maps nothing
    else huge); the values are unchanged. Call it after the array's pages were touched
    (filled): ``MADV_COLLAPSE`` works on pages that exist.
    """
    if not sys.platform.startswith("linux") or not isinstance(array, np.ndarray) \
            or array.nbytes < MIN_BYTES or _file_backed(array):
        return False
    start = array.ctypes.data
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = (start + array.nbytes) & ~(_HUGE - 1)
    if hi <= lo:
        return False
    madvise = _libc_madvise()
    madvise(lo, hi - lo, _MADV_HUGEPAGE)  # later faults (and khugepaged) too
    return madvise(lo, hi - lo, _MADV_COLLAPSE) == 0
