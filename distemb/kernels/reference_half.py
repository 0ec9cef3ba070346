"""Reference twins of the half-precision kernels (``csrc/half_kernels.h``), in numpy.

Each decodes the touched rows to float32, runs the float32 reference kernel
(:mod:`distemb.kernels.reference`) on them, and encodes the result with
round-to-nearest-even: the definition the compiled kernels follow. ``kind`` is 0 for
bfloat16 (uint16 bits), 1 for IEEE float16; weights arrive as their uint16 bits.
"""
import numpy as np

from distemb.kernels import reference

BF16, F16 = 0, 1


def decode(kind, src, dst):
    """dst (float32) = the values of the half bits ``src``."""
    if kind == BF16:
        dst[...] = (src.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        dst[...] = src.view(np.float16).astype(np.float32)


def encode(kind, src, dst):
    """dst (uint16 bits) = ``src`` (float32) rounded to nearest, ties to even."""
    if kind == BF16:
        u = np.ascontiguousarray(src, dtype=np.float32).view(np.uint32)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> 16
        dst[...] = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    else:
        with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as IEEE says
            dst[...] = src.astype(np.float16).view(np.uint16)


def _rows(kind, weight, rows):
    out = np.empty((rows.shape[0], weight.shape[1]), np.float32)
    decode(kind, weight[rows], out)
    return out


def _store(kind, weight, rows, values):
    bits = np.empty(values.shape, np.uint16)
    encode(kind, values, bits)
    weight[rows] = bits


def gather_rows(kind, table, rows, out, num_threads=1):
    decode(kind, table[rows], out)


def sgd_update(kind, weight, rows, grads, lr, num_threads=1):
    w = _rows(kind, weight, rows)
    reference.sgd_update(w, np.arange(len(rows)), grads, lr)
    _store(kind, weight, rows, w)


def adagrad_update(kind, weight, state_sum, rows, grads, clr, eps, num_threads=1):
    w, s = _rows(kind, weight, rows), state_sum[rows]
    reference.adagrad_update(w, s, np.arange(len(rows)), grads, clr, eps)
    state_sum[rows] = s
    _store(kind, weight, rows, w)


def rowwise_adagrad_update(kind, weight, state_sum, rows, grads, clr, eps, num_threads=1):
    w, s = _rows(kind, weight, rows), state_sum[rows]
    reference.rowwise_adagrad_update(w, s, np.arange(len(rows)), grads, clr, eps)
    state_sum[rows] = s
    _store(kind, weight, rows, w)


def adam_update(kind, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, num_threads=1):
    w, m, v = _rows(kind, weight, rows), exp_avg[rows], exp_avg_sq[rows]
    rs = None if row_steps is None else row_steps[rows]
    reference.adam_update(w, m, v, np.arange(len(rows)), grads, lr, beta1, beta2, eps, step,
                          row_steps=rs)
    exp_avg[rows], exp_avg_sq[rows] = m, v
    if rs is not None:
        row_steps[rows] = rs
    _store(kind, weight, rows, w)
