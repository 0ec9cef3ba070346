# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled skip-gram negative-sampling loss and gradients in one pass (one thread).

Imported only by distemb.kernels.skipgram, which validates shapes, dtypes and index
ranges; the twin in distemb/kernels/reference_skipgram.py defines the semantics.

Per pair b: s = u . c for the positive and each negative, the loss terms, and at once the
gradients: ``gnode[center] += g * c`` and ``gctx[c] += g * u`` straight into the buffers of
unique rows (the coalesced gradients the optimizer pushes), so no (B, 1 + K, D) tensor
is ever made. Dot products keep 8 partial sums (a fixed order, so results do not depend
on anything but the inputs): one running sum would serialise on the adder's latency,
and gcc may not reorder a float sum itself without -ffast-math.
"""
from libc.stdint cimport int64_t
import numpy as np

cdef extern from *:
    """
    #include <math.h>
    #include <string.h>
    #include <stdint.h>

    static inline __attribute__((always_inline)) float distemb_sg_dot(const float *a, const float *b, long n) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        long j = 0;
        for (; j + 8 <= n; j += 8)
            for (int k = 0; k < 8; ++k) acc[k] += a[j + k] * b[j + k];
        for (; j < n; ++j) acc[0] += a[j] * b[j];
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }

    static inline __attribute__((always_inline)) void distemb_sg_axpy(float *__restrict y, float a, const float *__restrict x,
                                       long n) {
        for (long j = 0; j < n; ++j) y[j] += a * x[j];
    }

    /* y += a x, or y = a x on the row's first touch (seen[i] == 0): the gradient
       buffers are not zeroed beforehand, which would be one more pass over ~10 MB a
       DeepWalk step; rows never touched are zeroed at the end. */
    static inline __attribute__((always_inline)) void distemb_sg_acc(float *__restrict y, float a, const float *__restrict x,
                                      long n, unsigned char *seen) {
        if (*seen) {
            for (long j = 0; j < n; ++j) y[j] += a * x[j];
        } else {
            for (long j = 0; j < n; ++j) y[j] = a * x[j];
            *seen = 1;
        }
    }

    static inline __attribute__((always_inline)) void distemb_sg_prefetch(const float *p, long n, int write) {
        for (long j = 0; j < n; j += 16) {
            if (write) __builtin_prefetch(p + j, 1, 3);
            else __builtin_prefetch(p + j, 0, 3);
        }
    }

    /* -log s(x), and s(x) into *sig, from one exp: exp(-|x|) never overflows. In float,
       as torch's float32 logsigmoid: libm's double exp and log1p cost more than the
       row arithmetic of a score at D = 8 (60 ns a score). */
    static inline __attribute__((always_inline)) float distemb_sg_nls(float x, float *sig) {
        float e = expf(-fabsf(x));
        *sig = x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
        return (x < 0 ? -x : 0.0f) + log1pf(e);
    }

    /* The pass, written once and compiled twice (below): a baseline build and one for
       AVX2 + FMA. target_clones("arch=haswell") used to pick between them, but its
       resolver asks __builtin_cpu_is("haswell"), which is false on every AMD CPU (this
       machine's EPYC among them), so those ran the SSE2 build: 12% slower here. */
    static inline __attribute__((always_inline))
    double distemb_sgns_body(const float *node, const float *ctx, long d, long b_n,
                               long k_n, const int64_t *centers, const int64_t *pos,
                               const int64_t *neg, float *gnode, float *gctx, float *gu,
                               long un, long uc, unsigned char *seen_node,
                               unsigned char *seen_ctx) {
        double total = 0.0, inv_b = 1.0 / (double)b_n;
        float sig;
        for (long b = 0; b < b_n; ++b) {
            if (b + 2 < b_n) {  /* the rows two pairs ahead: several misses in flight */
                long a = b + 2;
                distemb_sg_prefetch(node + centers[a] * d, d, 0);
                distemb_sg_prefetch(ctx + pos[a] * d, d, 0);
                distemb_sg_prefetch(gctx + pos[a] * d, d, 1);
                for (long k = 0; k < k_n; ++k) {
                    distemb_sg_prefetch(ctx + neg[a * k_n + k] * d, d, 0);
                    distemb_sg_prefetch(gctx + neg[a * k_n + k] * d, d, 1);
                }
            }
            const float *u = node + centers[b] * d;
            memset(gu, 0, d * sizeof(float));
            /* The pair's scores in groups of up to 8 (k = -1: the positive): the dot
               products of a group are independent chains the CPU runs side by side,
               then the group's gradient rows. Reads are of ctx only and writes of the
               gradient buffers, so the order changes nothing. */
            for (long k0 = -1; k0 < k_n; k0 += 8) {
                long m = k_n - k0 < 8 ? k_n - k0 : 8;
                long ci[8];
                float s[8];
                for (long i = 0; i < m; ++i) {
                    long k = k0 + i;
                    ci[i] = k < 0 ? pos[b] : neg[b * k_n + k];
                    s[i] = distemb_sg_dot(u, ctx + ci[i] * d, d);
                }
                for (long i = 0; i < m; ++i) {
                    float g;
                    if (k0 + i < 0) {
                        total += distemb_sg_nls(s[i], &sig);
                        g = (float)((sig - 1.0) * inv_b);
                    } else {  /* -log s(-s); its derivative in s is s(s) = 1 - s(-s) */
                        total += distemb_sg_nls(-s[i], &sig);
                        g = (float)((1.0 - sig) * inv_b);
                    }
                    distemb_sg_axpy(gu, g, ctx + ci[i] * d, d);
                    distemb_sg_acc(gctx + ci[i] * d, g, u, d, seen_ctx + ci[i]);
                }
            }
            distemb_sg_acc(gnode + centers[b] * d, 1.0f, gu, d, seen_node + centers[b]);
        }
        for (long i = 0; i < un; ++i)
            if (!seen_node[i]) memset(gnode + i * d, 0, d * sizeof(float));
        for (long i = 0; i < uc; ++i)
            if (!seen_ctx[i]) memset(gctx + i * d, 0, d * sizeof(float));
        return total * inv_b;
    }

    #define DISTEMB_SG_ARGS const float *node, const float *ctx, long d, long b_n, \
        long k_n, const int64_t *centers, const int64_t *pos, const int64_t *neg, \
        float *gnode, float *gctx, float *gu, long un, long uc, unsigned char *seen_node, \
        unsigned char *seen_ctx
    #define DISTEMB_SG_CALL node, ctx, d, b_n, k_n, centers, pos, neg, gnode, gctx, gu, \
        un, uc, seen_node, seen_ctx

    static double distemb_sgns_baseline(DISTEMB_SG_ARGS) {
        return distemb_sgns_body(DISTEMB_SG_CALL);
    }

    __attribute__((target("avx2,fma")))
    static double distemb_sgns_avx2(DISTEMB_SG_ARGS) {
        return distemb_sgns_body(DISTEMB_SG_CALL);
    }

    static int distemb_sg_cpu_has_avx2(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }

    static double distemb_sgns(int avx2, DISTEMB_SG_ARGS) {
        return avx2 ? distemb_sgns_avx2(DISTEMB_SG_CALL) : distemb_sgns_baseline(DISTEMB_SG_CALL);
    }
    """
    int cpu_has_avx2 "distemb_sg_cpu_has_avx2"()
    double sgns "distemb_sgns"(int avx2, const float *node, const float *ctx, long d, long b_n,
                               long k_n, const int64_t *centers, const int64_t *pos,
                               const int64_t *neg, float *gnode, float *gctx,
                               float *gu, long un, long uc, unsigned char *seen_node,
                               unsigned char *seen_ctx) nogil


def has_vector_build():
    """Whether this CPU runs the AVX2 + FMA build of the pass."""
    return bool(cpu_has_avx2())


def sgns_loss_grad(const float[:, ::1] node_rows, const float[:, ::1] context_rows,
                   const int64_t[::1] centers, const int64_t[::1] positives,
                   const int64_t[:, ::1] negatives, bint avx2=True):
    """(mean loss, d loss / d node_rows, d loss / d context_rows); see the twin.

    ``avx2``: run the AVX2 + FMA build (where the CPU has it; else the baseline)."""
    cdef Py_ssize_t b_n = centers.shape[0], k_n = negatives.shape[1], d = node_rows.shape[1]
    cdef Py_ssize_t un = node_rows.shape[0], uc = context_rows.shape[0]
    cdef double total
    if b_n == 0:
        return (0.0, np.zeros((un, d), dtype=np.float32),
                np.zeros((uc, d), dtype=np.float32))
    # Not zeroed here: the pass writes each row on its first touch and zeroes the rest.
    grad_node_np = np.empty((un, d), dtype=np.float32)
    grad_ctx_np = np.empty((uc, d), dtype=np.float32)
    seen_node_np = np.zeros(un, dtype=np.uint8)
    seen_ctx_np = np.zeros(uc, dtype=np.uint8)
    gu_np = np.empty(d, dtype=np.float32)
    cdef float[:, ::1] grad_node = grad_node_np
    cdef float[:, ::1] grad_ctx = grad_ctx_np
    cdef unsigned char[::1] seen_node = seen_node_np
    cdef unsigned char[::1] seen_ctx = seen_ctx_np
    cdef float[::1] gu = gu_np
    cdef const int64_t *neg = &negatives[0, 0] if k_n else NULL
    cdef int vector = avx2 and cpu_has_avx2()
    with nogil:
        total = sgns(vector, &node_rows[0, 0], &context_rows[0, 0], d, b_n, k_n, &centers[0],
                     &positives[0], neg, &grad_node[0, 0], &grad_ctx[0, 0], &gu[0], un, uc,
                     &seen_node[0], &seen_ctx[0])
    return total, grad_node_np, grad_ctx_np
