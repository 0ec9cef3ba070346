"""distemb for PyG users: a ``FeatureStore`` over distemb tables, and ``Node2Vec``.

- :class:`DistFeatureStore`: PyG's remote-backend ``FeatureStore`` whose tensors are
  distemb tables (embedded, on servers, or collective), so ``NeighborLoader`` and
  ``LinkNeighborLoader`` read node features from wherever the tables live
  (:mod:`distemb.pyg.feature_store`);
- :class:`Node2Vec`: PyG's model with its table a distemb table, walked in plain torch
  (no pyg-lib), its loss fused (:mod:`distemb.pyg.node2vec`);
- :class:`RandomWalker`: the uniform and node2vec-biased walks it uses.

Importing this package imports PyG (the ``pyg`` extra). See docs/pyg.md.

Example:
    >>> import torch
    >>> from distemb.pyg import DistFeatureStore
    >>> store = DistFeatureStore(prefix="doc-pyg")
    >>> store.put_tensor(torch.ones(3, 2), group_name="paper", attr_name="x", index=None)
    True
"""
from distemb.pyg.feature_store import DistFeatureStore, table_name
from distemb.pyg.node2vec import Node2Vec
from distemb.pyg.walks import RandomWalker

__all__ = ["DistFeatureStore", "Node2Vec", "RandomWalker", "table_name"]
