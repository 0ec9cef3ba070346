"""Shared-memory shards: arrays in /dev/shm files, mapped by a server and its neighbours.

A server on a machine allocates every shard it owns as a file under /dev/shm and maps
it read-write; a trainer on the same machine maps the same file read-only and gathers
rows from it directly (a pull with no round trip). Only the server writes (DESIGN.md,
Concurrency: one writer per row), so trainers never modify the mapping.

No torn rows: a file starts with a 64-byte header whose first 8 bytes are a version
counter (a seqlock). The server makes it odd before it writes the shard and even after
(:class:`~distemb.kvstore.server.KVServer` does, under the shard's lock); a reader
copies its rows between two reads of the counter and keeps the copy only if both were
the same even value, else tries again, and after :data:`READ_TRIES` tries asks the server
(whose lock it then waits for). On x86-64 stores are seen in order and loads are not
reordered with loads, which is all this needs.

Files are named ``distemb-p<pid>-<job>-s<server>-<n>`` after the owning server's pid;
the server unlinks them on every exit it can catch (a mapped file stays readable by
trainers that still hold it), and :func:`remove_orphans` removes the files of servers
that are gone (killed by SIGKILL, say), as every launch on the machine does first.

Example:
    >>> arena = ShmArena("doc", 0)
    >>> a = arena.allocate((2, 3), "float32")
    >>> b = attach(arena.path_of(a), (2, 3), "float32")
    >>> a[1] = 7; float(b.array[1, 0])
    7.0
    >>> b.read(lambda rows: rows[1].tolist())
    [7.0, 7.0, 7.0]
    >>> arena.close()
"""
import itertools
import logging
import os
import re
import time

import numpy as np

from distemb.errors import TransportError

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64  # the version counter, then padding to a cache line
READ_TRIES = 64
_OWNED = re.compile(r"^distemb-p(\d+)-")
log = logging.getLogger("distemb")


class ShmArena:
    """Allocates a server's shard arrays as shared-memory files and removes them.

    Args:
        job: job id shared by the processes of one cluster (part of every file name).
        server_id: the owning server.
        directory: where files go (default /dev/shm).
    """

    def __init__(self, job, server_id, directory=SHM_DIR):
        if not os.path.isdir(directory):
            raise TransportError(f"shared memory: {directory} does not exist")
        self.directory = directory
        self.prefix = os.path.join(directory, f"distemb-p{os.getpid()}-{job}-s{server_id}-")
        self._ids = itertools.count()
        self._files = {}  # id(array) -> (path, version counter, array)

    def allocate(self, shape, dtype):
        """A zero-filled array of ``shape``/``dtype`` backed by a new shm file."""
        path = f"{self.prefix}{next(self._ids)}"
        size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        try:
            with open(path, "w+b") as f:
                # Reserve the pages now: a sparse file would fail later with SIGBUS, in
                # the middle of training, when /dev/shm fills up.
                os.posix_fallocate(f.fileno(), 0, HEADER_BYTES + size)
            version = np.memmap(path, dtype=np.int64, mode="r+", shape=(1,))
            arr = np.memmap(path, dtype=dtype, mode="r+", shape=tuple(shape),
                            offset=HEADER_BYTES) if size else np.zeros(shape, dtype)
        except BaseException as e:
            if os.path.exists(path):
                os.unlink(path)
            if isinstance(e, OSError):
                raise TransportError(f"shared memory: cannot allocate {size:,} bytes in "
                                     f"{path}: {e}") from None
            raise
        self._files[id(arr)] = (path, version, arr)
        return arr

    def path_of(self, arr):
        """The file behind ``arr`` (None when it is not from this arena)."""
        return self._files.get(id(arr), (None,))[0]

    def version_of(self, arr):
        """The version counter of ``arr``'s file (a 1-element int64 array), or None."""
        return self._files.get(id(arr), (None, None))[1]

    def release(self, arr):
        """Unlink the file behind ``arr`` (mappings stay valid until dropped)."""
        path = self._files.pop(id(arr), (None,))[0]
        if path and os.path.exists(path):
            os.unlink(path)

    def close(self):
        """Unlink every file this arena made."""
        for path, _, _ in self._files.values():
            if os.path.exists(path):
                os.unlink(path)
        self._files.clear()


class ShmShard:
    """A shard mapped read-only, and the version counter its server writes.

    Args:
        array: the rows.
        version: the 1-element int64 counter (odd while the server writes).
    """

    def __init__(self, array, version):
        self.array, self.version = array, version

    def read(self, copy, tries=READ_TRIES):
        """``copy(array)`` taken while no write ran, or None after ``tries`` tries.

        ``copy`` must return a new array (a gather), never a view of the mapping.
        """
        for i in range(tries):
            before = int(self.version[0])
            if not before & 1:
                out = copy(self.array)
                if int(self.version[0]) == before:
                    return out
            if i:
                time.sleep(0)  # let the writer finish
        return None


def remove_orphans(directory=SHM_DIR):
    """Unlink the shard files whose owning server process no longer exists.

    Returns:
        the paths removed.
    """
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        match = _OWNED.match(name)
        if not match or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass  # another launch removed it first, or it is not ours to remove
    if removed:
        log.info("removed %d shared-memory file(s) of dead servers", len(removed))
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def attach(path, shape, dtype):
    """Map a shard file read-only.

    Returns:
        a :class:`ShmShard`.

    Raises:
        TransportError: the file is missing or smaller than ``shape`` needs.
    """
    need = HEADER_BYTES + int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise TransportError(f"shared memory: cannot open {path}: {e}") from None
    if size < need:
        raise TransportError(f"shared memory: {path} has {size} bytes, shard needs {need}")
    version = np.memmap(path, dtype=np.int64, mode="r", shape=(1,))
    if need == HEADER_BYTES:
        return ShmShard(np.zeros(shape, dtype), version)
    return ShmShard(np.memmap(path, dtype=dtype, mode="r", shape=tuple(shape),
                              offset=HEADER_BYTES), version)
