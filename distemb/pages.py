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
on other systems, or when the kernel refuses, nothing changes (not an error). A
memory-mapped file on disk is left as it is (its pages are the page cache's).

Shared memory (a server's shards, which co-located trainers map read-only, and a
trainer's request slots) gets huge pages only where the machine allows them for shared
memory: ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to ``advise`` (or
``within_size``/``always``) by its administrator; many distributions ship ``never``.
:func:`advise_shared` asks for them on every such mapping and :func:`populate_shared`
allocates a server's shards on them, so the setting is all it takes: with ``never`` the
request is recorded (``hg`` in the mapping's ``VmFlags``) and changes nothing. Measured on the co-located 1 server x 1 trainer job:
benchmarks/README.md, "Shared memory on huge pages".

Example:
    >>> import numpy as np
    >>> back_with_huge_pages(np.zeros(4))  # small arrays are left alone
    False
"""
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys

import numpy as np

#: Arrays smaller than this are left alone (a few pages: no TLB pressure to relieve).
MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_madvise = None
#: Where Linux says whether shared memory may be on transparent huge pages.
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


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


def _advise(start, nbytes, collapse):
    """madvise [start, start + nbytes) (page-aligned); True if collapsed."""
    madvise = _libc_madvise()
    madvise(start, nbytes, _MADV_HUGEPAGE)  # later faults (and khugepaged) too
    return collapse and madvise(start, nbytes, _MADV_COLLAPSE) == 0


def shmem_setting() -> str:
    """The machine's policy for huge pages of shared memory (``never``, ``advise``, ...;
    ``unknown`` where it cannot be read)."""
    try:
        with open(SHMEM_ENABLED) as f:
            return next(w[1:-1] for w in f.read().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


def huge_shared_memory() -> bool:
    """Whether this machine lets shared memory that asks for them be on huge pages."""
    return shmem_setting() in ("advise", "within_size", "always", "force")


def _address(mem):
    view = np.frombuffer(mem, np.uint8)  # its address; dropped at once (mem stays closable)
    return view.ctypes.data


def advise_shared(mem) -> None:
    """Ask for 2 MiB pages for the shared mapping ``mem`` (an ``mmap.mmap`` of a memory
    file, which starts on a page): its faults get them where the machine allows huge
    pages for shared memory (:func:`huge_shared_memory`); elsewhere nothing changes."""
    if sys.platform.startswith("linux") and len(mem) >= MIN_BYTES:
        _advise(_address(mem), len(mem), False)


def populate_shared(mem, write=True) -> bool:
    """:func:`advise_shared`, then map every page of ``mem`` now (``MADV_POPULATE_WRITE``,
    allocating them, on 2 MiB pages where the machine allows them; ``MADV_POPULATE_READ``
    with ``write`` False: a reader's mapping of pages that exist); True if done. False (not
    an error) where the kernel lacks them (Linux < 5.14): the caller reserves the pages
    its own way (``posix_fallocate``) and they are mapped at their first touch.

    A page first touched in a step costs that step a fault: a fresh Adagrad state's pages
    made a co-located job's first 100 steps 0.67x of the same job's steps with them
    mapped (4 KiB pages, 200,000 x 128 rows). Faster than allocating 4 KiB pages and
    collapsing them into huge ones (512 MiB: 0.11-0.17 s against 0.39-0.79 s).

    Raises:
        OSError: the memory cannot be had (ENOMEM).
    """
    advise_shared(mem)
    if not sys.platform.startswith("linux") or not len(mem):
        return False
    return _populate(_address(mem), len(mem),
                     _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)


def _populate(start, nbytes, advice) -> bool:
    """madvise [start, start + nbytes) with a populate ``advice``; False where the kernel
    lacks it (EINVAL).

    Raises:
        OSError: the memory cannot be had (ENOMEM).
    """
    if _libc_madvise()(start, nbytes, advice) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, os.strerror(err))


def populate(array: np.ndarray) -> bool:
    """Map every page of ``array``'s memory now (``MADV_POPULATE_WRITE``), on 2 MiB pages
    where the kernel has them; True if done. A zero-filled array (``np.zeros``) has no
    page until its first touch, and a page first touched inside a step costs that step a
    fault: a fresh Adagrad state of 5M x 32 float32 rows took 15 ms a step to update
    13,000 random rows (its pages coming one fault at a time, step after step) against
    0.8 ms with its pages mapped. Small arrays (no TLB or fault cost worth a syscall),
    files on disk and kernels without the advice (Linux < 5.14) are left alone (False,
    not an error: the pages then come at their first touch).

    Raises:
        OSError: the memory cannot be had (ENOMEM).
    """
    if not sys.platform.startswith("linux") or not isinstance(array, np.ndarray) \
            or array.nbytes < MIN_BYTES or _file_backed(array):
        return False
    lo, hi = _huge_blocks(array)
    if hi > lo:
        _advise(lo, hi - lo, False)
    start = array.ctypes.data
    first = start & ~(mmap.PAGESIZE - 1)  # the pages the array lies on (its mapping's own)
    return _populate(first, start + array.nbytes - first, _MADV_POPULATE_WRITE)


def _huge_blocks(array):
    """``(lo, hi)``: the whole 2 MiB blocks inside ``array`` (the kernel maps nothing else
    huge; a heap neighbour keeps its own pages); empty when ``hi <= lo``."""
    start = array.ctypes.data
    return (start + _HUGE - 1) & ~(_HUGE - 1), (start + array.nbytes) & ~(_HUGE - 1)


def back_with_huge_pages(array: np.ndarray) -> bool:
    """Ask the kernel to keep ``array``'s memory on 2 MiB pages, now; True if it agreed.

    Only the whole 2 MiB blocks inside the array are asked for (the kernel maps nothing
    else huge); the values are unchanged. Call it after the array's pages were touched
    (filled): ``MADV_COLLAPSE`` works on pages that exist.
    """
    if not sys.platform.startswith("linux") or not isinstance(array, np.ndarray) \
            or array.nbytes < MIN_BYTES or _file_backed(array):
        return False
    lo, hi = _huge_blocks(array)
    return hi > lo and _advise(lo, hi - lo, True)
