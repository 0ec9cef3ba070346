# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled kernels on half-precision rows (csrc/cpu_kernels.h). Imported only by
distemb.kernels.half, which validates inputs and passes the rows' uint16 bits; its twin
in distemb/kernels/reference_half.py defines the semantics (decode, the float32 kernel,
encode with round-to-nearest-even). Every kernel takes ``isa`` (-1: the best build this
CPU runs, or the one ``set_isa`` chose; 0: baseline x86-64, 1: AVX2 + FMA + F16C, 2:
AVX-512; see csrc/cpu_kernels.h), for the tests that compare the builds; callers leave
it."""
from libc.stdint cimport int64_t, uint16_t, uint64_t

cdef extern from "cpu_kernels.h" namespace "distemb_cpu" nogil:
    void c_gather "distemb_cpu::gather"(int isa, int kind, const uint16_t *t, const int64_t *r,
                                         float *o, int64_t n, int64_t d, int nt)
    void c_rowwise "distemb_cpu::rowwise_adagrad"(int isa, int kind, uint16_t *w, float *s,
                                                   const int64_t *r, const float *g,
                                                   int64_t n, int64_t d, float clr,
                                                   float eps, uint64_t seed, int nt)
    void c_adam "distemb_cpu::adam"(int isa, int kind, uint16_t *w, float *m, float *v,
                                     const int64_t *r, const float *g, int64_t n, int64_t d,
                                     double lr, double b1, double b2, double eps,
                                     int64_t step, int64_t *rs, uint64_t seed, int nt)
    int c_get_isa "distemb_cpu::get_process_isa"()
    void c_set_isa "distemb_cpu::set_process_isa"(int isa)
    void c_encode "distemb_cpu::encode"(int isa, int kind, const float *src, uint16_t *dst, int64_t n)
    bint c_cpu_supports "distemb_cpu::cpu_supports"(int isa)
    void c_decode "distemb_cpu::decode"(int isa, int kind, const uint16_t *src, float *dst, int64_t n)


def isa_supported(int isa):
    """Whether this CPU runs build ``isa`` (0 baseline, 1 AVX2 + FMA + F16C, 2 AVX-512)."""
    return c_cpu_supports(isa)


def get_isa():
    """The build a call with ``isa=-1`` runs: -1 the best this CPU runs, else 0, 1 or 2."""
    return c_get_isa()


def set_isa(int isa):
    """Make ``isa=-1`` calls run build ``isa`` (-1 the best this CPU runs, 0, 1 or 2)."""
    c_set_isa(_isa(isa))


cdef int _isa(int isa) except -2:
    """-1: the best build this CPU runs; else build 0, 1 or 2, if this CPU runs it."""
    if isa < -1 or isa > 2:
        raise ValueError(f"isa: expected -1, 0, 1 or 2, got {isa}")
    if isa >= 0 and not c_cpu_supports(isa):
        raise ValueError(f"isa: {isa} asked for, but this CPU lacks it")
    return isa


def gather_rows(int kind, const uint16_t[:, ::1] table, const int64_t[::1] rows,
                float[:, ::1] out, int num_threads=1, int isa=-1):
    cdef int64_t n = rows.shape[0], d = table.shape[1]
    cdef int use = _isa(isa)
    if n:
        with nogil:
            c_gather(use, kind, &table[0, 0], &rows[0], &out[0, 0], n, d, num_threads)


def rowwise_adagrad_update(int kind, uint16_t[:, ::1] weight, float[::1] state_sum,
                           const int64_t[::1] rows, const float[:, ::1] grads, double clr,
                           double eps, uint64_t seed=0, int num_threads=1, int isa=-1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    cdef int use = _isa(isa)
    if n:
        with nogil:
            c_rowwise(use, kind, &weight[0, 0], &state_sum[0], &rows[0], &grads[0, 0], n, d,
                      <float>clr, <float>eps, seed, num_threads)


def adam_update(int kind, uint16_t[:, ::1] weight, float[:, ::1] exp_avg,
                float[:, ::1] exp_avg_sq, const int64_t[::1] rows, const float[:, ::1] grads,
                double lr, double beta1, double beta2, double eps, int64_t step,
                int64_t[::1] row_steps=None, uint64_t seed=0, int num_threads=1, int isa=-1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    cdef int use = _isa(isa)
    cdef int64_t *rs = &row_steps[0] if row_steps is not None else NULL
    if n:
        with nogil:
            c_adam(use, kind, &weight[0, 0], &exp_avg[0, 0], &exp_avg_sq[0, 0], &rows[0],
                   &grads[0, 0], n, d, lr, beta1, beta2, eps, step, rs, seed, num_threads)


def encode(int kind, const float[::1] src, uint16_t[::1] dst, int isa=-1):
    cdef int use = _isa(isa)
    if src.shape[0]:
        with nogil:
            c_encode(use, kind, &src[0], &dst[0], src.shape[0])


def decode(int kind, const uint16_t[::1] src, float[::1] dst, int isa=-1):
    cdef int use = _isa(isa)
    if src.shape[0]:
        with nogil:
            c_decode(use, kind, &src[0], &dst[0], src.shape[0])


# The element-wise rules' wrappers (sgd_update, adagrad_update, ftrl_update, ...),
# generated from distemb/kernels/rule_table.py by csrc/codegen.py.
include "gen/halfkernels_rules.pxi"
