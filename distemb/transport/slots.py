"""Request slots: a trainer's shared-memory buffer for the arrays of its updates and pushes
to a co-located server (:class:`RequestSlot`), and the server's view of it
(:class:`SlotReader`). The segments are :mod:`distemb.transport.shm`'s sealed memory
files; its docstring says how they are handed over and checked.

Example:
    >>> slot = RequestSlot("doc", 0, 0)
    >>> layout = slot.write([np.arange(3, dtype=np.int64)])
    >>> reader = SlotReader(slot.take_fd(), slot.size)
    >>> reader.arrays(slot.size, layout)[0].tolist()
    [0, 1, 2]
    >>> reader.close(); slot.close()
"""
import itertools
import math
import os

import numpy as np

from distemb.errors import TransportError
from distemb.transport.base import CODE_OF, DTYPE_CODES, MAX_ARRAYS, MAX_NDIM
from distemb.transport.shm import check_segment, map_segment, new_segment, readonly

#: Array offsets in a request slot are multiples of this (cache-line aligned rows).
SLOT_ALIGN = 64
#: The largest request slot a server maps (address space only: a slot's pages are the
#: trainer's).
MAX_SLOT_BYTES = 1 << 40
MIN_SLOT_BYTES = 1 << 20


def _aligned(n):
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class RequestSlot:
    """A trainer's shared-memory buffer for the arrays of its requests to one server.

    A new, larger memory file replaces it when a request needs more room; it is reused
    for every request, so the caller must not write it again before the server answered
    the previous one.

    Args:
        job: the job id; rank: this trainer; server_id: the co-located server (they name
            the memory file, for /proc/<pid>/maps).

    Example:
        >>> slot = RequestSlot("doc", 0, 0)
        >>> layout = slot.write([np.arange(3)])
        >>> reader = SlotReader(slot.take_fd(), slot.size)
        >>> reader.arrays(slot.size, layout)[0].tolist()
        [0, 1, 2]
        >>> slot.close(); reader.close()
    """

    def __init__(self, job, rank, server_id):
        self._name = f"distemb-{job}-t{rank}-s{server_id}"
        self._gen = itertools.count()
        self._map, self._fd, self.size = None, None, 0
        #: (start, end) bytes of the last request written (the server may still read it)
        self.last = (0, 0)

    def write(self, arrays):
        """Copy ``arrays`` into the slot; an array already in it (see :meth:`view`) stays.

        Returns:
            the layout: ``[dtype code, shape, offset]`` per array, as
            :meth:`SlotReader.arrays` takes them (with :attr:`size`).
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
        used = [(at, at + a.nbytes) for a, at in zip(arrays, offsets) if a.nbytes]
        self.last = (min(u[0] for u in used), max(u[1] for u in used)) if used else (0, 0)
        return [[CODE_OF[a.dtype], list(a.shape), at] for a, at in zip(arrays, offsets)]

    def _write_moved(self, arrays):
        copies = [np.array(a) for a in arrays]
        self._grow(sum(_aligned(a.nbytes) for a in copies))
        return self.write(copies)

    def view(self, shape, dtype, clear_of_last=False):
        """An array in the slot, to fill in place (a coalescing buffer): at its start,
        or with ``clear_of_last`` where it does not overlap the last request written
        (:attr:`last`: the server may still be reading it), behind it or in a new file.

        :meth:`write` sends it without a copy; it is valid until the next request to
        this server is written.
        """
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start, end = self.last if clear_of_last else (0, 0)
        at = _aligned(end) if start < nbytes and end > start else 0
        if self._map is None or self._map.shape[0] < at + nbytes:
            self._grow(nbytes)  # a new file: nothing of the last request is in it
            self.last, at = (0, 0), 0
        return np.ndarray(shape, dtype, buffer=self._map, offset=at)

    def holds(self, a):
        """Whether array ``a`` is wholly in the slot (a :meth:`view`, or part of one)."""
        return self._offset_of(a) is not None

    def take_fd(self):
        """The read-only descriptor of the current memory file if the server has not
        been given it yet (the caller sends it, then closes it), else None."""
        fd, self._fd = self._fd, None
        return fd

    def _offset_of(self, a):
        """The offset of ``a`` in the current mapping, or None when it is not wholly in it."""
        if self._map is None or not a.flags.c_contiguous or not a.nbytes:
            return None
        off = a.ctypes.data - self._map.ctypes.data
        if 0 <= off and off + a.nbytes <= self._map.shape[0] and off % SLOT_ALIGN == 0:
            return off
        return None

    def _grow(self, size):
        size = max(size, MIN_SLOT_BYTES, 0 if self._map is None else 2 * self._map.shape[0])
        fd = new_segment(f"{self._name}-{next(self._gen)}", size)
        try:
            mem = map_segment(fd, size, writable=True)
            ro = readonly(fd)
        except OSError as e:
            raise TransportError(f"request slot: cannot map {size:,} bytes: {e}") from None
        finally:
            os.close(fd)
        self.close()  # the server keeps its mapping of the old one until it gets this one
        self._map, self._fd, self.size = np.ndarray((size,), np.uint8, buffer=mem), ro, size

    def close(self):
        """Drop this process's hold on the slot (its memory goes with the last mapping)."""
        if self._fd is not None:
            os.close(self._fd)
        self._map, self._fd, self.size = None, None, 0


