# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled bookkeeping of a trainer cache and of the exact protocol's server side: one
pass per table and step instead of chains of numpy calls. Imported only by
distemb.kernels.cachebook, which validates inputs (dtypes, shapes, index ranges); its
twin, distemb.kernels.reference_cachebook, defines the semantics (both give the same
arrays for the same calls).

Rows and optimizer-state rows are copied as bytes (``uint8[:, ::1]`` views made by the
wrapper), so one kernel serves every row width, state shape and dtype.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy
from libcpp.vector cimport vector
import numpy as np

ctypedef fused slot_t:
    int32_t
    int64_t


def dense_lookup(const int64_t[::1] ids, const slot_t[::1] slot_map, uint8_t[::1] seen,
                 int any_held, int64_t[::1] uniq, int64_t[::1] inverse, int64_t[::1] slots):
    """A pull's ids (0 <= id < len(slot_map)) made unique in order of first appearance
    (``uniq``, ``inverse``), one more pull counted in ``seen`` for each unique id, and
    each one's cache slot (-1 without reading the map when not ``any_held``). Returns
    the number of unique ids."""
    cdef Py_ssize_t n = ids.shape[0], i
    cdef uint64_t size = 16, mask, b
    cdef int shift = 60
    while size < 2 * <uint64_t>n:
        size *= 2
        shift -= 1
    mask = size - 1
    cdef vector[int64_t] table  # bucket -> position in uniq, -1: empty
    table.assign(size, -1)
    cdef int64_t k, u = 0, at, key
    with nogil:
        for i in range(n):
            key = ids[i]
            b = (<uint64_t>key * 0x9E3779B97F4A7C15ULL) >> shift  # Fibonacci hashing
            while True:
                at = table[b]
                if at < 0:
                    table[b] = u
                    uniq[u] = key
                    seen[key] += 1
                    slots[u] = slot_map[key] if any_held else -1
                    inverse[i] = u
                    u += 1
                    break
                if uniq[at] == key:
                    inverse[i] = at
                    break
                b = (b + 1) & mask
    return u


def held_versions(const int64_t[::1] slots, const int64_t[::1] version,
                  const int64_t[::1] checked, int64_t step, int64_t staleness,
                  int64_t[::1] have, uint8_t[::1] ask):
    """have[i] = version[slots[i]] (-1 where slots[i] < 0); ask[i] = 0 only for a held
    row validated less than ``staleness`` steps ago. Returns the rows held."""
    cdef Py_ssize_t n = slots.shape[0], i
    cdef int64_t s, held = 0
    with nogil:
        for i in range(n):
            s = slots[i]
            if s >= 0:
                held += 1
                have[i] = version[s]
                ask[i] = not (staleness > 0 and step - checked[s] < staleness)
            else:
                have[i] = -1
                ask[i] = 1
    return held


