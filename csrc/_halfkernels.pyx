# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled kernels on half-precision rows (csrc/half_kernels.h). Imported only by
distemb.kernels.half, which validates inputs and passes the rows' uint16 bits; its twin
in distemb/kernels/reference_half.py defines the semantics (decode, the float32 kernel,
encode with round-to-nearest-even)."""
from libc.stdint cimport int64_t, uint16_t, uint64_t

cdef extern from "half_kernels.h" namespace "distemb_half" nogil:
    void c_gather "distemb_half::gather"(int kind, const uint16_t *t, const int64_t *r,
                                         float *o, int64_t n, int64_t d, int nt)
    void c_sgd "distemb_half::sgd"(int kind, uint16_t *w, const int64_t *r, const float *g,
                                   int64_t n, int64_t d, float lr, uint64_t seed, int nt)
    void c_adagrad "distemb_half::adagrad"(int kind, uint16_t *w, float *s, const int64_t *r,
                                           const float *g, int64_t n, int64_t d, float clr,
                                           float eps, uint64_t seed, int nt)
    void c_rowwise "distemb_half::rowwise_adagrad"(int kind, uint16_t *w, float *s,
                                                   const int64_t *r, const float *g,
                                                   int64_t n, int64_t d, float clr,
                                                   float eps, uint64_t seed, int nt)
    void c_adam "distemb_half::adam"(int kind, uint16_t *w, float *m, float *v,
                                     const int64_t *r, const float *g, int64_t n, int64_t d,
                                     double lr, double b1, double b2, double eps,
                                     int64_t step, int64_t *rs, uint64_t seed, int nt)
    void c_encode "distemb_half::encode"(int kind, const float *src, uint16_t *dst, int64_t n)
    void c_decode "distemb_half::decode"(int kind, const uint16_t *src, float *dst, int64_t n)


def gather_rows(int kind, const uint16_t[:, ::1] table, const int64_t[::1] rows,
                float[:, ::1] out, int num_threads=1):
    cdef int64_t n = rows.shape[0], d = table.shape[1]
    if n:
        with nogil:
            c_gather(kind, &table[0, 0], &rows[0], &out[0, 0], n, d, num_threads)


def sgd_update(int kind, uint16_t[:, ::1] weight, const int64_t[::1] rows,
               const float[:, ::1] grads, double lr, uint64_t seed=0, int num_threads=1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    if n:
        with nogil:
            c_sgd(kind, &weight[0, 0], &rows[0], &grads[0, 0], n, d, <float>lr, seed,
                  num_threads)


def adagrad_update(int kind, uint16_t[:, ::1] weight, float[:, ::1] state_sum,
                   const int64_t[::1] rows, const float[:, ::1] grads, double clr, double eps,
                   uint64_t seed=0, int num_threads=1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    if n:
        with nogil:
            c_adagrad(kind, &weight[0, 0], &state_sum[0, 0], &rows[0], &grads[0, 0], n, d,
                      <float>clr, <float>eps, seed, num_threads)


def rowwise_adagrad_update(int kind, uint16_t[:, ::1] weight, float[::1] state_sum,
                           const int64_t[::1] rows, const float[:, ::1] grads, double clr,
                           double eps, uint64_t seed=0, int num_threads=1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    if n:
        with nogil:
            c_rowwise(kind, &weight[0, 0], &state_sum[0], &rows[0], &grads[0, 0], n, d,
                      <float>clr, <float>eps, seed, num_threads)


def adam_update(int kind, uint16_t[:, ::1] weight, float[:, ::1] exp_avg,
                float[:, ::1] exp_avg_sq, const int64_t[::1] rows, const float[:, ::1] grads,
                double lr, double beta1, double beta2, double eps, int64_t step,
                int64_t[::1] row_steps=None, uint64_t seed=0, int num_threads=1):
    cdef int64_t n = rows.shape[0], d = weight.shape[1]
    cdef int64_t *rs = &row_steps[0] if row_steps is not None else NULL
    if n:
        with nogil:
            c_adam(kind, &weight[0, 0], &exp_avg[0, 0], &exp_avg_sq[0, 0], &rows[0],
                   &grads[0, 0], n, d, lr, beta1, beta2, eps, step, rs, seed, num_threads)


def encode(int kind, const float[::1] src, uint16_t[::1] dst):
    if src.shape[0]:
        with nogil:
            c_encode(kind, &src[0], &dst[0], src.shape[0])


def decode(int kind, const uint16_t[::1] src, float[::1] dst):
    if src.shape[0]:
        with nogil:
            c_decode(kind, &src[0], &dst[0], src.shape[0])
