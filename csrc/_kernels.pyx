# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled CPU kernels (OpenMP). Imported only by distemb.kernels, which validates
inputs; twins in distemb/kernels/reference.py define the semantics.

Every kernel runs csrc/cpu_kernels.h: the updates apply each rule's per-element
arithmetic from csrc/rules.h (shared with the half and CUDA kernels); the gather, the id
sort and the duplicate sums of ``dedup_sum`` are there too. Each exists in a baseline, an
AVX2 + FMA and an AVX-512 build, picked at run time (``set_isa``; the same bits in every
one). The build passes -fno-math-errno so that sqrtf becomes a vector instruction, and
-ffp-contract=off so that no multiply-add is fused; nothing that would change IEEE
results. Rows are random in tables far larger than the caches, so each loop prefetches
the row it will touch ``PREFETCH_AHEAD`` iterations later: that keeps several row misses
in flight instead of one.
"""
from libc.stdint cimport int64_t, uint64_t
from libcpp.vector cimport vector
import numpy as np

cdef extern from "cpu_kernels.h" namespace "distemb_cpu" nogil:
    bint c_cpu_supports "distemb_cpu::cpu_supports"(int isa)
    int c_best_isa "distemb_cpu::best_isa"()
    int c_get_isa "distemb_cpu::get_process_isa"()
    void c_set_isa "distemb_cpu::set_process_isa"(int isa)
    void c_gather "distemb_cpu::gather_f32"(const float *t, const int64_t *r, float *o,
                                            int64_t n, int64_t d, int nt)
    int64_t c_dedup_order "distemb_cpu::dedup_order"(const int64_t *ids, int64_t n,
                                                     int64_t *order, int64_t *starts)
    void c_segment_sum "distemb_cpu::segment_sum"(const int64_t *ids, const float *g,
                                                  int64_t d, const int64_t *order,
                                                  const int64_t *starts, int64_t nu,
                                                  int64_t *uniq, float *out, int nt)
    void c_rowwise "distemb_cpu::rowwise_adagrad_f32"(float *w, float *s, const int64_t *r,
                                                      const float *g, int64_t n, int64_t d,
                                                      float clr, float eps, int nt)
    void c_adam "distemb_cpu::adam_f32"(float *w, float *m, float *v, const int64_t *r,
                                        const float *g, int64_t n, int64_t d, double lr,
                                        double b1, double b2, double eps, int64_t step,
                                        int64_t *rs, int nt)

#: The builds by number, as set_isa and get_isa name them (-1: the best this CPU runs).
ISA_NAMES = ("baseline", "avx2", "avx512")


def dedup_sum(const int64_t[::1] ids, const float[:, ::1] grads, num_rows=None, out=None,
              int num_threads=1):
    """Ascending unique ids and, per id, the sum of its rows in batch order (into out[:U])."""
    cdef int64_t n = ids.shape[0], d = grads.shape[1], nu = 0
    cdef vector[int64_t] order, starts
    cdef const int64_t *pid = &ids[0] if n else NULL
    with nogil:
        order.resize(n)
        starts.resize(n + 1)
        nu = c_dedup_order(pid, n, order.data(), starts.data())
    uniq_np = np.empty(nu, dtype=np.int64)
    summed_np = np.empty((nu, d), dtype=np.float32) if out is None else out[:nu]
    if nu == 0:
        return uniq_np, summed_np
    cdef int64_t[::1] uniq = uniq_np
    cdef float[:, ::1] summed = summed_np
    with nogil:
        c_segment_sum(pid, &grads[0, 0], d, order.data(), starts.data(), nu, &uniq[0],
                      &summed[0, 0], num_threads)
    return uniq_np, summed_np


def gather_rows(const float[:, ::1] table, const int64_t[::1] rows, float[:, ::1] out=None,
                int num_threads=1):
    """out[i] = table[rows[i]] (``out`` allocated when None)."""
    if out is None:
        out = np.empty((rows.shape[0], table.shape[1]), dtype=np.float32)
    cdef int64_t n = rows.shape[0], d = table.shape[1]
    if n:
        with nogil:
            c_gather(&table[0, 0], &rows[0], &out[0, 0], n, d, num_threads)
    return out


def isa_supported(int isa):
    """Whether this CPU runs build ``isa`` (0 baseline, 1 AVX2 + FMA + F16C, 2 AVX-512)."""
    return c_cpu_supports(isa)


def best_isa():
    """The best build this CPU runs (0, 1 or 2)."""
    return c_best_isa()


def get_isa():
    """The build the kernels run: -1 the best this CPU runs, else 0, 1 or 2."""
    return c_get_isa()


def set_isa(int isa):
    """Run the kernels on build ``isa`` (-1 the best this CPU runs, 0, 1 or 2)."""
    if isa < -1 or isa >= len(ISA_NAMES):
        raise ValueError(f"isa: expected -1, 0, 1 or 2, got {isa}")
    if isa >= 0 and not c_cpu_supports(isa):
        raise ValueError(f"isa: {isa} ({ISA_NAMES[isa]}) asked for, but this CPU lacks it")
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
