"""``import distemb.dgl as dist``: the names of ``dgl.distributed`` that distemb covers.

Code written for DGL's distributed embeddings runs after replacing ``import
dgl.distributed as dist`` with ``import distemb.dgl as dist`` (``dist.optim.SparseAdam``
by module path included), or ``from dgl.distributed import X`` with ``from distemb.dgl
import X``. DGL's partition policies and books (``dgl.distributed.PartitionPolicy("node",
g.get_partition_book())``) are converted to distemb's here; everything else is distemb's
own class, with torch's semantics (duplicate ids sum their gradients; DGL averages).
Importing this module imports DGL (through :mod:`distemb.integrations.dgl`).

Not here: ``DistGraph``, samplers and ``node_split`` (keep using DGL's), ``KVServer`` /
``KVClient`` (distemb's are in :mod:`distemb.kvstore`).

Example:
    >>> import torch
    >>> import distemb.dgl as dist
    >>> emb = dist.DistEmbedding(10, 4, name="doc-mirror")
    >>> opt = dist.optim.SparseAdagrad([emb], lr=0.1)
    >>> emb(torch.tensor([1, 1])).sum().backward(); opt.step()
    >>> dist.optim.SparseAdam is __import__("distemb").SparseAdam
    True
"""
from distemb import context as _context
from distemb import embedding as _embedding
from distemb import partition as _partition
from distemb import tensor as _tensor
from distemb.dgl import optim
from distemb.integrations.dgl import convert_policy, dgl

__all__ = ["DistEmbedding", "DistTensor", "PartitionPolicy", "NodePartitionPolicy",
           "EdgePartitionPolicy", "initialize", "exit_client", "optim", "convert_policy"]


class DistEmbedding(_embedding.DistEmbedding):
    """:class:`distemb.DistEmbedding` that also takes DGL's ``part_policy`` objects.

    Example:
        >>> emb = DistEmbedding(10, 4, name="doc-mirror-emb")
    """

    def __init__(self, num_embeddings, embedding_dim, name=None, init_func=None,
                 part_policy=None, **kwargs):
        super().__init__(num_embeddings, embedding_dim, name=name, init_func=init_func,
                         part_policy=convert_policy(part_policy), **kwargs)


class DistTensor(_tensor.DistTensor):
    """:class:`distemb.DistTensor` with DGL's signature (``is_gdata`` accepted).

    ``is_gdata`` only says, in DGL, whether the tensor is registered as graph data; distemb
    keeps no graph, so it has no effect.

    Example:
        >>> import torch
        >>> t = DistTensor((4, 2), torch.float32, "doc-mirror-t")
    """

    def __init__(self, shape, dtype, name=None, init_func=None, part_policy=None,
                 persistent=False, is_gdata=True, **kwargs):
        super().__init__(shape, dtype, name=name, init_func=init_func,
                         part_policy=convert_policy(part_policy), persistent=persistent,
                         **kwargs)


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


def initialize(ip_config=None, **kwargs):
    """DGL's ``initialize(ip_config, ...)``: :func:`distemb.initialize`.

    distemb reads its cluster from ``$DISTEMB_CONFIG`` (set by ``distemb-launch``, which
    takes the same ip_config file), so ``ip_config`` and DGL's tuning options
    (``max_queue_size``, ``net_type``, ``num_worker_threads``) are not used. Under DGL's
    own launcher it raises, saying how to launch with distemb-launch.

    Returns:
        the :class:`~distemb.context.DistContext`.
    """
    return _context.initialize()


def exit_client():
    """DGL's ``exit_client()``: :func:`distemb.shutdown`."""
    _context.shutdown()


