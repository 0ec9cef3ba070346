"""The table classes and policy helpers of ``dgl.distributed`` that distemb covers.

DGL's partition policies and books are converted to distemb's here; each class is
distemb's own with DGL's signature and DGL's lifetime rule (a non-persistent table is
deleted with its last object). Importing this module imports DGL.

Example:
    >>> from distemb.dgl.tables import DistEmbedding
    >>> emb = DistEmbedding(10, 4, name="doc-tables")
"""
from distemb import context as _context
from distemb import embedding as _embedding
from distemb import partition as _partition
from distemb import tensor as _tensor
from distemb.integrations.dgl import convert_policy, dgl

__all__ = ["DistEmbedding", "DistTensor", "PartitionPolicy", "NodePartitionPolicy",
           "EdgePartitionPolicy", "dgl_policy_for", "convert_policy"]


def dgl_policy_for(num_rows):
    """The policy DGL itself would give a tensor of ``num_rows`` rows, or None.

    DGL's ``DistTensor`` without ``part_policy`` takes the one node or edge policy of the
    current ``DistGraph`` whose type has ``num_rows`` ids. Here: that policy converted to
    distemb's when exactly one matches, else None (distemb's default: even ranges over
    the servers; DGL would refuse a tensor matching no type, distemb allows it).
    """
    kv = dgl.distributed.kvstore.get_kvstore()
    policies = [] if kv is None else list(kv.all_possible_part_policy.values())
    found = [p for p in policies if p.get_size() == num_rows]
    return convert_policy(found[0]) if len(found) == 1 else None


class DistEmbedding(_embedding.DistEmbedding):
    """:class:`distemb.DistEmbedding` with DGL's policy objects and DGL's lifetime rule.

    As in DGL, the table is not persistent: it is deleted (with its optimizer state)
    once the last object of it is gone in the process that created it, so
    ``DistEmbedding(n, d, name="x")`` made again later starts from ``init_func``. Pass
    ``persistent=True`` (a distemb extension) to keep it.

    Example:
        >>> emb = DistEmbedding(10, 4, name="doc-mirror-emb")
    """

    def __init__(self, num_embeddings, embedding_dim, name=None, init_func=None,
                 part_policy=None, persistent=False, **kwargs):
        policy = convert_policy(part_policy)
        if policy is None:
            policy = dgl_policy_for(num_embeddings)
        super().__init__(num_embeddings, embedding_dim, name=name, init_func=init_func,
                         part_policy=policy, persistent=persistent, **kwargs)


class DistTensor(_tensor.DistTensor):
    """:class:`distemb.DistTensor` with DGL's signature (``is_gdata`` accepted).

    ``is_gdata`` only says, in DGL, whether the tensor is registered as graph data; distemb
    keeps no graph, so it has no effect; nor has ``attach`` (DGL's group-id suffix of
    the name: distemb's names are per job). Without ``part_policy`` the tensor is
    sharded as DGL would shard it (:func:`dgl_policy_for`). It lives in distemb's store,
    not DGL's: DGL's private ``g._client.data_name_list()`` does not list it.

    Example:
        >>> import torch
        >>> t = DistTensor((4, 2), torch.float32, "doc-mirror-t")
    """

    def __init__(self, shape, dtype, name=None, init_func=None, part_policy=None,
                 persistent=False, is_gdata=True, attach=True, **kwargs):
        policy = convert_policy(part_policy)
        if policy is None:
            # the rows as given: a shape that is not ints is refused (named) by the core
            rows = shape[0] if isinstance(shape, (tuple, list)) and shape else shape
            policy = dgl_policy_for(rows)
        super().__init__(shape, dtype, name=name, init_func=init_func, part_policy=policy,
                         persistent=persistent, **kwargs)

    @property
    def kvstore_key(self):
        """DGL's key of the tensor in its store: here distemb's name (not in DGL's store)."""
        return self.name

    def count_nonzero(self, chunk_rows=65536):
        """DGL's ``count_nonzero()``: the nonzero elements of the whole tensor.

        Reads the rows in chunks of ``chunk_rows``.
        """
        total = 0
        for lo in range(0, len(self), chunk_rows):
            total += int((self[lo:min(lo + chunk_rows, len(self))] != 0).sum())
        return total


def PartitionPolicy(policy_str, partition_book):  # noqa: N802 (DGL's class name)
    """DGL's ``PartitionPolicy(policy_str, partition_book)``, as a distemb policy.

    Args:
        policy_str: ``'node'``, ``'edge'``, ``'node~<ntype>'`` or ``'edge~<etype>'``.
        partition_book: DGL's graph partition book or a distemb partition book.

    Raises:
        PartitionError: unknown kind or type.
    """
    if isinstance(partition_book, dgl.distributed.GraphPartitionBook):
        return convert_policy(dgl.distributed.PartitionPolicy(policy_str, partition_book))
    kind, _, type_name = policy_str.partition("~")
    default = "_N" if kind == _partition.NODE else "_E"
    return _partition.PartitionPolicy(kind, type_name or default, partition_book)


def NodePartitionPolicy(partition_book, ntype="_N"):  # noqa: N802
    """DGL's ``NodePartitionPolicy(partition_book, ntype)``, as a distemb policy."""
    return PartitionPolicy(f"node~{ntype}", partition_book)


def EdgePartitionPolicy(partition_book, etype="_E"):  # noqa: N802
    """DGL's ``EdgePartitionPolicy(partition_book, etype)`` (etype: str or canonical tuple)."""
    name = ":".join(etype) if isinstance(etype, tuple) else etype
    if isinstance(partition_book, dgl.distributed.GraphPartitionBook):
        return convert_policy(dgl.distributed.EdgePartitionPolicy(partition_book, etype))
    return PartitionPolicy(f"edge~{name}", partition_book)
