"""distemb: distributed, sparsely trained embedding tables for graph learning.

Trainer-side names (the context, DistTensor, DistEmbedding, the optimizers) are imported
on first use, so a server process (``python -m distemb.server``) that imports ``distemb``
never imports torch nor :mod:`distemb.context`.

Example:
    >>> import torch, distemb
    >>> emb = distemb.DistEmbedding(100, 8, name="doc-init",
    ...                             init_func=lambda s, d: torch.randn(s, dtype=d))
    >>> opt = distemb.SparseAdagrad([emb], lr=0.1)
    >>> loss = emb(torch.tensor([1, 2, 2])).sum(); loss.backward(); opt.step()
"""
import importlib

from distemb import malloc
from distemb.errors import (BackendError, ConfigError, DistEmbError, KVStoreError,
                            NonFiniteGradientError, PartitionError, TraceOverflowError)
from distemb.partition import (EdgePartitionPolicy, HashPartitionBook, NodePartitionPolicy,
                               PartitionPolicy, RangePartitionBook, load_dgl_partition_config,
                               load_policy_config)

__version__ = "0.1.0"

malloc.tune()  # a step's large buffers reused, not faulted in again (see distemb.malloc)

_LAZY = {
    "DistContext": "distemb.context",
    "current_context": "distemb.context",
    "initialize": "distemb.context",
    "shutdown": "distemb.context",
    "DistTensor": "distemb.tensor",
    "DistEmbedding": "distemb.embedding",
    "grouped_lookup": "distemb.grouped",
    "DynamicEmbedding": "distemb.dynamic",
    "StoreEmbedding": "distemb.dynamic",
    "SparseOptimizer": "distemb.optim",
    "SparseSGD": "distemb.optim",
    "SparseAdagrad": "distemb.optim",
    "SparseRowWiseAdagrad": "distemb.optim",
    "SparseAdam": "distemb.optim",
    "SparseFtrl": "distemb.optim",
    "skipgram_loss": "distemb.losses",
}

__all__ = sorted(["DistContext", "current_context", "initialize", "shutdown", "DistEmbError",
                  "BackendError", "ConfigError", "KVStoreError", "PartitionError",
                  "TraceOverflowError", "NonFiniteGradientError", "EdgePartitionPolicy", "HashPartitionBook",
                  "NodePartitionPolicy", "PartitionPolicy", "RangePartitionBook",
                  "load_dgl_partition_config", "load_policy_config", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distemb' has no attribute {name!r}")
