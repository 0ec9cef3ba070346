"""What a trainer cache keeps per key: the slot of a cached row, and how often a key was
pulled lately. Two implementations of each, by the table's key space:

- rows 0..N-1 of a dense table: arrays indexed by the id (:class:`ArraySlots`,
  :class:`ArrayCounts`), exact and one memory access each;
- any int64 key of a keyed table (hash or file store): a hash index over the cached keys
  only (:class:`HashSlots`, bounded by the cache's capacity) and a count-min sketch of
  the pulls (:class:`SketchCounts`, TinyLFU's frequency estimate: fixed memory whatever
  the key space, counts never under-estimated except where one batch's keys collide).

Example:
    >>> import numpy as np
    >>> s = HashSlots()
    >>> s.set(np.array([2**40, -5]), np.array([0, 1]))
    >>> s.get(np.array([-5, 7])).tolist()
    [1, -1]
    >>> c = SketchCounts(capacity=4)
    >>> c.add(np.array([2**40])); c.add(np.array([2**40, 3]))
    >>> c.get(np.array([2**40, 3, 9])).tolist()
    [2, 1, 0]
"""
import numpy as np

from distemb.kernels.hashtable import HashIndex
from distemb.partition import splitmix64


class ArraySlots:
    """Slot of each cached id of a table of ``num_rows`` rows (-1: not cached)."""

    def __init__(self, num_rows: int):
        self._slot = np.full(num_rows, -1, np.int64)

    def get(self, ids):
        return self._slot[ids]

    def set(self, ids, slots):
        self._slot[ids] = slots

    def clear(self, ids):
        self._slot[ids] = -1


class HashSlots:
    """Slot of each cached key of any int64 key space (-1: not cached); holds the cached
    keys only."""

    def __init__(self):
        self._index = HashIndex()
        self._slot = np.empty(0, np.int64)  # index slot -> cache slot

    def get(self, keys):
        found = self._index.find(keys)
        out = np.full(len(keys), -1, np.int64)
        held = found >= 0
        out[held] = self._slot[found[held]]
        return out

    def set(self, keys, slots):
        at, _ = self._index.find_or_insert(keys)
        if self._index.high_water > len(self._slot):
            grown = np.empty(max(self._index.high_water, 2 * len(self._slot)), np.int64)
            grown[:len(self._slot)] = self._slot
            self._slot = grown
        self._slot[at] = slots

    def clear(self, keys):
        self._index.remove(keys)


class ArrayCounts:
    """Recent pulls of every id of a table of ``num_rows`` rows."""

    def __init__(self, num_rows: int):
        self._seen = np.zeros(num_rows, np.int32)

    def add(self, ids):
        """One more pull of each of ``ids`` (unique)."""
        self._seen[ids] += 1

    def get(self, ids):
        return self._seen[ids]

    def halve(self):
        self._seen >>= 1


class SketchCounts:
    """Recent pulls of any int64 key, estimated by a count-min sketch.

    Args:
        capacity: rows the cache holds; the sketch has ``DEPTH`` rows of at least 8
            counters per cached row (and 1,024), so keys competing for the cache rarely
            share every counter.
    """

    DEPTH = 4
    #: Per-row seeds of the sketch's hashes (splitmix64 of key + seed).
    SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0xD6E8FEB86659FD93], np.uint64)

    def __init__(self, capacity: int):
        width = 1024
        while width < 8 * capacity:
            width *= 2
        self._mask = np.uint64(width - 1)
        self._table = np.zeros((self.DEPTH, width), np.int32)

    def _cells(self, keys):
        k = np.asarray(keys, np.int64).view(np.uint64)
        with np.errstate(over="ignore"):
            return [(splitmix64(k + seed) & self._mask).astype(np.intp) for seed in self.SEEDS]

    def add(self, keys):
        """One more pull of each of ``keys`` (unique; keys of one batch sharing a counter
        add one to it)."""
        for row, cells in zip(self._table, self._cells(keys)):
            row[cells] += 1

    def get(self, keys):
        cells = self._cells(keys)
        return np.minimum.reduce([row[c] for row, c in zip(self._table, cells)])

    def halve(self):
        self._table >>= 1
