# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""Compiled CPU kernels (OpenMP). Imported only by distemb.kernels, which validates
inputs; twins in distemb/kernels/reference.py define the semantics."""
from cython.parallel cimport prange
from libc.math cimport sqrt, pow
from libc.string cimport memcpy
from libc.stdint cimport int64_t
from libcpp.algorithm cimport sort
from libcpp.vector cimport vector
from libcpp.pair cimport pair
import numpy as np


def dedup_sum(const int64_t[::1] ids, const float[:, ::1] grads, int num_threads=1):
    cdef Py_ssize_t n = ids.shape[0], d = grads.shape[1], i, k, j, p, nu = 0
    cdef vector[pair[int64_t, int64_t]] keyed
    keyed.resize(n)
    cdef vector[int64_t] starts
    with nogil:
        for i in range(n):
            keyed[i].first = ids[i]
            keyed[i].second = i
        # (id, position) pairs: equal ids keep their batch order, so sums are deterministic
        sort(keyed.begin(), keyed.end())
        for i in range(n):
            if i == 0 or keyed[i].first != keyed[i - 1].first:
                starts.push_back(i)
        nu = starts.size()
        starts.push_back(n)
    uniq_np = np.empty(nu, dtype=np.int64)
    summed_np = np.empty((nu, d), dtype=np.float32)
    cdef int64_t[::1] uniq = uniq_np
    cdef float[:, ::1] summed = summed_np
    with nogil:
        for k in prange(nu, num_threads=num_threads, schedule='static'):
            uniq[k] = keyed[starts[k]].first
            p = keyed[starts[k]].second
            for j in range(d):
                summed[k, j] = grads[p, j]
            for i in range(starts[k] + 1, starts[k + 1]):
                p = keyed[i].second
                for j in range(d):
                    summed[k, j] = summed[k, j] + grads[p, j]
    return uniq_np, summed_np


def gather_rows(const float[:, ::1] table, const int64_t[::1] rows, float[:, ::1] out,
                int num_threads=1):
    cdef Py_ssize_t n = rows.shape[0], d = table.shape[1], i
    cdef size_t nbytes = d * sizeof(float)
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='static'):
            memcpy(&out[i, 0], &table[rows[i], 0], nbytes)
    return out


def sgd_update(float[:, ::1] weight, const int64_t[::1] rows, const float[:, ::1] grads,
               double lr, int num_threads=1):
    cdef Py_ssize_t n = rows.shape[0], d = weight.shape[1], i, j, r
    cdef float flr = <float>lr
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='static'):
            r = rows[i]
            for j in range(d):
                weight[r, j] = weight[r, j] - flr * grads[i, j]


def adagrad_update(float[:, ::1] weight, float[:, ::1] state_sum, const int64_t[::1] rows,
                   const float[:, ::1] grads, double clr, double eps, int num_threads=1):
    cdef Py_ssize_t n = rows.shape[0], d = weight.shape[1], i, j, r
    cdef float fclr = <float>clr, feps = <float>eps, g, s
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='static'):
            r = rows[i]
            for j in range(d):
                g = grads[i, j]
                s = state_sum[r, j] + g * g
                state_sum[r, j] = s
                weight[r, j] = weight[r, j] - fclr * (g / (sqrt(s) + feps))


def rowwise_adagrad_update(float[:, ::1] weight, float[::1] state_sum,
                           const int64_t[::1] rows, const float[:, ::1] grads,
                           double clr, double eps, int num_threads=1):
    cdef Py_ssize_t n = rows.shape[0], d = weight.shape[1], i, j, r
    cdef float fclr = <float>clr, feps = <float>eps, g, acc, std
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='static'):
            r = rows[i]
            acc = 0
            for j in range(d):
                g = grads[i, j]
                acc = acc + g * g
            state_sum[r] = state_sum[r] + acc / d
            std = <float>sqrt(state_sum[r]) + feps
            for j in range(d):
                weight[r, j] = weight[r, j] - fclr * (grads[i, j] / std)


def adam_update(float[:, ::1] weight, float[:, ::1] exp_avg, float[:, ::1] exp_avg_sq,
                const int64_t[::1] rows, const float[:, ::1] grads, double lr,
                double beta1, double beta2, double eps, int64_t step,
                int64_t[::1] row_steps=None, int num_threads=1):
    cdef Py_ssize_t n = rows.shape[0], d = weight.shape[1], i, j, r
    # 1 - beta in double, then rounded, as torch computes it
    cdef float omb1 = <float>(1.0 - beta1), omb2 = <float>(1.0 - beta2), feps = <float>eps
    cdef float g, m, v, fstep
    cdef double st, global_size = lr * sqrt(1.0 - pow(beta2, <double>step)) / (1.0 - pow(beta1, <double>step))
    cdef bint per_row = row_steps is not None
    with nogil:
        for i in prange(n, num_threads=num_threads, schedule='static'):
            r = rows[i]
            if per_row:
                row_steps[r] = row_steps[r] + 1
                st = <double>row_steps[r]
                fstep = <float>(lr * sqrt(1.0 - pow(beta2, st)) / (1.0 - pow(beta1, st)))
            else:
                fstep = <float>global_size
            for j in range(d):
                g = grads[i, j]
                m = exp_avg[r, j]
                m = m + (g - m) * omb1
                v = exp_avg_sq[r, j]
                v = v + (g * g - v) * omb2
                exp_avg[r, j] = m
                exp_avg_sq[r, j] = v
                weight[r, j] = weight[r, j] - fstep * (m / (<float>sqrt(v) + feps))
