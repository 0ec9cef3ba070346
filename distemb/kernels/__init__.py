"""The one module that imports compiled kernels, with a reference twin for each.

``HAS_EXT`` says whether the compiled module (``distemb._kernels``, built from
``csrc/_kernels.pyx`` with OpenMP) loaded. Set ``DISTEMB_NO_EXT=1`` to force the numpy
twins in :mod:`distemb.kernels.reference`. Functions here validate dtypes and layout once
and then trust the compiled code: ids must already be range-checked by the caller.

Example:
    >>> import numpy as np
    >>> from distemb import kernels
    >>> ids = np.array([3, 1, 3], dtype=np.int64)
    >>> g = np.ones((3, 2), dtype=np.float32)
    >>> kernels.dedup_sum(ids, g)[0]
    array([1, 3])
"""
import os

import numpy as np

from distemb.kernels import reference

if os.environ.get("DISTEMB_NO_EXT", "") not in ("", "0"):
    _impl = reference
    HAS_EXT = False
else:
    try:
        from distemb import _kernels as _impl
        HAS_EXT = True
    except ImportError:  # not built (e.g. running from a bare checkout)
        _impl = reference
        HAS_EXT = False

IMPL_NAME = "compiled" if HAS_EXT else "reference"


def _ids(a):
    return np.ascontiguousarray(a, dtype=np.int64)


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def _check_table(name, a, ndim=2):
    if a.dtype != np.float32 or a.ndim != ndim or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array of {ndim} dims, "
                        f"got dtype={a.dtype}, ndim={a.ndim}")


def _check_rows(rows, grads, weight):
    if grads.ndim != 2 or grads.shape[0] != rows.shape[0] or grads.shape[1] != weight.shape[1]:
        raise ValueError(f"grads: expected shape ({rows.shape[0]}, {weight.shape[1]}), "
                         f"got {tuple(grads.shape)}")


def dedup_sum(ids, grads, num_threads=1):
    """Deduplicate ``ids`` and sum the gradient rows of each duplicate.

    Args:
        ids: (N,) integer ids, any order, duplicates allowed.
        grads: (N, D) float32 gradient rows, one per id.
        num_threads: OpenMP threads.

    Returns:
        (uniq, summed): ascending unique ids (int64) and their (U, D) float32 sums.
    """
    ids = _ids(ids).reshape(-1)
    grads = _f32(grads)
    if grads.ndim != 2 or grads.shape[0] != ids.shape[0]:
        raise ValueError(f"grads: expected shape ({ids.shape[0]}, D), got {tuple(grads.shape)}")
    return _impl.dedup_sum(ids, grads, num_threads=num_threads)


def gather_rows(table, rows, out=None, num_threads=1):
    """Copy ``table[rows]`` into ``out`` (allocated when None) and return it."""
    _check_table("table", table)
    rows = _ids(rows)
    if out is None:
        out = np.empty((rows.shape[0], table.shape[1]), dtype=np.float32)
    elif out.shape != (rows.shape[0], table.shape[1]) or out.dtype != np.float32:
        raise ValueError(f"out: expected float32 {(rows.shape[0], table.shape[1])}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    _impl.gather_rows(table, rows, out, num_threads=num_threads)
    return out


def sgd_update(weight, rows, grads, lr, num_threads=1):
    """In place: ``weight[rows] -= lr * grads``. ``rows`` must be unique."""
    _check_table("weight", weight)
    rows, grads = _ids(rows), _f32(grads)
    _check_rows(rows, grads, weight)
    _impl.sgd_update(weight, rows, grads, float(lr), num_threads=num_threads)


def adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place, torch.optim.Adagrad's sparse rule on unique ``rows``."""
    _check_table("weight", weight)
    _check_table("state_sum", state_sum)
    rows, grads = _ids(rows), _f32(grads)
    _check_rows(rows, grads, weight)
    _impl.adagrad_update(weight, state_sum, rows, grads, float(clr), float(eps),
                         num_threads=num_threads)


def rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place, row-wise Adagrad (one accumulator per row: the mean of g^2)."""
    _check_table("weight", weight)
    _check_table("state_sum", state_sum, ndim=1)
    rows, grads = _ids(rows), _f32(grads)
    _check_rows(rows, grads, weight)
    _impl.rowwise_adagrad_update(weight, state_sum, rows, grads, float(clr), float(eps),
                                 num_threads=num_threads)


def adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, num_threads=1):
    """In place, torch.optim.SparseAdam's rule on unique ``rows``.

    ``step`` is the global step (torch semantics); with ``row_steps`` (int64, one per
    table row) each row counts and bias-corrects its own steps instead.
    """
    for name, a in (("weight", weight), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_table(name, a)
    if row_steps is not None and (row_steps.dtype != np.int64 or row_steps.ndim != 1):
        raise TypeError(f"row_steps: expected a 1-d int64 array, got {row_steps.dtype}")
    rows, grads = _ids(rows), _f32(grads)
    _check_rows(rows, grads, weight)
    _impl.adam_update(weight, exp_avg, exp_avg_sq, rows, grads, float(lr), float(beta1),
                      float(beta2), float(eps), int(step), row_steps=row_steps,
                      num_threads=num_threads)
