"""DGL 2.x's edges on DGL 1.1.3: what DGL 2.2-2.4 scripts and tests call that 1.1.3 lacks.

DGL 2.x is DGL 1.1.3's distributed API plus GraphBolt (its new sampler, whose compiled
libraries are built per torch version and do not load on the torch this project pins).
Its scripts differ from 1.1.3's at a few edges, which :func:`distemb.dgl.patch` (and
``distemb.dgl.initialize``) take as DGL 2.x does:

- ``use_graphbolt=`` of ``dgl.distributed.initialize``, ``DistGraphServer`` and
  ``partition_graph``: ``False`` (DGL's own partitions and sampler, 2.x's default) is
  accepted and dropped; ``True`` is refused, saying why (no GraphBolt here);
- ``import dgl.graphbolt``: a module that names why any use of it fails, so files that
  import it only for their GraphBolt cases load;
- ``dgl.distributed.DistNodeDataLoader`` / ``DistEdgeDataLoader`` (2.x's paths of 1.1.3's
  ``dgl.dataloading`` loaders);
- a trainer under ``torchrun`` (2.x's launcher) takes its rank from ``RANK`` /
  ``WORLD_SIZE``, as :func:`distemb.dgl.job.join_trainer` does for 1.1.3's launcher; a
  default process group (gloo or NCCL) that the script makes is the script's: distemb's
  servers and exchanges never use it.

Example:
    >>> from distemb.dgl.dgl2 import without_graphbolt
    >>> without_graphbolt({"use_graphbolt": False, "net_type": "socket"}, "initialize")
    {'net_type': 'socket'}
"""
import types

from distemb.errors import DistEmbError

__all__ = ["without_graphbolt", "accepts_graphbolt_false", "NoGraphBolt"]

WHY = ("GraphBolt is DGL 2.x's sampler; its compiled libraries are built for each torch "
       "version and none loads on the torch this project pins, so distemb runs on DGL "
       "1.1.3, which has no GraphBolt")


def without_graphbolt(kwargs: dict, where: str) -> dict:
    """``kwargs`` less DGL 2.x's ``use_graphbolt`` (False: DGL's own partitions).

    Raises:
        DistEmbError: ``use_graphbolt`` is true.
    """
    kwargs = dict(kwargs)
    if kwargs.pop("use_graphbolt", False):
        raise DistEmbError(f"{where}: use_graphbolt=True asks for GraphBolt partitions; "
                           f"{WHY}. Partition with use_graphbolt=False (DGL's own "
                           "partitions, DGL 2.x's default) and pass use_graphbolt=False")
    return kwargs


def accepts_graphbolt_false(original, where: str):
    """``original`` (a DGL 1.1.3 function) taking DGL 2.x's ``use_graphbolt=False``."""
    def call(*args, **kwargs):
        return original(*args, **without_graphbolt(kwargs, where))
    call.__name__ = getattr(original, "__name__", "call")
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original
    return call


class NoGraphBolt(types.ModuleType):
    """``dgl.graphbolt`` under the patch: importing it works, using it says why not."""

    def __init__(self):
        super().__init__("dgl.graphbolt", f"DGL 2.x's GraphBolt, absent: {WHY}.")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise DistEmbError(f"dgl.graphbolt.{name}: {WHY}; use DGL's own partitions and "
                           "samplers (use_graphbolt=False)")
