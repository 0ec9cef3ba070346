"""What a server may allocate: the memory and shared-memory space left on this machine.

A table a server cannot hold is refused when it is created, with the numbers, instead of
being accepted and failing later (an untouched ``np.zeros`` or a sparse /dev/shm file
costs nothing until its pages are written: the server would die of the OOM killer or
SIGBUS mid-training).

Example:
    >>> check_fits(1 << 20, "table 'w'")  # a MiB fits anywhere
    >>> available_memory() > 0
    True
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
    """Bytes free in the file system of ``directory`` (e.g. /dev/shm, a tmpfs)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_fits(nbytes, what, shm_dir=None):
    """Raise unless ``nbytes`` more fit in memory (and in ``shm_dir`` when given).

    Args:
        nbytes: bytes about to be allocated (Python int: never overflows).
        what: what they are for, for the message.
        shm_dir: the shared-memory directory the bytes go to, or None for private memory.

    Raises:
        KVStoreError: naming the bytes asked for and the bytes available.
    """
    room = int(available_memory() * HEADROOM)
    where = "memory (90% of MemAvailable)"
    if shm_dir is not None:
        shm = int(free_space(shm_dir) * HEADROOM)
        if shm < room:
            room, where = shm, f"{shm_dir} (90% of its free space)"
    if nbytes > room:
        raise KVStoreError(f"{what}: needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB), but "
                           f"this server has {room:,} bytes ({room / 2**30:.2f} GiB) left in "
                           f"{where}; use more servers or a smaller table")
