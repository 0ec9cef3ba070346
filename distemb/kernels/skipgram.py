"""Skip-gram negative-sampling loss and its gradients in one pass, compiled or its twin.

The compiled kernel (``csrc/_skipgram.pyx``, one thread) is chosen by the same switches
as every kernel: it runs while :func:`distemb.kernels.active` is ``'compiled'``;
``DISTEMB_NO_EXT=1`` or ``kernels.implementation('reference')`` give the numpy twin in
:mod:`distemb.kernels.reference_skipgram`. Its AVX2 + FMA build runs where
:func:`distemb.kernels.current_cpu_isa` is ``'avx2'`` or ``'avx512'`` (``DISTEMB_CPU_ISA``,
``kernels.cpu_isa()``) and the CPU has FMA; the baseline build otherwise.

The inputs are rows of *unique* ids and index arrays into them, so the gradients come
out summed per unique row: the coalesced buffers an optimizer pushes. The autograd
wrapper users call is :func:`distemb.losses.skipgram_loss`.

Example:
    >>> import numpy as np
    >>> node = np.ones((2, 4), np.float32); ctx = np.zeros((3, 4), np.float32)
    >>> loss, g_node, g_ctx = sgns_loss_grad(node, ctx, np.array([0, 1]), np.array([2, 2]),
    ...                                      np.array([[0], [1]]))
    >>> round(loss, 4), g_ctx.shape        # 2 log 2: every score is 0
    (1.3863, (3, 4))
"""
from typing import Tuple

import numpy as np

from distemb import kernels
from distemb.arrays import Rows
from distemb.kernels import reference_skipgram

if kernels.HAS_EXT:
    from distemb import _skipgram as _compiled  # built with _kernels, same switch
else:
    _compiled = None


#: kernels.current_cpu_isa() values under which the AVX2 + FMA build of the pass runs (it
#: has no AVX-512 build of its own; every AVX-512 CPU runs AVX2 + FMA).
_VECTOR_ISAS = ("avx2", "avx512")


def _rows(name, a):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2:
        raise TypeError(f"{name}: expected a 2-d float32 array, got "
                        f"{type(a).__name__} dtype={getattr(a, 'dtype', None)} "
                        f"ndim={getattr(a, 'ndim', None)}")
    return np.ascontiguousarray(a)


def _index(name, a, ndim, num_rows, rows_name):
    a = np.asarray(a)
    if a.dtype.kind not in "iu" or a.ndim != ndim:
        raise TypeError(f"{name}: expected a {ndim}-d integer array, got dtype={a.dtype} "
                        f"ndim={a.ndim}")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= num_rows):
        bad = a.min() if a.min() < 0 else a.max()
        raise ValueError(f"{name}: expected indices into the {num_rows} rows of {rows_name}, "
                         f"got {int(bad)}")
    return a


def sgns_loss_grad(node_rows: Rows, context_rows: Rows, centers, positives,
                   negatives) -> Tuple[float, Rows, Rows]:
    """Mean skip-gram negative-sampling loss of a batch and its gradients, in one pass.

    ``loss = mean_b [-log s(u_b . c_b) - sum_k log s(-u_b . n_bk)]`` with
    ``u_b = node_rows[centers[b]]``, ``c_b = context_rows[positives[b]]`` and
    ``n_bk = context_rows[negatives[b, k]]`` (word2vec's objective, as
    ``graph_examples/deepwalk.py``'s plain torch loss).

    Args:
        node_rows: (Un, D) float32 center rows (typically of unique ids).
        context_rows: (Uc, D) float32 context rows (typically of unique ids).
        centers: (B,) indices into node_rows.
        positives: (B,) indices into context_rows.
        negatives: (B, K) indices into context_rows.

    Returns:
        (loss, grad_node (Un, D), grad_ctx (Uc, D)): the loss as a float and its exact
        gradients with respect to node_rows and context_rows (float32, summed per row).

    Raises:
        TypeError: rows not 2-d float32, indices not integer arrays of the right rank.
        ValueError: widths or batch sizes disagree, or an index is out of range.
    """
    node_rows = _rows("node_rows", node_rows)
    context_rows = _rows("context_rows", context_rows)
    if node_rows.shape[1] != context_rows.shape[1] or node_rows.shape[1] < 1:
        raise ValueError(f"context_rows: expected width {node_rows.shape[1]} (as node_rows, "
                         f">= 1), got shape {context_rows.shape}")
    centers = _index("centers", centers, 1, node_rows.shape[0], "node_rows")
    positives = _index("positives", positives, 1, context_rows.shape[0], "context_rows")
    negatives = _index("negatives", negatives, 2, context_rows.shape[0], "context_rows")
    b = centers.shape[0]
    if positives.shape[0] != b or negatives.shape[0] != b:
        raise ValueError(f"positives, negatives: expected {b} rows (as centers), got "
                         f"{positives.shape[0]} and {negatives.shape[0]}")
    if _compiled is not None and kernels.active() == "compiled":
        return _compiled.sgns_loss_grad(node_rows, context_rows, centers, positives,
                                        negatives, kernels.current_cpu_isa() in _VECTOR_ISAS)
    return reference_skipgram.sgns_loss_grad(node_rows, context_rows, centers, positives,
                                             negatives)