class SlotReader:
    """A server's read-only mapping of the request slot one connection's peer handed over.

    Args:
        fd: the slot's descriptor, as received; it is closed here, mapped or refused.
        size: the slot's size as the peer declared it.

    Raises:
        TransportError: ``fd`` is not a sealed memory file of ``size`` bytes (1 byte to
            :data:`MAX_SLOT_BYTES`).
    """

    def __init__(self, fd, size):
        try:
            if not 0 < size <= MAX_SLOT_BYTES:
                raise TransportError(f"request slot: expected 1..{MAX_SLOT_BYTES} bytes, "
                                     f"got {size}")
            check_segment(fd, size, "request slot")
            self._map = np.ndarray((size,), np.uint8, buffer=map_segment(fd, size, writable=False))
        except OSError as e:
            raise TransportError(f"request slot: cannot map {size} bytes: {e}") from None
        finally:
            os.close(fd)
        self.size = size

    def arrays(self, size, layout):
        """The arrays ``layout`` describes in the slot (whose size the frame repeats):
        views of the float arrays (rows, gradients: read in place), copies of the integer
        ones.

        Integer arrays are ids, counts and versions: the server checks them, then indexes
        its shards with them. The trainer can still write its slot after the check; a
        view would let it swap a checked id for one past the end of a shard between the
        check and the compiled gather or update (an out-of-bounds read or write). A copy
        is checked and used as one value; the copy is small (8 bytes per row against a
        row's 4 * dim). A float changed meanwhile is only a wrong value, which a token
        holder may send anyway.

        Raises:
            TransportError: ``size`` is not the slot's, or a descriptor is invalid or
                reaches past the end of the slot.
        """
        if self._map is None or size != self.size:
            raise TransportError(f"request slot: the frame says {size} bytes, the slot this "
                                 f"connection handed over has {self.size}")
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
            nbytes = dtype.itemsize * math.prod(shape)  # exact ints (1 for shape ())
            if off + nbytes > self.size:
                raise TransportError(f"slot array {i}: {nbytes} bytes at offset {off} reach "
                                     f"past the end of the slot ({self.size} bytes)")
            view = np.ndarray(shape, dtype, buffer=self._map, offset=off)
            out.append(np.array(view) if dtype.kind in "iub" else view)
        return out

    def close(self):
        """Drop the mapping (arrays still viewing it keep it until they go)."""
        self._map = None
