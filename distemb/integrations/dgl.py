"""DGL integration: the one place distemb meets DGL (importing this module imports DGL).

What DGL 1.1.3 needs on torch 2.13, done here once:

- ``DGLBACKEND=pytorch`` is set (if unset) before DGL is imported, otherwise DGL prints a
  warning and writes ``~/.dgl/config.json``;
- numpy < 2 (DGL 1.1.3 is built against numpy 1.x; distemb's requirements pin it);
- ``dgl.sparse`` cannot load (its C++ library is built per torch version): nothing here
  or in distemb imports it. DataLoader, NeighborSampler, random walks, SAGEConv and
  ``dgl.distributed.partition_graph`` all work without it.

Example:
    >>> import torch
    >>> from distemb.integrations.dgl import dgl, node_embeddings, lookup
    >>> g = dgl.heterograph({("u", "r", "i"): ([0, 1], [1, 2])}, {"u": 2, "i": 3})
    >>> embs = node_embeddings(g, 4, prefix="doc-dgl")
    >>> {k: tuple(v.shape) for k, v in lookup(embs, {"u": torch.tensor([1])}).items()}
    {'u': (1, 4)}
"""
import os

os.environ.setdefault("DGLBACKEND", "pytorch")

try:
    import dgl  # noqa: E402  (after DGLBACKEND, on purpose)
except ModuleNotFoundError as e:
    if e.name != "dgl":
        raise
    raise ModuleNotFoundError(
        "distemb's DGL integration (distemb.dgl, distemb.integrations.dgl) needs DGL, which "
        "is not installed here: pip install 'distemb[dgl]' (dgl==1.1.3, the newest DGL "
        "that runs on torch 2.13; docs/dgl.md)", name="dgl") from None

import numpy as np  # noqa: E402

from distemb.embedding import DistEmbedding  # noqa: E402
from distemb.errors import DistEmbError  # noqa: E402
from distemb.partition import (EDGE, NODE, PartitionPolicy, RangePartitionBook,  # noqa: E402
                               load_dgl_partition_config)

__all__ = ["dgl", "partition_policies", "node_embeddings", "lookup", "partition",
           "convert_book", "convert_policy"]


def _type_key(type_name):
    """distemb's name of a DGL type: canonical edge types are written 'src:rel:dst'."""
    return ":".join(type_name) if isinstance(type_name, tuple) else type_name


