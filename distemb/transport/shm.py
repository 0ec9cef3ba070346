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

Every file is created by its owner with mode 0600 (``O_CREAT|O_EXCL|O_NOFOLLOW``: never
through a link, never one that already exists), so another user on the machine can
neither read a table nor plant a file a server would map. Files are named
``distemb-p<pid>-<job>-s<server>-<n>`` after the owning server's pid;
the server unlinks them on every exit it can catch (a mapped file stays readable by
trainers that still hold it), and :func:`remove_orphans` removes the files of servers
that are gone (killed by SIGKILL, say), as every launch on the machine does first.

The other direction (co-located writes): a trainer writes the arrays of an update or a
push into its :class:`RequestSlot` (one file per trainer and server,
``distemb-p<pid>-<job>-t<rank>-s<server>-<token>-<generation>``, after the trainer's pid
so that :func:`remove_orphans` removes a killed trainer's slots too, as a server whose
launcher died does at once: :func:`remove_job_orphans`) and sends only a small frame
naming the file and the arrays' places in it (:class:`~distemb.transport.messages.InShm`); the
server maps the file (:class:`SlotReader`), reads the arrays in place and applies the
request, still the only writer of its rows. The trainer reuses the slot only after the
server's reply, so the server never reads a slot being rewritten. The server trusts a
slot file no more than the frame that names it: it opens it without following links
(``O_NOFOLLOW|O_NONBLOCK``: a FIFO cannot block it), maps it only if it is a regular
file of this user, and checks its size again (``fstat`` of the file it mapped) before
every use, so a file truncated after it was mapped is refused, not read past its end.

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
import stat
import time
import uuid

import numpy as np

from distemb.errors import TransportError
from distemb.transport.base import CODE_OF, DTYPE_CODES, MAX_ARRAYS, MAX_NDIM

#: Array offsets in a request slot are multiples of this (cache-line aligned rows).
SLOT_ALIGN = 64

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64  # the version counter, then padding to a cache line
READ_TRIES = 64
_OWNED = re.compile(r"^distemb-p(\d+)-")
log = logging.getLogger("distemb")


