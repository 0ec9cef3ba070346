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

    static inline float distemb_sg_dot(const float *a, const float *b, long n) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        long j = 0;
        for (; j + 8 <= n; j += 8)
            for (int k = 0; k < 8; ++k) acc[k] += a[j + k] * b[j + k];
        for (; j < n; ++j) acc[0] += a[j] * b[j];
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }

    static inline void distemb_sg_axpy(float *__restrict y, float a, const float *__restrict x,
                                       long n) {
        for (long j = 0; j < n; ++j) y[j] += a * x[j];
    }

    static inline void distemb_sg_prefetch(const float *p, long n, int write) {
        for (long j = 0; j < n; j += 16) {
            if (write) __builtin_prefetch(p + j, 1, 3);
            else __builtin_prefetch(p + j, 0, 3);
        }
    }

    /* -log s(x), and s(x) into *sig, from one exp: exp(-|x|) never overflows. In float,
       as torch's float32 logsigmoid: libm's double exp and log1p cost more than the
       row arithmetic of a score at D = 8 (60 ns a score). */
    static inline float distemb_sg_nls(float x, float *sig) {
        float e = expf(-fabsf(x));
        *sig = x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
        return (x < 0 ? -x : 0.0f) + log1pf(e);
    }

    /* One build for AVX2 + FMA CPUs and one baseline, picked at load time by the CPU. */
    __attribute__((target_clones("arch=haswell", "default")))
    static double distemb_sgns(const float *node, const float *ctx, long d, long b_n,
                               long k_n, const int64_t *centers, const int64_t *pos,
                               const int64_t *neg, float *gnode, float *gctx, float *gu) {
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
            for (long k = -1; k < k_n; ++k) {  /* k = -1: the positive */
                long ci = k < 0 ? pos[b] : neg[b * k_n + k];
                const float *c = ctx + ci * d;
                float s = distemb_sg_dot(u, c, d);
                float g;
                if (k < 0) {
                    total += distemb_sg_nls(s, &sig);
                    g = (float)((sig - 1.0) * inv_b);
                } else {  /* -log s(-s); its derivative in s is s(s) = 1 - s(-s) */
                    total += distemb_sg_nls(-s, &sig);
                    g = (float)((1.0 - sig) * inv_b);
                }
                distemb_sg_axpy(gu, g, c, d);
                distemb_sg_axpy(gctx + ci * d, g, u, d);
            }
            distemb_sg_axpy(gnode + centers[b] * d, 1.0f, gu, d);
        }
        return total * inv_b;
    }
    """
    double sgns "distemb_sgns"(const float *node, const float *ctx, long d, long b_n,
                               long k_n, const int64_t *centers, const int64_t *pos,
                               const int64_t *neg, float *gnode, float *gctx,
                               float *gu) nogil


def sgns_loss_grad(const float[:, ::1] node_rows, const float[:, ::1] context_rows,
                   const int64_t[::1] centers, const int64_t[::1] positives,
                   const int64_t[:, ::1] negatives):
    """(mean loss, d loss / d node_rows, d loss / d context_rows); see the twin."""
    cdef Py_ssize_t b_n = centers.shape[0], k_n = negatives.shape[1], d = node_rows.shape[1]
    cdef double total
    grad_node_np = np.zeros((node_rows.shape[0], d), dtype=np.float32)
    grad_ctx_np = np.zeros((context_rows.shape[0], d), dtype=np.float32)
    if b_n == 0:
        return 0.0, grad_node_np, grad_ctx_np
    gu_np = np.empty(d, dtype=np.float32)
    cdef float[:, ::1] grad_node = grad_node_np
    cdef float[:, ::1] grad_ctx = grad_ctx_np
    cdef float[::1] gu = gu_np
    cdef const int64_t *neg = &negatives[0, 0] if k_n else NULL
    with nogil:
        total = sgns(&node_rows[0, 0], &context_rows[0, 0], d, b_n, k_n, &centers[0],
                     &positives[0], neg, &grad_node[0, 0], &grad_ctx[0, 0], &gu[0])
    return total, grad_node_np, grad_ctx_np
