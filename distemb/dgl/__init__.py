"""``import distemb.dgl as dist``, or ``distemb.dgl.patch()``: DGL's distributed API on distemb.

Two ways in, same classes:

- an import swap: ``import dgl.distributed as dist`` becomes ``import distemb.dgl as
  dist`` (``dist.optim.SparseAdam`` by module path included);
- one added line, ``distemb.dgl.patch()``, before the script imports from
  ``dgl.distributed`` (or ``python -m distemb.dgl.patch script.py``): DGL's own module
  paths then give distemb's ``DistEmbedding``, ``DistTensor`` and optimizers, and a job
  started by DGL's launcher gets distemb's servers (:mod:`distemb.dgl.patch`,
  :mod:`distemb.dgl.job`). :func:`unpatch` restores DGL.

Every other name of ``dgl.distributed`` (``DistGraph``, ``node_split``, ``edge_split``,
``DistDataLoader``, ``DistNodeDataLoader``, ``partition_graph``, ``load_partition``, ...)
is DGL's own, reached through this package, so a DGL script's ``dist.X`` works after the
import swap whatever ``X`` it uses. DGL's partition policies and books are converted to
distemb's. Tables follow DGL's lifetime rule (deleted with their last object unless
``persistent=True``) and torch's maths (duplicate ids sum their gradients; DGL averages).
Importing this package imports DGL (``pip install 'distemb[dgl]'``: an error says so when
DGL is missing).

Example:
    >>> import torch
    >>> import distemb.dgl as dist
    >>> emb = dist.DistEmbedding(10, 4, name="doc-mirror")
    >>> opt = dist.optim.SparseAdagrad([emb], lr=0.1)
    >>> emb(torch.tensor([1, 1])).sum().backward(); opt.step()
    >>> dist.optim.SparseAdam is __import__("distemb").SparseAdam
    True
    >>> dist.node_split is __import__("dgl").distributed.node_split  # DGL's own
    True
"""
from distemb import context as _context
from distemb.dgl import dgl2, job, optim
from distemb.dgl.patch import dgl_own, is_patched, patch, unpatch
from distemb.dgl.tables import (DistEmbedding, DistTensor, EdgePartitionPolicy,
                                NodePartitionPolicy, PartitionPolicy, convert_policy,
                                dgl_policy_for)
from distemb.integrations.dgl import dgl as _dgl

__all__ = ["DistEmbedding", "DistTensor", "PartitionPolicy", "NodePartitionPolicy",
           "EdgePartitionPolicy", "initialize", "exit_client", "optim", "convert_policy",
           "dgl_policy_for", "patch", "unpatch", "is_patched", "job", "dgl2"]


def initialize(ip_config=None, mode=None, **kwargs):
    """DGL's ``initialize(ip_config, ...)``, then distemb's context for this process.

    DGL's own ``dgl.distributed.initialize`` runs first (a server-role process of DGL's
    launcher serves there and never returns; a trainer connects to DGL's servers); then
    :func:`distemb.dgl.job.join_trainer`: embedded tables in DGL's standalone mode, the
    job's distemb servers in distributed mode (``$DISTEMB_JOB_TOKEN`` required).

    ``mode="collective"`` (a distemb extension: the one line a DGL-style script changes
    to run under ``torchrun``): no servers, DGL's or distemb's; this process is one rank
    of the torch.distributed job and holds a shard of every table
    (:func:`distemb.initialize` with ``mode="collective"``; ``timeout_s`` is its one
    keyword). DGL's ``DistGraph`` needs DGL's servers, so it is not available then.

    DGL 2.x's ``use_graphbolt=False`` is accepted (and dropped); ``True`` is refused:
    there is no GraphBolt here (:mod:`distemb.dgl.dgl2`).

    Returns:
        the :class:`~distemb.context.DistContext`.

    Raises:
        DistEmbError: ``mode`` is neither None nor ``"collective"``, the collective job
            cannot start (see :func:`distemb.initialize`), or ``use_graphbolt=True``.
    """
    kwargs = dgl2.without_graphbolt(kwargs, "initialize")
    if mode is not None:
        return _context.initialize(mode=mode, **kwargs)
    dgl_own(_dgl.distributed, "initialize")(ip_config, **kwargs)
    return job.join_trainer(ip_config)


def exit_client():
    """DGL's ``exit_client()``: leave distemb's job, then DGL's."""
    job.leave()
    dgl_own(_dgl.distributed, "exit_client")()


def __getattr__(name):
    """DGL's ``dgl.distributed.<name>`` for a name distemb does not define itself.

    Raises:
        AttributeError: neither distemb.dgl nor dgl.distributed has ``name``.
    """
    try:
        return getattr(_dgl.distributed, name)
    except AttributeError:
        raise AttributeError(f"module 'distemb.dgl' has no attribute {name!r}, nor has "
                             f"dgl.distributed") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_dgl.distributed)))
