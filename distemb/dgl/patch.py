"""``distemb.dgl.patch()``: code that calls ``dgl.distributed`` by module path gets distemb's.

After :func:`patch`, these names of DGL 1.1.3 are distemb's, wherever DGL exports them:
``DistEmbedding``, ``DistTensor``, ``optim.SparseAdagrad``, ``optim.SparseAdam`` (so a
script that writes ``dgl.distributed.DistTensor(...)`` or ``from dgl.distributed.optim
import SparseAdam`` after the patch runs on distemb, with DGL's ``DistGraph``, samplers
and partition books as they are), and:

- ``dgl.distributed.initialize`` runs DGL's, then joins distemb's job
  (:func:`distemb.dgl.job.join_trainer`); ``exit_client`` leaves it, then runs DGL's;
- ``DistGraphServer.start`` also runs distemb's server beside DGL's
  (:class:`distemb.dgl.job.ServerBeside`);
- DGL 2.x's edges (:mod:`distemb.dgl.dgl2`): ``use_graphbolt=False`` accepted by
  ``initialize``, ``DistGraphServer`` and ``partition_graph`` (``True`` refused, saying
  why), ``import dgl.graphbolt`` loads (any use of it says why not), and
  ``dgl.distributed.DistNodeDataLoader`` / ``DistEdgeDataLoader`` exist;
- the processes this one starts inherit a job token made for them when none is set
  (:func:`distemb.dgl.job.make_token_for_children`): servers and trainers started from
  one parent, as DGL's tests start them, need no variable set by hand. Processes
  started separately, as DGL's launcher starts them, still need the token given.

DGL's own graph data (``DistGraph.ndata``, made inside DGL) stays DGL's. A ``from
dgl.distributed import DistEmbedding`` executed *before* :func:`patch` keeps DGL's class:
patch first (one line at the top of a script), or run the script with ``python -m
distemb.dgl.patch script.py args...``. :func:`unpatch` puts every name back.

Example:
    >>> import dgl.distributed
    >>> from distemb.dgl.patch import patch, unpatch
    >>> patch()
    >>> dgl.distributed.DistEmbedding.__module__
    'distemb.dgl.tables'
    >>> unpatch()
    >>> dgl.distributed.DistEmbedding.__module__
    'dgl.distributed.nn.pytorch.sparse_emb'
"""
import functools
import os
import runpy
import sys

from distemb.dgl import dgl2, job, optim, tables
from distemb.integrations.dgl import dgl

__all__ = ["patch", "unpatch", "is_patched", "dgl_own", "main"]

_dist = dgl.distributed


def _initialize(original):
    @functools.wraps(original)
    def initialize(ip_config, *args, **kwargs):
        kwargs = dgl2.without_graphbolt(kwargs, "dgl.distributed.initialize")
        if job.is_distributed() or os.environ.get("DGL_ROLE") == "server":
            job.job_token()  # refuse before DGL's server waits for clients or vice versa
        out = original(ip_config, *args, **kwargs)  # a server-role process never returns
        job.join_trainer(ip_config)
        return out
    return initialize


def _exit_client(original):
    @functools.wraps(original)
    def exit_client(*args, **kwargs):
        job.leave()
        return original(*args, **kwargs)
    return exit_client


def _server_start(original):
    @functools.wraps(original)
    def start(self, *args, **kwargs):
        beside = job.ServerBeside(self.server_id, self.ip_config, self.num_servers,
                                  self.num_clients)
        try:
            out = original(self, *args, **kwargs)
        finally:
            code = beside.wait()
        if code != 0:
            raise job.DistEmbError(
                f"distemb server {beside.server_id} (pid {beside.process.pid}, port "
                f"{beside.port}) exited with {code} (its error is above; a port another "
                f"process holds: ${job.PORT_OFFSET_VAR} moves distemb's ports from DGL's "
                f"port + {job.DEFAULT_PORT_OFFSET})")
        return out
    return start


def _graphbolt_false(where):
    return lambda original: dgl2.accepts_graphbolt_false(original, where)


