"""Shared memory between a server and the trainers on its machine: sealed memory files
handed over as file descriptors.

Nothing is named. Every segment is an anonymous memory file (``memfd_create``) whose size
is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before any other process sees
it, and it reaches the peer as a file descriptor carried by a frame on the Unix-domain
socket between the two processes (``SCM_RIGHTS``, :mod:`distemb.transport.tcp`), which
only a process of the same user may connect. So there is no path a peer could point
elsewhere, no file mode to get wrong, no size that can change under a reader (a
truncation, which made a reader die of SIGBUS, is refused by the kernel), and nothing to
clean up: a segment's memory is freed when the last process holding it (a descriptor or
a mapping) exits, however it exits. /dev/shm is not used.

Shards (server to trainer): a server allocates every shard it owns in a segment
(:class:`ShmArena`) and maps it read-write; asked (``ShmInfo``), it hands a co-located
trainer a read-only descriptor of it, which the trainer maps read-only (:func:`attach`)
and gathers rows from directly (a pull with no round trip). Only the server writes
(DESIGN.md, Concurrency: one writer per row); a read-only descriptor cannot be mapped
writable.

No torn rows: a segment starts with a 64-byte header whose first 8 bytes are a version
counter (a seqlock); the next 8 hold the counter's odd value of the last write answered
early that failed (:mod:`distemb.kvstore.server.early`: the trainer that sent it reads
there whether an error frame follows), the next 8 its value once the rows that write was
asked to apply first are written (the rows its trainer looks up next). The server makes the counter odd before it
writes the shard and even after
(:class:`~distemb.kvstore.server.KVServer` does, under the shard's lock); a reader
copies its rows between two reads of the counter and keeps the copy only if both were
the same even value, else tries again, and after :data:`READ_TRIES` tries asks the server
(whose lock it then waits for). On x86-64 stores are seen in order and loads are not
reordered with loads, which is all this needs. A file table's rows are in a file on
disk (a :class:`~distemb.stores.file.FileStore`'s column): its segment is the header
alone, and the file comes beside it as a second, read-only descriptor, which the trainer
maps read-only after :func:`check_rows_file` (a disk file cannot be sealed: the store
never resizes a file it has open, and holds its directory's lock).

Request slots (trainer to server, :mod:`distemb.transport.slots`): a trainer writes the
arrays of an update or a push into its ``RequestSlot`` (one per connection to a
co-located server) and sends a small frame giving their places in it
(:class:`~distemb.transport.messages.InShm`); the first frame that uses a new slot
carries its descriptor. The server maps it (``SlotReader``, one per connection), reads
the arrays in place and applies the request, still the only writer of its rows. The
trainer reuses the slot only after the server's reply, so the server never reads a slot
being rewritten.

Whoever receives a descriptor trusts it no more than the frame: :func:`check_segment`
refuses anything but a memory file of this user, of normal pages, sealed against
shrinking, growing and unsealing, of exactly the size the peer declared, before it is
mapped. Integer arrays read from a slot are copied out before the server checks them
(the trainer can still write the slot's contents, never its size).

Example:
    >>> arena = ShmArena("doc", 0)
    >>> a = arena.allocate((2, 3), "float32")
    >>> b = attach(arena.dup_segment(a), (2, 3), "float32")
    >>> a[1] = 7; float(b.array[1, 0])
    7.0
    >>> b.read(lambda rows: rows[1].tolist())
    [7.0, 7.0, 7.0]
    >>> arena.close()
"""
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
import time

import numpy as np

from distemb.errors import TransportError
from distemb.pages import populate_shared

HEADER_BYTES = 64  # the version counter, the first rows' word, padding to a cache line
#: Words of the header: the seqlock counter, the counter of the last write whose first
#: rows are written (the rest still being written).
HEADER_WORDS = 2
READ_TRIES = 64
#: The seals every segment carries before it leaves its maker: its size is fixed for good.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)  # Linux 6.3+: never executable


def _memfd(name):
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | _MFD_NOEXEC_SEAL)
    except OSError as e:
        if e.errno != errno.EINVAL:  # an older kernel without MFD_NOEXEC_SEAL
            raise
        return os.memfd_create(name, flags)


def new_segment(name, size):
    """A new memory file of ``size`` bytes, sealed (:data:`SEALS`); its read-write
    descriptor. Its pages come when written (a shard's are allocated by
    :meth:`ShmArena.allocate` at once).

    Args:
        name: shown in /proc/<pid>/fd and /proc/<pid>/maps (``/memfd:<name>``).

    Raises:
        TransportError: the kernel refused (no memory, no memfd support).
    """
    try:
        fd = _memfd(name)
    except OSError as e:
        raise TransportError(f"shared memory: cannot create a memory file: {e}") from None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as e:
        os.close(fd)
        raise TransportError(f"shared memory: cannot size a memory file to {size:,} bytes: "
                             f"{e}") from None
    return fd


