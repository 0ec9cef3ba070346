"""What a server may allocate: the memory left on this machine, and what any one request
may make it allocate.

A table a server cannot hold is refused when it is created, with the numbers, instead of
being accepted and failing later (an untouched ``np.zeros`` costs nothing until its pages
are written: the server would die of the OOM killer mid-training). Shards in shared
memory are memory files (:mod:`distemb.transport.shm`): the same memory, and their
pages are reserved when they are made.

Every other request is bounded by :func:`check_request`: the memory it would make the
server allocate (a reply's rows, keys a lookup inserts) must be at most the job's
``max_message_bytes`` (1 GiB by default; no reply over it could be sent anyway), checked
from the request's numbers before anything is allocated.

Example:
    >>> check_fits(1 << 20, "table 'w'")  # a MiB fits anywhere
    >>> available_memory() > 0
    True
    >>> check_request(10 * (1 << 40), 1 << 30, "pull of 10 rows of 'w'")
    Traceback (most recent call last):
    ...
    distemb.errors.KVStoreError: pull of 10 rows of 'w': would make this server allocate ...
"""
import os

from distemb.errors import KVStoreError

HEADROOM = 0.9  # leave a tenth for the process itself, page tables and the kernel


def available_memory():
    """Bytes of memory new allocations can use (MemAvailable of /proc/meminfo)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_space(directory):
    """Bytes free in the file system of ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_fits(nbytes, what):
    """Raise unless ``nbytes`` more fit in memory.

    Args:
        nbytes: bytes about to be allocated (Python int: never overflows).
        what: what they are for, for the message.

    Raises:
        KVStoreError: naming the bytes asked for and the bytes available.
    """
    room = int(available_memory() * HEADROOM)
    where = "memory (90% of MemAvailable)"
    if nbytes > room:
        raise KVStoreError(f"{what}: needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB), but "
                           f"this server has {room:,} bytes ({room / 2**30:.2f} GiB) left in "
                           f"{where}; use more servers or a smaller table")


def check_request(nbytes, limit, what):
    """Raise unless one request's ``nbytes`` of new memory are within ``limit``.

    Args:
        nbytes: what the request would make the server allocate (a Python int).
        limit: the job's bound per request (``ClusterConfig.max_message_bytes``).
        what: the request, for the message.

    Raises:
        KVStoreError: naming both numbers.
    """
    if nbytes > limit:
        raise KVStoreError(f"{what}: would make this server allocate {nbytes:,} bytes, over "
                           f"the limit of {limit:,} bytes per request (max_message_bytes); "
                           "ask for fewer rows per request")


def check_disk(nbytes, what, directory):
    """Raise unless ``nbytes`` fit in 90% of the free space of ``directory``'s file system.

    Raises:
        KVStoreError: naming the bytes asked for and the bytes free.
    """
    try:
        room = int(free_space(directory) * HEADROOM)
    except OSError as e:
        raise KVStoreError(f"{what}: cannot stat {directory!r} ({e.strerror})") from None
    if nbytes > room:
        raise KVStoreError(f"{what}: needs {nbytes:,} bytes on disk, but {directory} has "
                           f"{room:,} bytes left (90% of its free space)")
