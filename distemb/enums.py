"""Closed sets of choices (a leaf module): consistency, role, transport, partition kind,
book, eviction policy, rounding, cache policy, bag mode.

Every member is a ``str`` equal to, hashing and formatting as its value, so JSON, the
CLI, environment variables and dict keys see the plain string (``"sync"``) while code
names the member (``Consistency.SYNC``). Strings become members through
:meth:`Choice.parse`, whose error names the field, the value and the choices.

Example:
    >>> Consistency.parse("async", "consistency") is Consistency.ASYNC
    True
    >>> Consistency.SYNC == "sync", f"{Role.TRAINER}", Book.values()
    (True, 'trainer', ['range', 'hash'])
    >>> Transport.parse("udp", "transport")
    Traceback (most recent call last):
    ...
    distemb.errors.ConfigError: transport: must be one of ['tcp', 'mpi'], got 'udp'
"""
from enum import Enum

from distemb.errors import ConfigError


class Choice(str, Enum):
    """Base of distemb's Enums: a member is the string of its value everywhere."""

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    @classmethod
    def values(cls):
        """The string values, in declaration order (for CLI ``choices`` and messages)."""
        return [m.value for m in cls]

    @classmethod
    def parse(cls, value, path, error=ConfigError):
        """The member whose value is ``value`` (a member is returned as is).

        Args:
            value: a member or its string value.
            path: the field or argument the value came from, for the message.
            error: the exception type to raise (a ValueError or DistEmbError subclass).

        Raises:
            error: ``path: must be one of [...], got value``.
        """
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise error(f"{path}: must be one of {cls.values()}, got {value!r}") from None


class Consistency(Choice):
    """When a trainer's ``step()`` returns relative to the servers applying its update."""

    # step() returns once every server applied this trainer's update: the next pull sees it.
    SYNC = "sync"
    # The servers sum every trainer's push of the same step and apply the sum once, then
    # answer: T trainers on 1/T of a batch each equal one trainer on the whole batch.
    SYNC_EXACT = "sync_exact"
    # Pushes do not wait for an answer; reads may miss updates still in flight.
    ASYNC = "async"


class Role(Choice):
    """What a process is in a distemb job."""

    # Tables live in this process (the default, no servers).
    EMBEDDED = "embedded"
    # Tables live on the job's servers; this process pulls rows and pushes updates.
    TRAINER = "trainer"
    # A KVStore server process (python -m distemb.server): owns shards, applies updates.
    SERVER = "server"
    # One rank of a torch.distributed job holding a shard of every table (no servers).
    COLLECTIVE = "collective"


class Transport(Choice):
    """How trainers and servers exchange messages."""

    # TCP sockets, one connection per (trainer, server): the default, works anywhere.
    TCP = "tcp"
    # MPI point-to-point messages (mpi4py); only inside an mpirun job.
    MPI = "mpi"


class PartitionKind(Choice):
    """Whether a partition policy splits the ids of a node type or of an edge type."""

    # Ids of a node type ('_N' when the graph is untyped).
    NODE = "node"
    # Ids of an edge type ('_E' when untyped; DGL's canonical types as 'src:rel:dst').
    EDGE = "edge"


class Book(Choice):
    """How a partition book maps the ids of one type to partitions."""

    # Contiguous id ranges, one per partition (what dgl.distributed.partition_graph writes).
    RANGE = "range"
    # Id i lives in partition i % num_partitions at local id i // num_partitions.
    HASH = "hash"


class EvictPolicy(Choice):
    """Which keys a hash store's eviction removes first (TFRA's restrict policies)."""

    # Least recently used: the keys whose last lookup batch is the oldest.
    LRU = "lru"
    # Least frequently used: the keys looked up in the fewest batches (ties: least recent).
    LFU = "lfu"


class Rounding(Choice):
    """How an update stores a float32 result into half-precision rows."""

    # To the nearest representable value, ties to even (IEEE's default; deterministic).
    NEAREST = "nearest"
    # Up or down at random, with probability by distance (unbiased, so updates below half
    # an ulp survive in expectation); bfloat16 only, reproducible by seed.
    STOCHASTIC = "stochastic"


class CachePolicy(Choice):
    """Which rows a trainer cache evicts (distemb.kvstore.caches.trainer)."""

    # Keeps every row it fetches; evicts the least recently used.
    LRU = "lru"
    # Counts recent pulls of every row; keeps a new row only in a free slot or in place of
    # a row pulled less often (TinyLFU admission), evicting the least often pulled.
    LFU = "lfu"


class BagMode(Choice):
    """How a bag of looked-up rows is reduced to one row (``emb.bag``, as
    ``torch.nn.EmbeddingBag``'s ``mode``)."""

    # The rows summed, each times its per-sample weight when weights are given.
    SUM = "sum"
    # The rows' mean (an empty bag: zeros); padding entries count for nothing.
    MEAN = "mean"
    # The elementwise maximum; a tie goes to the bag's first row holding it, as torch's.
    MAX = "max"