def readonly(fd):
    """A read-only descriptor of the memory file ``fd`` (it cannot be mapped writable)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe or FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "an anonymous or special file"


def check_segment(fd, size, what):
    """Refuse ``fd`` unless it is a segment as this module makes them: a memory file of
    this user, of normal pages, sealed (:data:`SEALS`), of exactly ``size`` bytes.

    A descriptor that passes cannot change size while it is mapped, so a read within
    ``size`` bytes never faults (no SIGBUS).

    Raises:
        TransportError: naming ``what``, what the descriptor is, and what was expected.
    """
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise TransportError(f"{what}: descriptor {fd} cannot be inspected: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TransportError(f"{what}: expected a sealed memory file, got {_kind(st.st_mode)}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:  # a file of a disk or of /dev/shm: it cannot be sealed at all
        raise TransportError(f"{what}: expected a sealed memory file (memfd_create), got a "
                             f"file that cannot be sealed ({e.strerror})") from None
    if seals & SEALS != SEALS:
        raise TransportError(f"{what}: expected a memory file sealed against shrinking, "
                             f"growing and unsealing (seals {SEALS:#x}), got seals "
                             f"{seals:#x}")
    if st.st_uid != os.getuid():
        raise TransportError(f"{what}: the memory file belongs to uid {st.st_uid}, not to "
                             f"this user ({os.getuid()})")
    if st.st_blksize != mmap.PAGESIZE:  # hugetlbfs: a fault may still fail
        raise TransportError(f"{what}: expected a memory file of {mmap.PAGESIZE}-byte pages, "
                             f"got pages of {st.st_blksize} bytes")
    if st.st_size != size:
        raise TransportError(f"{what}: the memory file has {st.st_size} bytes, the peer "
                             f"declared {size}")


def map_segment(fd, size, writable):
    """A shared mapping of ``size`` bytes of ``fd`` (read-only unless ``writable``)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)


class ShmArena:
    """Allocates a server's shard arrays in sealed memory files and hands them out.

    Args:
        job: the job id; server_id: the owning server (both name the memory files, for
            /proc/<pid>/maps).
    """

    def __init__(self, job, server_id):
        self.job, self.name = job, f"distemb-{job}-s{server_id}"
        self._ids = itertools.count()
        self._lock = threading.Lock()  # a descriptor is never duplicated while closed
        self._segments = {}  # id(array) -> (read-only descriptor, version counter, array)

    def allocate(self, shape, dtype):
        """A zero-filled array of ``shape``/``dtype`` in a new memory file.

        Raises:
            TransportError: the memory cannot be allocated.
        """
        nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        size = HEADER_BYTES + nbytes
        fd = new_segment(f"{self.name}-{next(self._ids)}", size)
        try:
            mem = map_segment(fd, size, writable=True)
            # Rows are read and written at random: on 2 MiB pages where the machine allows
            # them. Allocated now either way: a server that cannot hold it fails here.
            if not populate_shared(mem):
                os.posix_fallocate(fd, 0, size)
            ro = readonly(fd)
        except OSError as e:
            raise TransportError(f"shared memory: cannot allocate {nbytes:,} bytes: {e}") \
                from None
        finally:
            os.close(fd)
        version = np.ndarray((HEADER_WORDS,), np.int64, buffer=mem)
        arr = np.ndarray(tuple(shape), dtype, buffer=mem, offset=HEADER_BYTES) if nbytes \
            else np.zeros(shape, dtype)
        with self._lock:
            self._segments[id(arr)] = (ro, version, arr)
        return arr

    def dup_segment(self, arr):
        """A new read-only descriptor of the memory file behind ``arr`` (the caller
        closes it), or None when ``arr`` is not from this arena."""
        with self._lock:
            have = self._segments.get(id(arr))
            return None if have is None else os.dup(have[0])

    def version_of(self, arr):
        """The header of ``arr``'s segment (:data:`HEADER_WORDS` int64: the seqlock
        counter, the last write's whose first rows are in), or None."""
        return self._segments.get(id(arr), (None, None))[1]

    def release(self, arr):
        """Forget ``arr``: its memory goes once nobody maps it any more."""
        with self._lock:
            have = self._segments.pop(id(arr), None)
            if have is not None:
                os.close(have[0])

    def close(self):
        """Release every segment."""
        with self._lock:
            for ro, _, _ in self._segments.values():
                os.close(ro)
            self._segments.clear()


