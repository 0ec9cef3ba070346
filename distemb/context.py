"""DistContext: one explicit object holding the role, ranks, backend and KVStore client.

``initialize()`` builds the context of this process and makes it current; tables made
without ``context=`` use the current one, and ask for an embedded default on first use,
so ``DistEmbedding(n, d)`` works with no set-up, as with ``dgl.distributed``. That
"current" slot is distemb's one piece of process-wide state: the drop-in API needs it.
Tests and libraries build their own contexts and pass them explicitly.

Example:
    >>> ctx = DistContext.embedded(backend="numpy")
    >>> ctx.role, ctx.num_servers
    ('embedded', 1)
    >>> ctx.close()
"""
import itertools
import os

from distemb.backend import load_backend
from distemb.errors import DistEmbError
from distemb.kvstore import LocalKVClient


def default_num_threads():
    """OpenMP threads of the kernels: $DISTEMB_NUM_THREADS, else the usable cores."""
    value = os.environ.get("DISTEMB_NUM_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise DistEmbError(f"DISTEMB_NUM_THREADS: expected a positive integer, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0))


class DistContext:
    """Everything a process needs to use distemb tables.

    Args:
        client: the :class:`~distemb.kvstore.KVClient` tables talk to.
        backend: a loaded backend or its name (default: $DISTEMB_BACKEND or 'pytorch').
        role: 'embedded', 'trainer' or 'server'.
        rank: this trainer's rank; num_trainers: how many trainers share the store.
        num_threads: OpenMP threads for the trainer-side kernels (dedup).
    """

    def __init__(self, client, backend=None, role="embedded", rank=0, num_trainers=1,
                 num_threads=None):
        self.client = client
        self.F = backend if hasattr(backend, "name") else load_backend(backend)
        self.role, self.rank, self.num_trainers = role, rank, num_trainers
        self.num_threads = num_threads or default_num_threads()
        self._names = itertools.count()
        self.closed = False

    @classmethod
    def embedded(cls, backend=None, num_threads=None):
        """A context whose tables live in this process (the default)."""
        nt = num_threads or default_num_threads()
        return cls(LocalKVClient(num_threads=nt), backend=backend, num_threads=nt)

    @property
    def num_servers(self):
        return self.client.num_servers

    def new_name(self, prefix):
        """A name no other anonymous tensor of this context has."""
        return f"{prefix}-{next(self._names)}"

    def close(self):
        """Release the client (and, embedded, every table)."""
        if not self.closed:
            self.client.close()
            self.closed = True

    def __repr__(self):
        return (f"DistContext(role={self.role!r}, rank={self.rank}, "
                f"backend={self.F.name!r}, servers={self.num_servers})")


_current = []  # the process's current context (see module docstring); at most one entry


def initialize(backend=None, num_threads=None):
    """Create this process's context and make it current.

    Embedded unless a cluster config names servers to join (see ``distemb-launch``).

    Returns:
        the new :class:`DistContext`.
    """
    if _current and not _current[0].closed:
        raise DistEmbError("initialize(): distemb is already initialized in this process; "
                           "call distemb.shutdown() first")
    ctx = DistContext.embedded(backend=backend, num_threads=num_threads)
    _current[:] = [ctx]
    return ctx


def current_context():
    """The current context; an embedded one is created on first use."""
    if not _current or _current[0].closed:
        _current[:] = [DistContext.embedded()]
    return _current[0]


def shutdown():
    """Close the current context (tables made in it become unusable)."""
    if _current:
        _current.pop().close()