def create_private(path):
    """A new file ``path`` opened read-write, mode 0600: refused if anything (a file, a
    link, a FIFO) is already there, so nobody else's file is ever written or mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "w+b")


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
        self.job, self.directory = job, directory
        self.prefix = os.path.join(directory, f"distemb-p{os.getpid()}-{job}-s{server_id}-")
        self._ids = itertools.count()
        self._files = {}  # id(array) -> (path, version counter, array)

    def allocate(self, shape, dtype):
        """A zero-filled array of ``shape``/``dtype`` backed by a new shm file."""
        path = f"{self.prefix}{next(self._ids)}"
        size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        try:
            with create_private(path) as f:
                # Reserve the pages now: a sparse file would fail later with SIGBUS, in
                # the middle of training, when /dev/shm fills up.
                os.posix_fallocate(f.fileno(), 0, HEADER_BYTES + size)
                version = np.memmap(f, dtype=np.int64, mode="r+", shape=(1,))
                arr = np.memmap(f, dtype=dtype, mode="r+", shape=tuple(shape),
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


def remove_orphans(directory=SHM_DIR, job=None):
    """Unlink the shard files and request slots whose owning process (a server, a
    trainer) no longer exists (or is a zombie).

    Args:
        job: only the files of this job id (None: of every job).

    Returns:
        the paths removed.
    """
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        match = _OWNED.match(name)
        if not match or (job is not None and not name.startswith(
                f"{match.group(0)}{job}-")) or _alive(int(match.group(1))):
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
    try:  # a zombie (killed, not yet reaped by its new parent) holds nothing any more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def remove_job_orphans(job, wait_s, directory=SHM_DIR):
    """Unlink the files of job ``job`` whose owners are gone, waiting up to ``wait_s`` s
    for the owners of the rest to go too (a server whose launcher died: the kernel is
    killing the job's trainers at the same moment, and their request slots must not stay).

    Returns:
        the names of the job's files still there (their owners outlived the wait).
    """
    deadline = time.monotonic() + wait_s
    while True:
        remove_orphans(directory, job)
        left = [n for n in os.listdir(directory) if _OWNED.match(n) and f"-{job}-" in n]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


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


def _aligned(n):
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class RequestSlot:
    """A trainer's shared-memory buffer for the arrays of its requests to one server.

    The file grows (a new generation, the old one unlinked) when a request needs more
    room; it is reused for every request, so the caller must not write it again before
    the server answered the previous one.

    Args:
        job: the job id; rank: this trainer; server_id: the co-located server.
        directory: where the file lives (default /dev/shm).

    Example:
        >>> slot = RequestSlot("doc", 0, 0)
        >>> path, layout = slot.write([np.arange(3)])
        >>> reader = SlotReader("doc", os.path.dirname(path))
        >>> reader.arrays(path, layout)[0].tolist()
        [0, 1, 2]
        >>> slot.close(); reader.close()
    """

    def __init__(self, job, rank, server_id, directory=SHM_DIR):
        # A token per slot: a later client of the same rank never reuses a file name a
        # server still has mapped.
        self._prefix = os.path.join(directory, f"distemb-p{os.getpid()}-{job}-t{rank}-"
                                               f"s{server_id}-{uuid.uuid4().hex[:12]}-")
        self._gen = itertools.count()
        self.path, self._map = None, None

    def write(self, arrays):
        """Copy ``arrays`` into the slot; an array already in it (see :meth:`view`) stays.

        Returns:
            (path, layout): the file, and ``[dtype code, shape, offset]`` per array, as
            :meth:`SlotReader.arrays` takes them.
        """
        placed = [self._offset_of(a) for a in arrays]
        start = max([off + a.nbytes for a, off in zip(arrays, placed) if off is not None],
                    default=0)
        offsets, need = [], _aligned(start)
        for a, off in zip(arrays, placed):
            offsets.append(need if off is None else off)
            if off is None:
                need = _aligned(need + a.nbytes)
        if self._map is None or self._map.shape[0] < need:
            if any(off is not None for off in placed):  # growing would drop them
                return self._write_moved(arrays)
            self._grow(need)
        for a, off, at in zip(arrays, placed, offsets):
            if off is None and a.nbytes:
                view = np.ndarray(a.shape, a.dtype, buffer=self._map, offset=at)
                np.copyto(view, a, casting="no")
        return self.path, [[CODE_OF[a.dtype], list(a.shape), at]
                           for a, at in zip(arrays, offsets)]

    def _write_moved(self, arrays):
        copies = [np.array(a) for a in arrays]
        self._grow(sum(_aligned(a.nbytes) for a in copies))
        return self.write(copies)

    def view(self, shape, dtype):
        """An array at the start of the slot, to fill in place (a coalescing buffer).

        :meth:`write` sends it without a copy; it is valid until the next request to
        this server is written.
        """
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self._map is None or self._map.shape[0] < nbytes:
            self._grow(nbytes)
        return np.ndarray(shape, dtype, buffer=self._map, offset=0)

    def _offset_of(self, a):
        """The offset of ``a`` in the current mapping, or None when it is not wholly in it."""
        if self._map is None or not a.flags.c_contiguous or not a.nbytes:
            return None
        base = self._map.ctypes.data
        off = a.ctypes.data - base
        if 0 <= off and off + a.nbytes <= self._map.shape[0] and off % SLOT_ALIGN == 0:
            return off
        return None

    def _grow(self, size):
        size = max(size, 1 << 20, 0 if self._map is None else 2 * self._map.shape[0])
        old = self.path
        self.path = f"{self._prefix}{next(self._gen)}"
        with create_private(self.path) as f:
            f.truncate(size)
            self._map = np.memmap(f, dtype=np.uint8, mode="r+", shape=(size,))
        if old and os.path.exists(old):
            os.unlink(old)  # the server's mapping of it stays valid until it remaps

    def close(self):
        """Unlink the file (mappings stay valid until dropped)."""
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
        self.path, self._map = None, None


class SlotReader:
    """A server's mappings of its co-located trainers' request slots.

    Only files named like a :class:`RequestSlot` of job ``job`` in ``directory`` are
    opened; one mapping per trainer is kept (a newer generation replaces the older).

    Args:
        job: the job id; directory: where slots live (default /dev/shm).
    """

    def __init__(self, job, directory=SHM_DIR):
        self._name = re.compile(rf"(distemb-p\d+-{re.escape(job)}-t\d+-s\d+-)[0-9a-f]{{12}}-\d+")
        self.directory = directory
        self._maps = {}  # slot prefix -> (path, its open fd, mapping)

    def arrays(self, path, layout):
        """The arrays ``layout`` describes in the slot file ``path``: views of the float
        arrays (rows, gradients: read in place), copies of the integer ones.

        Integer arrays are ids, counts and versions: the server checks them, then indexes
        its shards with them. The trainer can still write its slot after the check; a
        view would let it swap a checked id for one past the end of a shard between the
        check and the compiled gather or update (an out-of-bounds read or write). A copy
        is checked and used as one value; the copy is small (8 bytes per row against a
        row's 4 * dim). A float changed meanwhile is only a wrong value, which a token
        holder may send anyway.

        Raises:
            TransportError: the path is not a slot of this job, the file is missing, or
                a descriptor is invalid or reaches past the end of the file.
        """
        mapping = self._mapping(path)
        if not isinstance(layout, list) or len(layout) > MAX_ARRAYS:
            raise TransportError(f"slot layout: expected a list of at most {MAX_ARRAYS} "
                                 f"arrays, got {str(layout)[:60]}")
        out = []
        for i, desc in enumerate(layout):
            ok = isinstance(desc, list) and len(desc) == 3 and desc[0] in DTYPE_CODES and \
                isinstance(desc[1], list) and len(desc[1]) <= MAX_NDIM and \
                all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in desc[1] + [desc[2]]) and desc[2] % SLOT_ALIGN == 0
            if not ok:
                raise TransportError(f"slot array {i}: invalid descriptor {str(desc)[:60]}")
            dtype, shape, off = DTYPE_CODES[desc[0]], tuple(desc[1]), desc[2]
            nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64)) if shape else \
                dtype.itemsize
            if off + nbytes > mapping.shape[0]:
                raise TransportError(f"slot array {i}: {nbytes} bytes at offset {off} reach "
                                     f"past the end of {path} ({mapping.shape[0]} bytes)")
            view = np.ndarray(shape, dtype, buffer=mapping, offset=off)
            out.append(np.array(view) if dtype.kind in "iub" else view)
        return out

    def _mapping(self, path):
        match = self._name.fullmatch(os.path.basename(str(path)))
        if match is None or os.path.dirname(str(path)) != self.directory:
            raise TransportError(f"slot path: {str(path)[:80]!r} is not a request slot of "
                                 f"this job in {self.directory}")
        have = self._maps.get(match.group(1))
        if have is not None and have[0] == path:
            _, fd, mapping = have
            if os.fstat(fd).st_size < mapping.shape[0]:  # truncated since it was mapped
                self._forget(match.group(1))
                raise TransportError(f"slot path: {path} shrank below the "
                                     f"{mapping.shape[0]} bytes mapped")
            return mapping
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise TransportError(f"slot path: cannot open {path}: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or not st.st_size:
                raise TransportError(f"slot path: {path} is not a non-empty regular file "
                                     "of this user")
            with os.fdopen(os.dup(fd), "rb") as f:
                mapping = np.memmap(f, dtype=np.uint8, mode="r", shape=(st.st_size,))
        except (OSError, ValueError, TransportError) as e:
            os.close(fd)
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"slot path: cannot map {path}: {e}") from None
        self._forget(match.group(1))
        self._maps[match.group(1)] = (path, fd, mapping)
        return mapping

    def _forget(self, prefix):
        have = self._maps.pop(prefix, None)
        if have is not None:
            os.close(have[1])

    def close(self):
        """Drop every mapping."""
        for prefix in list(self._maps):
            self._forget(prefix)
