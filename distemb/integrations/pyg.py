"""PyG integration: the one place distemb imports PyG (``torch_geometric``).

PyG 2.8 is pure Python and installs beside the torch this project pins (the ``pyg``
extra; ``make`` installs it with its compiled companions torch-scatter and torch-sparse,
which its neighbour samplers use). Importing this module imports PyG, or fails saying
how to install it.

Example:
    >>> from distemb.integrations.pyg import torch_geometric
    >>> torch_geometric.data.FeatureStore.__name__
    'FeatureStore'
"""
try:
    import torch_geometric
    import torch_geometric.data  # noqa: F401  (FeatureStore, TensorAttr)
except ImportError as e:  # pragma: no cover - the extra is part of the project's setup
    raise ImportError(f"distemb.pyg needs PyG (torch-geometric): install the project's "
                      f"'pyg' extra (pip install -e '.[pyg]', or make): {e}") from e

__all__ = ["torch_geometric"]
