"""Reference twin of the compiled hash table (``csrc/_hashtable.pyx``): a Python dict.

Same methods, same slot allocation (a freed slot is reused first, last freed first,
else the next never-used slot), same bucket count growth; only ``items()`` order and
``nbytes()`` differ (a dict has no buckets to walk).
"""
import sys

import numpy as np


class HashTable:
    """int64 key -> int64 slot, as the compiled HashTable.

    Example:
        >>> t = HashTable()
        >>> out, new = np.empty(2, np.int64), np.empty(2, np.uint8)
        >>> t.find_or_insert(np.array([4, 4]), out, new), out.tolist()
        (1, [0, 0])
    """

    def __init__(self, buckets=16, max_load=0.75):
        self._buckets = 16
        while self._buckets < buckets:
            self._buckets <<= 1
        self._max_load = max_load
        self._map = {}
        self._free = []
        self._high = 0

    @property
    def buckets(self):
        return self._buckets

    @property
    def size(self):
        return len(self._map)

    @property
    def high_water(self):
        return self._high

    def reserve(self, n):
        while n > self._max_load * self._buckets:
            self._buckets <<= 1

    def find(self, keys, out):
        get = self._map.get
        out[:] = [get(k, -1) for k in keys.tolist()]
        return out

    def find_or_insert(self, keys, out, is_new):
        self.reserve(len(self._map) + len(keys))
        m, inserted = self._map, 0
        slots, new = [], []
        for k in keys.tolist():
            s = m.get(k)
            if s is None:
                if self._free:
                    s = self._free.pop()
                else:
                    s = self._high
                    self._high += 1
                m[k] = s
                inserted += 1
                new.append(1)
            else:
                new.append(0)
            slots.append(s)
        out[:] = slots
        is_new[:] = new
        return inserted

    def remove(self, keys, out):
        res = []
        for k in keys.tolist():
            s = self._map.pop(k, None)
            if s is None:
                res.append(-1)
            else:
                self._free.append(s)
                res.append(s)
        out[:] = res
        return out

    def items(self):
        keys = np.fromiter(self._map.keys(), dtype=np.int64, count=len(self._map))
        slots = np.fromiter(self._map.values(), dtype=np.int64, count=len(self._map))
        return keys, slots

    def nbytes(self):
        return sys.getsizeof(self._map) + 8 * len(self._free)