class ShmShard:
    """A shard mapped read-only, and the version counter its server writes.

    Args:
        array: the rows.
        version: the segment's header: ``version[0]`` the counter (odd while the server
            writes), ``version[1]`` its value once the first rows of the write are
            written (:mod:`distemb.kvstore.server.early`).
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


def check_rows_file(fd, size, what):
    """Refuse ``fd`` unless it is a regular file of this user (a file store's column on
    disk) of exactly ``size`` bytes, opened read-only.

    A disk file cannot be sealed: its size is checked here, and its store never changes
    it while the file is open (a :class:`~distemb.stores.file.FileStore` holds its
    directory's lock, and sizes its files only when it makes them).

    Raises:
        TransportError: naming ``what``, what the descriptor is, and what was expected.
    """
    try:
        st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise TransportError(f"{what}: descriptor {fd} cannot be inspected: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TransportError(f"{what}: expected a regular file, got {_kind(st.st_mode)}")
    if flags & os.O_ACCMODE != os.O_RDONLY:
        raise TransportError(f"{what}: expected a read-only descriptor, got one open for "
                             "writing")
    if st.st_uid != os.getuid():
        raise TransportError(f"{what}: the file belongs to uid {st.st_uid}, not to this "
                             f"user ({os.getuid()})")
    if st.st_size != size:
        raise TransportError(f"{what}: the file has {st.st_size} bytes, expected {size}")


def attach(fd, shape, dtype, rows_fd=None):
    """Map a shard read-only: its segment (a seqlock header, then the rows), or, with
    ``rows_fd``, a header-only segment ``fd`` and the rows in the file ``rows_fd`` (a
    file store's column, :func:`check_rows_file`). The descriptors are closed (the
    mappings stay valid).

    Returns:
        a :class:`ShmShard`.

    Raises:
        TransportError: ``fd`` is not a sealed memory file of exactly the size expected,
            or ``rows_fd`` not a read-only file of this user of the rows' size.
    """
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    need = HEADER_BYTES + (0 if rows_fd is not None else nbytes)
    try:
        check_segment(fd, need, "shard segment")
        mem = map_segment(fd, need, writable=False)
        populate_shared(mem, write=False)  # mapped now, with the server's huge pages
        rows, offset = mem, HEADER_BYTES
        if rows_fd is not None:
            check_rows_file(rows_fd, nbytes, "shard rows file")
            rows, offset = (map_segment(rows_fd, nbytes, writable=False) if nbytes else None), 0
            if nbytes:
                rows.madvise(mmap.MADV_RANDOM)  # as its store maps it: no read-ahead
    except OSError as e:
        raise TransportError(f"shard segment: cannot map {need} bytes: {e}") from None
    finally:
        os.close(fd)
        if rows_fd is not None:
            os.close(rows_fd)
    version = np.ndarray((HEADER_WORDS,), np.int64, buffer=mem)
    if not nbytes:
        return ShmShard(np.zeros(shape, dtype), version)
    return ShmShard(np.ndarray(tuple(shape), dtype, buffer=rows, offset=offset), version)


def attach_all(fds, segments, shapes, dtypes, files=None):
    """:func:`attach` the segments a ShmInfo reply handed over; every descriptor is closed.

    Args:
        fds: the reply's descriptors, in order: one per true entry of ``segments``, and
            after it, where ``files`` is true, the file of that part's rows.
        segments, shapes, dtypes: per part asked for, whether it has a segment, its shape
            and dtype.
        files: per part, whether its rows are in a file (its segment is then a seqlock
            header only); None: in no part.

    Returns:
        a :class:`ShmShard` per part (None for a part without a segment).

    Raises:
        TransportError: the descriptors do not match ``segments``, or one is refused.
    """
    fds = list(fds)
    try:
        files = [False] * len(segments) if files is None else files
        if not isinstance(segments, list) or not isinstance(files, list) or \
                len(fds) != sum(map(bool, segments)) + sum(map(bool, files)) or \
                not len(segments) == len(shapes) == len(dtypes) == len(files) or \
                any(f and not s for s, f in zip(segments, files)):
            raise TransportError(f"ShmInfo reply: {len(fds)} descriptors for segments "
                                 f"{str(segments)[:80]} and files {str(files)[:80]}")
        out = []
        for has, shape, dtype, file in zip(segments, shapes, dtypes, files):
            if not has:
                out.append(None)
                continue
            fd = fds.pop(0)
            out.append(attach(fd, tuple(shape), dtype, fds.pop(0) if file else None))
        return out
    finally:
        for fd in fds:
            os.close(fd)
