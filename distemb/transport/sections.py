"""The byte layout of a collective exchange's payload: sections (ids, rows, counts) packed
per destination rank into one flat buffer (:class:`Payload`), each padded to
:data:`ALIGN` bytes, and read back in place at aligned offsets (:class:`Received`).

Example:
    >>> p = Payload(2)
    >>> p.add(1, np.arange(3, dtype=np.int64)); p.add(1, np.ones((1, 2), np.float32))
    >>> buf, sizes = p.build()
    >>> sizes.tolist()
    [0, 32]
    >>> r = Received(buf, sizes)
    >>> r.take(1, np.int64, (3,)).tolist(), r.take(1, np.float32, (1, 2)).tolist()
    ([0, 1, 2], [[1.0, 1.0]])
"""
from typing import List

import numpy as np

from distemb.errors import KVStoreError

#: Every section of a payload starts at a multiple of this many bytes.
ALIGN = 8


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN



class Payload:
    """Sections for each destination rank, packed into one flat uint8 buffer.

    Args:
        world_size: the number of destinations.
    """

    def __init__(self, world_size: int):
        self._parts: List[List[np.ndarray]] = [[] for _ in range(world_size)]

    def add(self, dest: int, array: np.ndarray) -> None:
        """Append ``array``'s bytes (C order) to the payload of rank ``dest``."""
        self._parts[dest].append(array)

    def build(self):
        """(flat uint8 buffer, (W,) int64 bytes for each destination, in rank order)."""
        sizes = np.array([sum(padded(a.nbytes) for a in p) for p in self._parts], np.int64)
        buf = np.empty(int(sizes.sum()), np.uint8)
        at = 0
        for p in self._parts:
            for a in p:
                n = a.nbytes
                if n:
                    flat = np.ascontiguousarray(a).reshape(-1)
                    buf[at:at + n] = flat.view(np.uint8)
                at += padded(n)
        return buf, sizes


class Received:
    """Sections read back, in the order they were added, from each source's bytes.

    Args:
        buf: the flat uint8 buffer received.
        sizes: bytes from each source, in rank order.
    """

    def __init__(self, buf: np.ndarray, sizes: np.ndarray):
        self._buf = buf
        self._at = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._end = self._at + np.asarray(sizes, np.int64)

    def take(self, src: int, dtype, shape) -> np.ndarray:
        """The next section from rank ``src``: an array of ``dtype`` and ``shape`` viewing
        the buffer (no copy).

        Raises:
            KVStoreError: fewer bytes left from ``src`` than the section needs.
        """
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        n = count * dtype.itemsize
        at = int(self._at[src])
        if at + n > self._end[src]:
            raise KVStoreError(f"collective exchange: rank {src} sent {self._end[src] - at} "
                               f"bytes where {n} were expected (ranks disagree on a table)")
        self._at[src] = at + padded(n)
        return self._buf[at:at + n].view(dtype).reshape(shape)
