"""``dist.optim``: the names of ``dgl.distributed.optim`` (distemb's optimizers).

They take DGL's arguments (``SparseAdagrad(params, lr, eps=1e-10)``, ``SparseAdam(params,
lr, betas=(0.9, 0.999), eps=1e-08)``) and DGL's attribute names (``_lr``, ``_eps``,
``_state``), with torch's maths: duplicate ids in a batch sum their gradients, and
SparseAdam counts steps per table as ``torch.optim.SparseAdam`` (DGL counts per row:
``SparseAdam(..., step_mode="per_row")``).

Example:
    >>> from distemb.dgl.optim import SparseAdagrad
"""
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD

__all__ = ["SparseAdagrad", "SparseAdam", "SparseRowWiseAdagrad", "SparseSGD"]