def _bounds(ids_of, num_parts):
    # DGL's range books give every partition one contiguous, ascending range of each
    # type's (type-wise) ids, so the sizes alone give the bounds.
    sizes = [len(ids_of(p)) for p in range(num_parts)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def convert_book(gpb):
    """A distemb :class:`RangePartitionBook` equal to DGL's graph partition book ``gpb``.

    Args:
        gpb: a ``dgl.distributed.GraphPartitionBook`` (``g.get_partition_book()``,
            ``load_partition_book(...)[0]``).

    Returns:
        RangePartitionBook with every node type and canonical edge type of ``gpb``.

    Raises:
        TypeError: ``gpb`` is not a DGL graph partition book.
    """
    if not isinstance(gpb, dgl.distributed.GraphPartitionBook):
        raise TypeError(f"partition_book: expected a dgl.distributed.GraphPartitionBook, "
                        f"got {type(gpb).__name__}")
    n = gpb.num_partitions()
    nodes = {nt: _bounds(lambda p, nt=nt: gpb.partid2nids(p, nt), n) for nt in gpb.ntypes}
    edges = {_type_key(c): _bounds(lambda p, c=c: gpb.partid2eids(p, c), n)
             for c in gpb.canonical_etypes}
    return RangePartitionBook(n, node_bounds=nodes, edge_bounds=edges)


def convert_policy(policy):
    """The distemb policy of a ``dgl.distributed.PartitionPolicy`` (distemb's pass through).

    Args:
        policy: a DGL ``PartitionPolicy`` / ``NodePartitionPolicy`` /
            ``EdgePartitionPolicy``, a distemb :class:`PartitionPolicy`, or None.

    Returns:
        a distemb PartitionPolicy sharding the same ids the same way (None for None).

    Raises:
        TypeError: ``policy`` is neither.

    Example:
        >>> g = dgl.graph(([0, 1, 2], [1, 2, 3]))
        >>> # DGL's own policies come from a partitioned graph's book; see tests.
        >>> convert_policy(None) is None
        True
    """
    if policy is None or isinstance(policy, PartitionPolicy):
        return policy
    if not isinstance(policy, dgl.distributed.PartitionPolicy):
        raise TypeError(f"part_policy: expected a distemb or DGL PartitionPolicy, got "
                        f"{type(policy).__name__}")
    kind = NODE if policy.is_node else EDGE
    return PartitionPolicy(kind, _type_key(policy.type_name),
                           convert_book(policy.partition_book), part_id=policy.part_id)


def partition_policies(part_config):
    """Node and edge policies of a ``dgl.distributed.partition_graph`` output.

    Returns:
        dict keyed ``'node~<ntype>'`` / ``'edge~<etype>'``.
    """
    return load_dgl_partition_config(part_config)[1]


def partition(graph, name, num_parts, out_dir, part_method="random", **kwargs):
    """Partition ``graph`` with DGL and return the policies of its node/edge types.

    Args:
        graph: a DGL graph.
        name: the graph name (the config is ``out_dir/name.json``).
        num_parts: number of partitions.
        out_dir: where DGL writes the partitions.
        part_method: 'random' or 'metis' (metis needs DGL's METIS build).
        kwargs: passed to ``dgl.distributed.partition_graph``.
    """
    dgl.distributed.partition_graph(graph, name, num_parts, out_dir,
                                    part_method=part_method, **kwargs)
    return partition_policies(os.path.join(out_dir, f"{name}.json"))


def node_embeddings(graph, dim, prefix="emb", init_func=None, policies=None, context=None):
    """One :class:`DistEmbedding` per node type of ``graph``, named ``<prefix>:<ntype>``.

    Args:
        graph: a DGL graph (its node counts size the tables).
        dim: embedding dimension.
        prefix: KVStore name prefix.
        init_func: ``init_func(shape, dtype)`` of every table (zeros when None).
        policies: from :func:`partition_policies`, to shard as the graph is partitioned.
        context: the DistContext (default: the current one).

    Returns:
        dict ntype -> DistEmbedding.
    """
    out = {}
    for ntype in graph.ntypes:
        policy = None
        if policies is not None:
            key = f"node~{ntype}"
            if key not in policies:
                raise DistEmbError(f"policies: no policy {key!r} (have {sorted(policies)})")
            policy = policies[key]
        out[ntype] = DistEmbedding(graph.num_nodes(ntype), dim, name=f"{prefix}:{ntype}",
                                   init_func=init_func, part_policy=policy, context=context)
    return out


def lookup(embeddings, input_nodes, device="cpu"):
    """Rows for a DGL DataLoader's ``input_nodes`` (a tensor, or a dict per node type).

    Args:
        embeddings: a DistEmbedding, or a dict ntype -> DistEmbedding.
        input_nodes: what ``dgl.dataloading.DataLoader`` yields first.
        device: where the rows go.

    Returns:
        a tensor, or a dict ntype -> tensor (types without input nodes are skipped).
    """
    if isinstance(input_nodes, dict):
        if not isinstance(embeddings, dict):
            raise DistEmbError("embeddings: input_nodes is a dict per node type, so pass a "
                               "dict ntype -> DistEmbedding (see node_embeddings)")
        missing = sorted(set(input_nodes) - set(embeddings))
        if missing:
            raise DistEmbError(f"embeddings: no table for node type(s) {missing}")
        return {nt: embeddings[nt](ids, device=device) for nt, ids in input_nodes.items()
                if len(ids)}
    if isinstance(embeddings, dict):
        if len(embeddings) != 1:
            raise DistEmbError(f"input_nodes is one tensor but there are "
                               f"{len(embeddings)} tables; pass the one to use")
        embeddings = next(iter(embeddings.values()))
    return embeddings(input_nodes, device=device)
