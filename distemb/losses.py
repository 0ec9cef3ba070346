"""Fused losses over looked-up rows: forward and backward in one compiled pass.

:func:`skipgram_loss` is word2vec's negative-sampling objective (DeepWalk, node2vec,
LINE) on rows of *unique* ids. The forward pass computes the loss and, in the same
pass, the gradients summed per unique row; backward only hands them out. With lookups
of unique ids, the gradients autograd leaves on the rows are then already coalesced,
and the optimizer's sum per id has nothing left to add.

Example:
    >>> import torch, distemb
    >>> node = distemb.DistEmbedding(10, 4, name="doc-sg-node",
    ...                              init_func=lambda s, d: torch.full(s, 0.1, dtype=d))
    >>> ctx = distemb.DistEmbedding(10, 4, name="doc-sg-ctx")
    >>> opt = distemb.SparseAdam([node, ctx], lr=0.01)
    >>> centers, contexts = torch.tensor([1, 1, 2]), torch.tensor([2, 3, 1])
    >>> negatives = torch.tensor([[5, 6], [7, 5], [8, 9]])
    >>> u_ids, u_idx = torch.unique(centers, return_inverse=True)
    >>> c_ids, c_idx = torch.unique(torch.cat([contexts, negatives.reshape(-1)]),
    ...                             return_inverse=True)
    >>> loss = skipgram_loss(node(u_ids), ctx(c_ids), u_idx, c_idx[:3], c_idx[3:].view(3, 2))
    >>> loss.backward(); opt.step()
    >>> round(loss.item(), 4)          # 3 log 2: every context row starts at zero
    2.0794
"""
import numpy as np
import torch

from distemb.kernels import skipgram as skipgram_kernels


class _SkipGramLoss(torch.autograd.Function):
    """The loss in forward; its gradients, computed there too, scaled in backward."""

    @staticmethod
    def forward(ctx, node_rows, context_rows, centers, positives, negatives):
        loss, grad_node, grad_ctx = skipgram_kernels.sgns_loss_grad(
            _numpy(node_rows), _numpy(context_rows), _numpy(centers), _numpy(positives),
            _numpy(negatives))
        # Kept as attributes, not saved tensors, and dropped in backward: autograd then
        # holds the only reference and hands the buffers to the rows' .grad as they are
        # (a saved tensor is shared, so it would copy them, ~10 MB a DeepWalk step).
        ctx.grads = (torch.from_numpy(grad_node).to(node_rows.device),
                     torch.from_numpy(grad_ctx).to(context_rows.device))
        return torch.tensor(loss, dtype=node_rows.dtype, device=node_rows.device)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("skipgram_loss: backward ran twice on one graph (its "
                               "gradients are handed out once; no retain_graph)")
        (grad_node, grad_ctx), ctx.grads = ctx.grads, None
        if grad_out.numel() != 1 or float(grad_out) != 1.0:  # loss.backward(): scale is 1
            grad_node, grad_ctx = grad_node * grad_out, grad_ctx * grad_out
        return grad_node, grad_ctx, None, None, None


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def skipgram_loss(node_rows: torch.Tensor, context_rows: torch.Tensor,
                  centers: torch.Tensor, positives: torch.Tensor,
                  negatives: torch.Tensor) -> torch.Tensor:
    """Mean skip-gram negative-sampling loss, differentiable in both row tensors.

    ``mean_b [-log s(u_b . c_b) - sum_k log s(-u_b . n_bk)]`` with
    ``u_b = node_rows[centers[b]]``, ``c_b = context_rows[positives[b]]``,
    ``n_bk = context_rows[negatives[b, k]]``: the same value and gradients as that
    expression written with torch ops (``tests/test_losses.py`` checks it against
    autograd), without materialising the (B, 1 + K, D) rows. Forward and backward run
    in one compiled pass on the CPU (its numpy twin under ``DISTEMB_NO_EXT=1``); rows on
    a GPU are copied to the host and the gradients back.

    Args:
        node_rows: (Un, D) float32 rows, e.g. ``node_table(unique_center_ids)``.
        context_rows: (Uc, D) float32 rows, e.g. ``context_table(unique_context_ids)``.
        centers: (B,) int64 indices into node_rows.
        positives: (B,) int64 indices into context_rows.
        negatives: (B, K) int64 indices into context_rows.

    Returns:
        A scalar tensor; ``backward()`` leaves on each row tensor the gradient summed
        per row.

    Raises:
        TypeError, ValueError: see :func:`distemb.kernels.skipgram.sgns_loss_grad`.
    """
    for name, t in (("node_rows", node_rows), ("context_rows", context_rows)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 torch.Tensor, got "
                            f"{type(t).__name__} dtype={getattr(t, 'dtype', None)}")
    return _SkipGramLoss.apply(node_rows, context_rows, centers, positives, negatives)