def _targets():
    """(object, attribute, replacement, whether it wraps DGL's original) of everything
    patch() replaces or adds (DGL 2.x's names that 1.1.3 lacks: :mod:`distemb.dgl.dgl2`)."""
    emb, opt = tables.DistEmbedding, optim
    loading = dgl.dataloading
    return [
        (_dist, "DistEmbedding", emb, False), (_dist.nn, "DistEmbedding", emb, False),
        (_dist.nn.pytorch, "DistEmbedding", emb, False),
        (_dist.nn.pytorch.sparse_emb, "DistEmbedding", emb, False),
        (_dist, "DistTensor", tables.DistTensor, False),
        (_dist.optim, "SparseAdagrad", opt.SparseAdagrad, False),
        (_dist.optim, "SparseAdam", opt.SparseAdam, False),
        (_dist.optim.pytorch, "SparseAdagrad", opt.SparseAdagrad, False),
        (_dist.optim.pytorch, "SparseAdam", opt.SparseAdam, False),
        (_dist.optim.pytorch.sparse_optim, "SparseAdagrad", opt.SparseAdagrad, False),
        (_dist.optim.pytorch.sparse_optim, "SparseAdam", opt.SparseAdam, False),
        (_dist, "initialize", _initialize, True),
        (_dist.dist_context, "initialize", _initialize, True),
        (_dist, "exit_client", _exit_client, True),
        (_dist.DistGraphServer, "start", _server_start, True),
        # DGL 2.x's edges
        (_dist.DistGraphServer, "__init__", _graphbolt_false("DistGraphServer"), True),
        (_dist, "partition_graph", _graphbolt_false("partition_graph"), True),
        (_dist.partition, "partition_graph", _graphbolt_false("partition_graph"), True),
        (_dist, "DistNodeDataLoader", loading.DistNodeDataLoader, False),
        (_dist, "DistEdgeDataLoader", loading.DistEdgeDataLoader, False),
        (dgl, "graphbolt", dgl2.NoGraphBolt(), False),
    ]


# What patch() replaced, to put back: (object, attribute) -> DGL's original (_ABSENT for a
# name patch() added). This, the replaced attributes and the dgl.graphbolt entry of
# sys.modules are the patch's only state; all go with unpatch().
_originals = {}
_ABSENT = object()


def dgl_own(obj, attr):
    """DGL's own ``obj.attr``, patched or not (e.g. ``dgl_own(dgl.distributed, "initialize")``)."""
    own = _originals.get((obj, attr), getattr(obj, attr, _ABSENT))
    if own is _ABSENT:
        raise AttributeError(f"DGL 1.1.3 has no {attr!r} of its own")
    return own


def is_patched():
    """True between :func:`patch` and :func:`unpatch`."""
    return bool(_originals)


def patch():
    """Make ``dgl.distributed``'s tables, optimizers and job set-up distemb's (idempotent).

    Example:
        >>> import dgl.distributed, distemb.dgl
        >>> distemb.dgl.patch()
        >>> dgl.distributed.optim.SparseAdam is distemb.SparseAdam
        True
        >>> distemb.dgl.unpatch()
    """
    if _originals:
        return
    job.make_token_for_children()
    for obj, attr, new, wraps in _targets():
        original = obj.__dict__.get(attr, _ABSENT) if isinstance(obj, type) else \
            getattr(obj, attr, _ABSENT)
        if original is not _ABSENT and not wraps and attr in ("DistNodeDataLoader",
                                                               "DistEdgeDataLoader"):
            continue  # a DGL that has 2.x's name already
        _originals[(obj, attr)] = original
        setattr(obj, attr, new(original) if wraps else new)
    sys.modules.setdefault("dgl.graphbolt", dgl.graphbolt)


def unpatch():
    """Put DGL's own names back (a no-op when not patched)."""
    for (obj, attr), original in _originals.items():
        if original is _ABSENT:
            delattr(obj, attr)
        else:
            setattr(obj, attr, original)
    if isinstance(sys.modules.get("dgl.graphbolt"), dgl2.NoGraphBolt):
        del sys.modules["dgl.graphbolt"]
    _originals.clear()


def main(argv=None):
    """``python -m distemb.dgl.patch script.py args...``: run a DGL script, patched."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m distemb.dgl.patch script.py [args...]\n\n"
              "Runs script.py with dgl.distributed's DistEmbedding, DistTensor and optim "
              "replaced by distemb's (see distemb.dgl.patch).", file=sys.stderr)
        return 0 if argv else 2
    patch()
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script.py`
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    # Run the copy of this module that everyone else imports (``distemb.dgl.patch``, which
    # importing the package loaded already), not this ``__main__`` one, so that unpatch()
    # and is_patched() see the same record.
    sys.exit(sys.modules["distemb.dgl.patch"].main())
