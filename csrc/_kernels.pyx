# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled CPU kernels (OpenMP). Imported only by distemb.kernels, which validates
inputs; twins in distemb/kernels/reference.py define the semantics.

The updates run csrc/cpu_kernels.h: each rule's per-element arithmetic from
csrc/rules.h (shared with the half and CUDA kernels), in a baseline and an AVX2 build
picked at run time (``set_isa``; the same bits either way). Inner loops run on raw typed
pointers (memoryview indexing per element blocks gcc's vectoriser); the build passes
-fno-math-errno so that sqrtf becomes a vector instruction, and nothing else that would
change IEEE results. Rows are random in tables far larger than the caches, so each loop
prefetches the row it will touch ``PREFETCH_AHEAD`` iterations later: that keeps several
row misses in flight instead of one.
"""
from cython.parallel cimport prange
from libc.string cimport memcpy
from libc.stdint cimport int64_t, uint64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector
from libcpp.pair cimport pair
import numpy as np

cdef extern from "cpu_kernels.h" namespace "distemb_cpu" nogil:
    bint c_cpu_has_vector "distemb_cpu::cpu_has_vector"()
    int c_get_isa "distemb_cpu::get_process_isa"()
    void c_set_isa "distemb_cpu::set_process_isa"(int isa)
    void c_rowwise "distemb_cpu::rowwise_adagrad_f32"(float *w, float *s, const int64_t *r,
                                                      const float *g, int64_t n, int64_t d,
                                                      float clr, float eps, int nt)
    void c_adam "distemb_cpu::adam_f32"(float *w, float *m, float *v, const int64_t *r,
                                        const float *g, int64_t n, int64_t d, double lr,
                                        double b1, double b2, double eps, int64_t step,
                                        int64_t *rs, int nt)

cdef extern from *:
    """
    static inline void distemb_prefetch_row(const void *p, long nbytes, int write) {
        const char *c = (const char *)p;
        for (long off = 0; off < nbytes; off += 64) {
            if (write) __builtin_prefetch(c + off, 1, 3);
            else __builtin_prefetch(c + off, 0, 3);
        }
    }
    """
    void prefetch_row "distemb_prefetch_row"(const void *p, long nbytes, int write) nogil

# Rows ahead to prefetch: enough to cover a DRAM miss at ~0.3 us of work per row.
DEF PREFETCH_AHEAD = 8
DEF RADIX_BITS = 11
# Rows per work chunk. Chunks are handed out dynamically: on a machine shared with
# other jobs a helper thread may wake late, and with a static split its half of the
# rows would wait for it; dynamically, the threads that run take the chunks.
# Every row (and every duplicate segment) is still done by one thread, in order, so
# results do not depend on the schedule.
DEF CHUNK_ROWS = 64


cdef inline int _bit_length(uint64_t x) noexcept nogil:
    cdef int b = 0
    while x:
        x >>= 1
        b += 1
    return b


cdef void _radix_sort(uint64_t *keys, uint64_t *tmp, Py_ssize_t n, int lo_bit,
                      int hi_bit) noexcept nogil:
    """Stable LSD radix sort of ``keys`` on bits [lo_bit, hi_bit); result in ``keys``."""
    cdef Py_ssize_t counts[1 << RADIX_BITS]
    cdef Py_ssize_t i, total, c
    cdef int shift = lo_bit, nb = 1 << RADIX_BITS
    cdef uint64_t mask = nb - 1, digit
    cdef uint64_t *src = keys
    cdef uint64_t *dst = tmp
    cdef uint64_t *swap
    while shift < hi_bit:
        for i in range(nb):
            counts[i] = 0
        for i in range(n):
            counts[(src[i] >> shift) & mask] += 1
        total = 0
        for i in range(nb):
            c = counts[i]
            counts[i] = total
            total += c
        for i in range(n):
            digit = (src[i] >> shift) & mask
            dst[counts[digit]] = src[i]
            counts[digit] += 1
        swap = src
        src = dst
        dst = swap
        shift += RADIX_BITS
    if src != keys:
        memcpy(keys, src, n * sizeof(uint64_t))


def dedup_sum(const int64_t[::1] ids, const float[:, ::1] grads, num_rows=None, out=None,
              int num_threads=1):
    """Ascending unique ids and, per id, the sum of its rows in batch order (into out[:U])."""
    cdef Py_ssize_t n = ids.shape[0], d = grads.shape[1], i, k, j, nu = 0, seg
    cdef int64_t lo = 0, hi = 0
    cdef int pos_bits, id_bits
    cdef uint64_t pos_mask
    cdef vector[uint64_t] keys, tmp
    cdef vector[pair[int64_t, int64_t]] pairs
    cdef vector[Py_ssize_t] starts
    cdef vector[int64_t] order
    cdef const int64_t *pid = &ids[0] if n else NULL
    cdef const float *g0 = &grads[0, 0] if n else NULL
    cdef const float *src
    cdef float *dst
    with nogil:
        order.resize(n)
        if n:
            lo = pid[0]
            hi = pid[0]
        for i in range(n):
            if pid[i] < lo:
                lo = pid[i]
            if pid[i] > hi:
                hi = pid[i]
        pos_bits = _bit_length(<uint64_t>n)
        id_bits = _bit_length(<uint64_t>hi - <uint64_t>lo)
        if n and pos_bits + id_bits <= 64:
            # One key per id: (id - lo) above its position. LSD radix on the id bits only
            # is stable, so equal ids keep batch order: sums are deterministic.
            keys.resize(n)
            tmp.resize(n)
            for i in range(n):
                keys[i] = ((<uint64_t>pid[i] - <uint64_t>lo) << pos_bits) | <uint64_t>i
            _radix_sort(keys.data(), tmp.data(), n, pos_bits, pos_bits + id_bits)
            pos_mask = (<uint64_t>1 << pos_bits) - 1
            for i in range(n):
                order[i] = <int64_t>(keys[i] & pos_mask)
                if i == 0 or (keys[i] >> pos_bits) != (keys[i - 1] >> pos_bits):
                    starts.push_back(i)
        elif n:  # ids spanning nearly all of int64: compare (id, position) pairs
            pairs.resize(n)
            for i in range(n):
                pairs[i].first = pid[i]
                pairs[i].second = i
            sort(pairs.begin(), pairs.end())
            for i in range(n):
                order[i] = pairs[i].second
                if i == 0 or pairs[i].first != pairs[i - 1].first:
                    starts.push_back(i)
        nu = starts.size()
        starts.push_back(n)
    uniq_np = np.empty(nu, dtype=np.int64)
    summed_np = np.empty((nu, d), dtype=np.float32) if out is None else out[:nu]
    if nu == 0:
        return uniq_np, summed_np
    cdef int64_t[::1] uniq = uniq_np
    cdef float[:, ::1] summed = summed_np
    cdef int64_t *pu = &uniq[0]
    cdef float *ps = &summed[0, 0]
    with nogil:
        for k in prange(nu, num_threads=num_threads, schedule='dynamic', chunksize=CHUNK_ROWS):
            pu[k] = pid[order[starts[k]]]
            dst = ps + k * d
            memcpy(dst, g0 + order[starts[k]] * d, d * sizeof(float))
            for seg in range(starts[k] + 1, starts[k + 1]):
                src = g0 + order[seg] * d
                for j in range(d):
                    dst[j] = dst[j] + src[j]
    return uniq_np, summed_np


def gather_rows(const float[:, ::1] table, const int64_t[::1] rows, float[:, ::1] out=None,
                int num_threads=1):
    """out[i] = table[rows[i]] (``out`` allocated when None)."""
    if out is None:
        out = np.empty((rows.shape[0], table.shape[1]), dtype=np.float32)
    cdef Py_ssize_t n = rows.shape[0], d = table.shape[1], i
    cdef size_t nbytes = d * sizeof(float)
    if n == 0:
        return out
    cdef const float *t = &table[0, 0]
    cdef const int64_t *r = &rows[0]
    cdef float *o = &out[0, 0]
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='dynamic', chunksize=CHUNK_ROWS):
            if i + PREFETCH_AHEAD < n:
                prefetch_row(t + r[i + PREFETCH_AHEAD] * d, nbytes, 0)
            memcpy(o + i * d, t + r[i] * d, nbytes)
    return out


def has_vector_build():
    """Whether this CPU runs the AVX2 build of the update kernels."""
    return c_cpu_has_vector()


def get_isa():
    """The build the updates run: -1 the best this CPU runs, 0 baseline, 1 AVX2."""
    return c_get_isa()


def set_isa(int isa):
    """Run the updates on build ``isa`` (-1 the best this CPU runs, 0 baseline, 1 AVX2)."""
    if isa < -1 or isa > 1:
        raise ValueError(f"isa: expected -1, 0 or 1, got {isa}")
    if isa == 1 and not c_cpu_has_vector():
        raise ValueError("isa: 1 (AVX2) asked for, but this CPU lacks AVX2 or F16C")
    c_set_isa(isa)


def rowwise_adagrad_update(float[:, ::1] weight, float[::1] state_sum,
                           const int64_t[::1] rows, const float[:, ::1] grads,
                           double clr, double eps, int num_threads=1):
    """Row-wise Adagrad: s_row += mean(g^2); w -= clr * (g / (sqrt(s_row) + eps))."""
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    if n:
        with nogil:
            c_rowwise(&weight[0, 0], &state_sum[0], &rows[0], &grads[0, 0], n, d,
                      <float>clr, <float>eps, num_threads)


def adam_update(float[:, ::1] weight, float[:, ::1] exp_avg, float[:, ::1] exp_avg_sq,
                const int64_t[::1] rows, const float[:, ::1] grads, double lr,
                double beta1, double beta2, double eps, int64_t step,
                int64_t[::1] row_steps=None, int num_threads=1):
    """torch.optim.SparseAdam on unique rows; per-row bias correction with row_steps."""
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    cdef int64_t *rs = &row_steps[0] if row_steps is not None else NULL
    if n:
        with nogil:
            c_adam(&weight[0, 0], &exp_avg[0, 0], &exp_avg_sq[0, 0], &rows[0], &grads[0, 0],
                   n, d, lr, beta1, beta2, eps, step, rs, num_threads)


# The element-wise rules' wrappers (sgd_update, adagrad_update, ftrl_update, ...),
# generated from distemb/kernels/rule_table.py by csrc/codegen.py.
include "gen/kernels_rules.pxi"