def settle(const int64_t[::1] slots, const int64_t[::1] got, const int64_t[::1] vers,
           const uint8_t[:, ::1] rows, list states, const int64_t[::1] have,
           const uint8_t[::1] ask, const int64_t[::1] inverse,
           const int64_t[::1] ready, const uint8_t[:, ::1] ready_rows,
           uint8_t[:, ::1] values, list cache_states, int64_t[::1] version,
           int64_t[::1] checked, int64_t step, int64_t[::1] stamp, int64_t tick,
           int64_t[::1] source, uint8_t[:, ::1] out):
    """Store a versioned pull's reply in the cache and write the pull's rows.

    ``source`` is scratch of len(slots). See reference_cachebook.settle."""
    cdef Py_ssize_t n = slots.shape[0], m = got.shape[0], i, j, k
    cdef Py_ssize_t row_bytes = values.shape[1], n_states = len(states)
    cdef int64_t p, s, st = 0
    cdef int missing = 0
    cdef uint8_t[:, ::1] sv, cv
    for k in range(n_states):  # state rows come for the fetched rows whose have != -1
        sv = states[k]
        cv = cache_states[k]
        st = 0
        for i in range(m):
            p = got[i]
            if have[p] == -1:
                continue
            s = slots[p]
            if s >= 0:
                memcpy(&cv[s, 0], &sv[st, 0], cv.shape[1])
            st += 1
    with nogil:
        for i in range(n):
            source[i] = -1
            if ask[i] and slots[i] >= 0:
                checked[slots[i]] = step
        for i in range(m):
            p = got[i]
            s = slots[p]
            if s >= 0:
                memcpy(&values[s, 0], &rows[i, 0], row_bytes)
                version[s] = vers[i]
                checked[s] = step
            else:
                source[p] = i
        for i in range(ready.shape[0]):
            source[ready[i]] = m + i
        if tick >= 0:
            for i in range(n):
                if slots[i] >= 0:
                    stamp[slots[i]] = tick
        for j in range(inverse.shape[0]):
            p = inverse[j]
            s = slots[p]
            if s >= 0:
                memcpy(&out[j, 0], &values[s, 0], row_bytes)
            elif source[p] < 0:
                missing = 1
            elif source[p] < m:
                memcpy(&out[j, 0], &rows[source[p], 0], row_bytes)
            else:
                memcpy(&out[j, 0], &ready_rows[source[p] - m, 0], row_bytes)
    if missing:
        raise ValueError("settle: a row neither held, fetched nor prefetched")


def held_step(const int64_t[::1] slots, const uint8_t[:, ::1] grads,
              const int64_t[::1] summed, const uint8_t[:, ::1] sums,
              const int64_t[::1] summed_versions, const int64_t[::1] drop, int skip_drop,
              int64_t[::1] version, int64_t[::1] where, int64_t[::1] at,
              uint8_t[:, ::1] step):
    """One exact step's gradients for the held copies. ``where`` is scratch of len(slots).
    See reference_cachebook.held_step; returns the rows of ``at``/``step`` written."""
    cdef Py_ssize_t n = slots.shape[0], i, row_bytes = grads.shape[1]
    cdef int64_t k = 0, s
    with nogil:
        for i in range(n):
            where[i] = 0
        if skip_drop:
            for i in range(drop.shape[0]):
                where[drop[i]] = -1
        for i in range(summed.shape[0]):
            where[summed[i]] = i + 1
        for i in range(n):
            s = slots[i]
            if s < 0:
                continue
            version[s] += 1
            if where[i] < 0:
                continue
            at[k] = s
            if where[i] > 0:
                memcpy(&step[k, 0], &sums[where[i] - 1, 0], row_bytes)
            else:
                memcpy(&step[k, 0], &grads[i, 0], row_bytes)
            k += 1
        for i in range(summed.shape[0]):
            version[slots[summed[i]]] = summed_versions[i]
    return k


def held_answer(const int64_t[::1] uniq, const int64_t[::1] ids, const int64_t[::1] have,
                const int64_t[::1] before, const int64_t[::1] counts, int known,
                int64_t start, int64_t[::1] drop, int64_t[::1] pos, int64_t[::1] vers, int64_t[::1] at):
    """A server's answer for one part of an exact update that names held rows. ``uniq``
    sorted; every id is in it. See reference_cachebook.held_answer; returns
    (len(drop), len(pos)) written."""
    cdef Py_ssize_t n = ids.shape[0], i, lo, hi, mid, u = uniq.shape[0]
    cdef int64_t nd = 0, npos = 0, key
    with nogil:
        for i in range(n):
            if have[i] == -1:
                continue
            key = ids[i]
            lo, hi = 0, u
            while lo < hi:
                mid = (lo + hi) >> 1
                if uniq[mid] < key:
                    lo = mid + 1
                else:
                    hi = mid
            if not known or before[lo] != have[i]:
                drop[nd] = i + start
                nd += 1
            elif counts[lo] > 1:
                pos[npos] = i + start
                vers[npos] = before[lo] + counts[lo]
                at[npos] = lo
                npos += 1
    return nd, npos
