"""Reference twin of the compiled skip-gram kernel (``csrc/_skipgram.pyx``): plain numpy.

Inputs are assumed validated by :mod:`distemb.kernels.skipgram` (dtypes, shapes, ranges).
"""
import numpy as np


def _log_sigmoid(x):
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def sgns_loss_grad(node_rows, context_rows, centers, positives, negatives):
    """(mean loss, d loss / d node_rows, d loss / d context_rows) in float32 buffers.

    loss = mean_b [-log s(u_b . c_b) - sum_k log s(-u_b . n_bk)] with u_b =
    node_rows[centers[b]], c_b = context_rows[positives[b]], n_bk =
    context_rows[negatives[b, k]]; the gradients are summed per row of the inputs.
    """
    b_n, d = centers.shape[0], node_rows.shape[1]
    grad_node = np.zeros(node_rows.shape, dtype=np.float32)
    grad_ctx = np.zeros(context_rows.shape, dtype=np.float32)
    if b_n == 0:
        return 0.0, grad_node, grad_ctx
    u = node_rows[centers]
    pos = context_rows[positives]
    neg = context_rows[negatives]                          # (B, K, D)
    s_pos = np.einsum("bd,bd->b", u, pos).astype(np.float64)
    s_neg = np.einsum("bd,bkd->bk", u, neg).astype(np.float64)
    loss = -(_log_sigmoid(s_pos).sum() + _log_sigmoid(-s_neg).sum()) / b_n
    g_pos = ((_sigmoid(s_pos) - 1.0) / b_n).astype(np.float32)
    g_neg = (_sigmoid(s_neg) / b_n).astype(np.float32)
    g_u = g_pos[:, None] * pos + np.einsum("bk,bkd->bd", g_neg, neg)
    np.add.at(grad_node, centers, g_u)
    np.add.at(grad_ctx, positives, g_pos[:, None] * u)
    np.add.at(grad_ctx, negatives.reshape(-1),
              (g_neg[:, :, None] * u[:, None, :]).reshape(-1, d))
    return float(loss), grad_node, grad_ctx
