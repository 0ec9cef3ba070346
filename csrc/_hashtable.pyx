# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled open-addressing hash table: int64 key -> int64 slot. Imported only by
distemb.kernels.hashtable, which validates inputs; its twin there (a dict) defines the
semantics, and both hand out slots in the same order.

Layout: one array of 16-byte entries {key, slot}, power-of-two buckets, linear probing,
so a probe is one cache line. Deletion is backward-shift (no tombstones: probe lengths
never degrade after many removals). Batch calls prefetch the bucket of the key
PREFETCH_AHEAD positions later, so several misses are in flight at once. Two key values
are reserved as markers (EMPTY = INT64_MIN, the next one is unused and kept for a future
tombstone); the wrapper rejects them.

Slots are allocated here, not by the caller, so a batch find-or-insert runs without the
GIL: a freed slot is reused first (LIFO), else the next never-used slot (``high_water``).
"""
from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.stdlib cimport malloc, calloc, free
from libcpp.vector cimport vector
import numpy as np

cdef extern from *:
    """
    #include <stdint.h>
    static inline void distemb_prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
    #define DISTEMB_EMPTY_KEY INT64_MIN
    """
    void prefetch "distemb_prefetch"(const void *p) nogil
    const int64_t EMPTY "DISTEMB_EMPTY_KEY"

DEF PREFETCH_AHEAD = 16

cdef struct Entry:
    int64_t key
    int64_t slot


cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    # murmur3's 64-bit finaliser: consecutive ids land in unrelated buckets
    cdef uint64_t h = <uint64_t>key
    h ^= h >> 33
    h *= 0xff51afd7ed558ccdULL
    h ^= h >> 33
    h *= 0xc4ceb9fe1a85ec53ULL
    h ^= h >> 33
    return h


cdef class HashTable:
    """int64 key -> int64 slot; see the module docstring and distemb.kernels.hashtable."""

    cdef Entry *entries
    cdef uint64_t mask
    cdef int64_t count
    cdef int64_t high
    cdef double max_load
    cdef vector[int64_t] free_slots

    def __cinit__(self, int64_t buckets=16, double max_load=0.75):
        cdef uint64_t n = 16
        while n < <uint64_t>buckets:
            n <<= 1
        self.max_load = max_load
        self.count = 0
        self.high = 0
        self._alloc(n)

    cdef void _alloc(self, uint64_t n):
        cdef uint64_t i
        self.entries = <Entry *>malloc(n * sizeof(Entry))
        if self.entries == NULL:
            raise MemoryError(f"hash table of {n} buckets")
        for i in range(n):
            self.entries[i].key = EMPTY
        self.mask = n - 1

    def __dealloc__(self):
        free(self.entries)

    @property
    def buckets(self):
        return int(self.mask + 1)

    @property
    def size(self):
        return int(self.count)

    @property
    def high_water(self):
        return int(self.high)

    @property
    def num_free(self):
        return int(self.free_slots.size())

    cdef void _rehash(self, uint64_t n) except *:
        cdef Entry *old = self.entries
        cdef uint64_t old_n = self.mask + 1, i, b
        self._alloc(n)
        with nogil:
            for i in range(old_n):
                if old[i].key != EMPTY:
                    b = _mix(old[i].key) & self.mask
                    while self.entries[b].key != EMPTY:
                        b = (b + 1) & self.mask
                    self.entries[b] = old[i]
        free(old)

    def reserve(self, int64_t n):
        """Grow so that ``n`` keys fit under the maximum load."""
        cdef uint64_t want = self.mask + 1
        while <double>n > self.max_load * <double>want:
            want <<= 1
        if want != self.mask + 1:
            self._rehash(want)

    def find(self, const int64_t[::1] keys, int64_t[::1] out):
        """out[i] = slot of keys[i], or -1 when absent."""
        cdef Py_ssize_t n = keys.shape[0], i
        cdef uint64_t b
        cdef Entry *e = self.entries
        cdef uint64_t mask = self.mask
        cdef int64_t k
        with nogil:
            for i in range(n):
                if i + PREFETCH_AHEAD < n:
                    prefetch(&e[_mix(keys[i + PREFETCH_AHEAD]) & mask])
                k = keys[i]
                b = _mix(k) & mask
                out[i] = -1
                while e[b].key != EMPTY:
                    if e[b].key == k:
                        out[i] = e[b].slot
                        break
                    b = (b + 1) & mask
        return out

    def find_or_insert(self, const int64_t[::1] keys, int64_t[::1] out, uint8_t[::1] is_new):
        """out[i] = slot of keys[i], inserting absent keys (is_new[i] = 1 for them).

        Returns the number of keys inserted. Duplicates in ``keys`` insert once.
        """
        cdef Py_ssize_t n = keys.shape[0], i
        cdef uint64_t b
        cdef int64_t k, s, inserted = 0
        self.reserve(self.count + n)
        cdef Entry *e = self.entries
        cdef uint64_t mask = self.mask
        with nogil:
            for i in range(n):
                if i + PREFETCH_AHEAD < n:
                    prefetch(&e[_mix(keys[i + PREFETCH_AHEAD]) & mask])
                k = keys[i]
                b = _mix(k) & mask
                is_new[i] = 0
                while True:
                    if e[b].key == k:
                        out[i] = e[b].slot
                        break
                    if e[b].key == EMPTY:
                        if self.free_slots.size():
                            s = self.free_slots.back()
                            self.free_slots.pop_back()
                        else:
                            s = self.high
                            self.high += 1
                        e[b].key = k
                        e[b].slot = s
                        out[i] = s
                        is_new[i] = 1
                        self.count += 1
                        inserted += 1
                        break
                    b = (b + 1) & mask
        return inserted

    def remove(self, const int64_t[::1] keys, int64_t[::1] out):
        """Remove keys; out[i] = the slot keys[i] held (now free), or -1 if absent.

        Backward-shift deletion: later entries of the probe run move back into the hole,
        so no tombstone is left.
        """
        cdef Py_ssize_t n = keys.shape[0], i
        cdef uint64_t b, j, home
        cdef Entry *e = self.entries
        cdef uint64_t mask = self.mask
        cdef int64_t k
        with nogil:
            for i in range(n):
                k = keys[i]
                b = _mix(k) & mask
                out[i] = -1
                while e[b].key != EMPTY:
                    if e[b].key == k:
                        break
                    b = (b + 1) & mask
                if e[b].key == EMPTY:
                    continue
                out[i] = e[b].slot
                self.free_slots.push_back(e[b].slot)
                self.count -= 1
                # shift back every later entry whose home is not in (b, j]
                j = b
                while True:
                    j = (j + 1) & mask
                    if e[j].key == EMPTY:
                        break
                    home = _mix(e[j].key) & mask
                    if ((j - home) & mask) >= ((j - b) & mask):
                        e[b] = e[j]
                        b = j
                e[b].key = EMPTY
        return out

    def items(self):
        """(keys, slots) of every entry, in bucket order."""
        cdef uint64_t i, m = 0, nb = self.mask + 1
        keys_np = np.empty(self.count, dtype=np.int64)
        slots_np = np.empty(self.count, dtype=np.int64)
        cdef int64_t[::1] keys = keys_np
        cdef int64_t[::1] slots = slots_np
        with nogil:
            for i in range(nb):
                if self.entries[i].key != EMPTY:
                    keys[m] = self.entries[i].key
                    slots[m] = self.entries[i].slot
                    m += 1
        return keys_np, slots_np

    def nbytes(self):
        """Bytes of the index: buckets and the free-slot list."""
        return int((self.mask + 1) * sizeof(Entry) + self.free_slots.capacity() * 8)
