"""Reference twins of the compiled kernels: plain numpy, obviously correct, slow.

Every function here has the signature declared in :mod:`distemb.kernels.ops` and the same
in-place effects as its compiled counterpart in ``csrc/_kernels.pyx``; the kernel tests run
both and compare.
Inputs are assumed validated by :mod:`distemb.kernels` (dtypes, contiguity, ranges).
"""
import numpy as np


def dedup_sum(ids, grads, num_rows=None, out=None, num_threads=1):
    """Unique ids (ascending) and the sum of the gradient rows of each (into out[:U])."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    if out is None:
        summed = np.zeros((uniq.shape[0], grads.shape[1]), dtype=np.float32)
    else:
        summed = out[:uniq.shape[0]]
        summed[...] = 0
    np.add.at(summed, inverse, grads)
    return uniq, summed


def gather_rows(table, rows, out=None, num_threads=1):
    """out[i] = table[rows[i]]."""
    if out is None:
        return np.take(table, rows, axis=0)
    np.take(table, rows, axis=0, out=out)
    return out


def sgd_update(weight, rows, grads, lr, num_threads=1):
    """weight[rows] -= lr * grads (rows unique)."""
    weight[rows] -= np.float32(lr) * grads


def adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """torch.optim.Adagrad on coalesced rows: s += g^2; w -= clr * g / (sqrt(s) + eps)."""
    s = state_sum[rows] + grads * grads
    state_sum[rows] = s
    weight[rows] -= np.float32(clr) * (grads / (np.sqrt(s) + np.float32(eps)))


def rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """Row-wise Adagrad: s_row += mean(g^2); w -= clr * g / (sqrt(s_row) + eps)."""
    s = state_sum[rows] + (grads * grads).mean(axis=1, dtype=np.float32)
    state_sum[rows] = s
    std = np.sqrt(s) + np.float32(eps)
    weight[rows] -= np.float32(clr) * (grads / std[:, None])


def adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                step, row_steps=None, num_threads=1):
    """torch.optim.SparseAdam on coalesced rows.

    ``step`` is the optimizer's global step (torch semantics). When ``row_steps`` is
    given, each row counts its own steps instead (incremented here, in place) and its
    bias correction uses that count (DGL / lazy-Adam semantics).
    """
    omb1, omb2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)  # in double, as torch
    m = exp_avg[rows]
    v = exp_avg_sq[rows]
    m = m + (grads - m) * omb1
    v = v + (grads * grads - v) * omb2
    exp_avg[rows] = m
    exp_avg_sq[rows] = v
    if row_steps is None:
        steps = np.full(rows.shape[0], float(step))
    else:
        row_steps[rows] += 1
        steps = row_steps[rows].astype(np.float64)
    step_size = lr * np.sqrt(1.0 - beta2 ** steps) / (1.0 - beta1 ** steps)
    upd = m / (np.sqrt(v) + np.float32(eps))
    weight[rows] -= step_size.astype(np.float32)[:, None] * upd


def ftrl_update(weight, accum, linear, rows, grads, lr, lr_power, l1, l2, l2_shrinkage, beta,
                num_threads=1):
    """FTRL-Proximal (tf.keras.optimizers.Ftrl) on coalesced rows, in float32.

    ``n^-p`` is a square root for ``lr_power = -0.5`` and 1 for ``lr_power = 0``.
    """
    f32 = np.float32
    flr = f32(lr)
    w, n, z = weight[rows], accum[rows], linear[rows]
    shrunk = grads + f32(2.0 * l2_shrinkage) * w
    n_new = n + grads * grads
    if lr_power == -0.5:
        p_new, p_old = np.sqrt(n_new), np.sqrt(n)
    elif lr_power == 0.0:
        p_new = p_old = np.ones_like(n)
    else:
        p_new, p_old = np.power(n_new, f32(-lr_power)), np.power(n, f32(-lr_power))
    z = z + (shrunk - (p_new - p_old) / flr * w)
    accum[rows] = n_new
    linear[rows] = z
    quadratic = p_new / flr + f32(2.0 * (l2 + beta / (2.0 * lr)))
    weight[rows] = (np.clip(z, -f32(l1), f32(l1)) - z) / quadratic
