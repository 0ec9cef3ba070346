"""Sparse optimizers for DistEmbedding (a drop-in for ``dgl.distributed.optim``)."""
from distemb.optim.base import SparseOptimizer
from distemb.optim.optimizers import (SparseAdagrad, SparseAdam, SparseFtrl,
                                      SparseRowWiseAdagrad, SparseSGD)

__all__ = ["SparseOptimizer", "SparseSGD", "SparseAdagrad", "SparseRowWiseAdagrad", "SparseAdam",
           "SparseFtrl"]
