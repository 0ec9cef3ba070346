"""DistContext: one explicit object holding the role, ranks, backend and KVStore client.

``initialize()`` builds the context of this process and makes it current; tables made
without ``context=`` use the current one, and ask for a default on first use, so
``DistEmbedding(n, d)`` works with no set-up, as with ``dgl.distributed``. The default is
embedded, unless ``distemb-launch`` started this process: then ``$DISTEMB_CONFIG`` names
the cluster config and ``$DISTEMB_RANK`` this trainer's rank, and the context is a
trainer's, with a :class:`~distemb.kvstore.remote.RemoteKVClient` to the servers. That
"current" slot is distemb's one piece of process-wide state: the drop-in API needs it.
Tests and libraries build their own contexts and pass them explicitly.

Example:
    >>> ctx = DistContext.embedded(backend="numpy")
    >>> ctx.role is Role.EMBEDDED, ctx.num_servers
    (True, 1)
    >>> ctx.close()
"""
import itertools
import os
import sys

from distemb.backend import load_backend
from distemb.config import (CacheConfig, check_device_cache, default_num_threads,
                            load_cluster_config, parse_cache_config)
from distemb.enums import Consistency, Role
from distemb.errors import DistEmbError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.trainer import CachedKVClient
from distemb.kvstore.remote import RemoteKVClient


class DistContext:
    """Everything a process needs to use distemb tables.

    Args:
        client: the :class:`~distemb.kvstore.KVClient` tables talk to.
        backend: a loaded backend or its name (default: $DISTEMB_BACKEND or 'pytorch').
        role: a :class:`~distemb.enums.Role` or its value ('embedded', 'trainer', 'server').
        rank: this trainer's rank; num_trainers: how many trainers share the store.
        num_threads: OpenMP threads for the trainer-side kernels (dedup).
    """

    def __init__(self, client, backend=None, role=Role.EMBEDDED, rank=0, num_trainers=1,
                 num_threads=None):
        self.client = client
        self.F = backend if hasattr(backend, "name") else load_backend(backend)
        self.role = Role.parse(role, "role", DistEmbError)
        self.rank, self.num_trainers = rank, num_trainers
        self.num_threads = num_threads or default_num_threads()
        self._names = itertools.count()
        self._device_clients = {}
        self._holders = {}  # (client, name) -> live tensor objects of it in this process
        self.closed = False

    @classmethod
    def embedded(cls, backend=None, num_threads=None, device_cache=None, cache_device="cuda"):
        """A context whose tables live in this process (the default).

        Args:
            device_cache: a :class:`~distemb.config.CacheConfig` or its mapping
                (``{"fraction": 0.05, "policy": "lfu"}``): keep each table's hot rows
                and their optimizer state on ``cache_device``, for ``emb(ids,
                device=cache_device)`` (:mod:`distemb.kvstore.caches.device`); None: off.
            cache_device: the CUDA device of that cache.

        Raises:
            ConfigError: ``device_cache`` is invalid (the message names the field).
            CudaUnavailableError: ``device_cache`` is given and ``cache_device`` cannot
                be used here (the message says why).
        """
        nt = num_threads or default_num_threads()
        wrap = (lambda c: c) if device_cache is None else \
            _device_cache(device_cache, cache_device, 1)
        return cls(wrap(LocalKVClient(num_threads=nt)), backend=backend, num_threads=nt)

    @classmethod
    def trainer(cls, config_path, rank, backend=None, num_threads=None, consistency=None):
        """A trainer's context, its tables held by the servers of ``config_path``.

        Raises:
            ConfigError: the cluster config is invalid.
            ServerUnavailableError: a server cannot be reached within the config's timeout.
        """
        cfg = load_cluster_config(config_path)
        nt = num_threads or default_num_threads()
        wrap = (lambda c: c) if cfg.device_cache is None else \
            _device_cache(cfg.device_cache, "cuda", cfg.num_trainers)
        client = RemoteKVClient(cfg, rank, num_threads=nt, consistency=consistency)
        if cfg.cache is not None:  # hot rows kept by this trainer (distemb.kvstore.caches.trainer)
            client = CachedKVClient(client, cfg.cache)
        return cls(wrap(client), backend=backend, role=Role.TRAINER, rank=rank,
                   num_trainers=cfg.num_trainers, num_threads=nt)

    @classmethod
    def collective(cls, backend=None, num_threads=None, timeout_s=60.0):
        """A rank of a torch.distributed job holding one shard of every table
        (:mod:`distemb.kvstore.collective`); no servers.

        Joins the default process group, or creates a gloo one from torchrun's
        environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

        Args:
            timeout_s: how long an exchange waits for the other ranks before it raises,
                naming the ranks that did not report.

        Raises:
            DistEmbError: no process group and no torchrun environment to make one.
        """
        # Imported here: it imports torch, which server processes must never load.
        from distemb.kvstore.collective import CollectiveKVClient
        from distemb.transport.collective import join_process_group

        made = join_process_group(timeout_s)
        nt = num_threads or default_num_threads()
        client = CollectiveKVClient(timeout_s=timeout_s, num_threads=nt, own_group=made)
        return cls(client, backend=backend, role=Role.COLLECTIVE, rank=client.rank,
                   num_trainers=client.world_size, num_threads=nt)

    @property
    def num_servers(self):
        return self.client.num_servers

    def client_for(self, device):
        """The KVClient of tables on ``device``: this context's client for host tables.

        For a CUDA device, one :class:`~distemb.kvstore.device.DeviceKVClient` per device,
        made on first use and closed with the context.

        Args:
            device: None or 'cpu' (host tables), or a CUDA device ('cuda', 'cuda:N', a
                ``torch.device``).

        Returns:
            The :class:`~distemb.kvstore.KVClient` holding such tables.

        Raises:
            DistEmbError: the context is closed (its clients with it: it makes no
                tables); a GPU-resident table in a context that is not embedded, or
                whose backend is not pytorch.
            ValueError: ``device`` is neither 'cpu' nor a CUDA device.
            CudaUnavailableError: the CUDA kernels cannot run here (it says why).
        """
        if self.closed:
            raise DistEmbError(f"context: {self!r} is closed: it makes no tables (a table "
                               "made there would never be released); make them on an open "
                               "context (DistContext.embedded(), or distemb.initialize())")
        if device is None or str(device) == "cpu":
            return self.client
        if self.role != Role.EMBEDDED:
            raise DistEmbError(f"device={device!r}: GPU-resident tables are embedded-only, "
                               f"but this context's role is '{self.role}' (its tables live "
                               "on the servers); create the table on the host and look rows "
                               "up with emb(ids, device=...)")
        if self.F.name != "pytorch":
            raise DistEmbError(f"device={device!r}: GPU-resident tables need the pytorch "
                               f"backend, this context's is {self.F.name!r}")
        # Imported here, not at the top: this module is imported by server processes,
        # which must never import torch (tests/test_backend.py); device.py imports it.
        from distemb.kvstore import device as device_kv

        dev = device_kv.cuda_device(device)
        if dev not in self._device_clients:
            self._device_clients[dev] = device_kv.DeviceKVClient(dev)
        return self._device_clients[dev]

    def hold(self, client, name, delete_with_last=False):
        """Count one more live object of table ``name`` of ``client`` in this process.

        Args:
            delete_with_last: given by the object that created the table: delete it once
                the last object of it in this process is gone (DGL's non-persistent rule).
        """
        key = (id(client), name)
        count, delete = self._holders.get(key, (0, False))
        self._holders[key] = (count + 1, delete or delete_with_last)

    def release(self, client, name):
        """One object of ``name`` is gone; True when the table is now to be deleted."""
        key = (id(client), name)
        count, delete = self._holders.pop(key, (1, False))
        if count > 1:
            self._holders[key] = (count - 1, delete)
            return False
        return delete

    def new_name(self, prefix):
        """A name no other anonymous tensor of this context has."""
        return f"{prefix}-{next(self._names)}"

    def close(self):
        """Release the clients (and, embedded, every table)."""
        if not self.closed:
            self.client.close()
            for client in self._device_clients.values():
                client.close()
            self.closed = True

    def __repr__(self):
        return (f"DistContext(role={self.role.value!r}, rank={self.rank}, "
                f"backend={self.F.name!r}, servers={self.num_servers})")


def _device_cache(config, device, num_trainers):
    """A function putting a client behind a GPU cache, checked before any client exists.

    Raises:
        ConfigError: ``config`` is invalid, or not exact, or ``num_trainers`` > 1.
        CudaUnavailableError: ``device`` cannot be used here.
    """
    # Imported here: the device cache imports torch, which server processes (that import
    # this module) must never load.
    from distemb.kvstore import device as device_kv
    from distemb.kvstore.caches.device import DeviceCachedKVClient

    if not isinstance(config, CacheConfig):
        config = parse_cache_config(config, "device_cache")
    check_device_cache(config, num_trainers)
    dev = device_kv.cuda_device(device)
    return lambda client: DeviceCachedKVClient(client, config, dev)


_current = []  # the process's current context (see module docstring); at most one entry


def _env_rank():
    value = os.environ.get("DISTEMB_RANK", "0")
    if not value.isdigit():
        raise DistEmbError(f"DISTEMB_RANK: expected a non-negative integer, got {value!r}")
    return int(value)


# Set by DGL's launcher (tools/launch.py) for every server and trainer of a job.
DGL_JOB_VARS = ("DGL_ROLE", "DGL_IP_CONFIG", "DGL_NUM_SERVER", "DGL_NUM_CLIENT",
                "DGL_CONF_PATH", "DGL_SERVER_ID")


def one_of_many():
    """Why this process is one of several of a job, or None when nothing says so.

    Looks at DGL's launcher variables, ``DGL_DIST_MODE=distributed``, ``WORLD_SIZE`` > 1
    (torchrun, distemb-launch, mpirun wrappers) and an initialized torch.distributed
    group of more than one process. torch is only looked at if it is already imported:
    a process that never imported it has no process group (and servers never import it).
    """
    found = [v for v in DGL_JOB_VARS if os.environ.get(v)]
    if os.environ.get("DGL_DIST_MODE") == "distributed":
        found.append("DGL_DIST_MODE=distributed")
    if found:
        return f"DGL's launcher environment ({', '.join(found)})"
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        return f"WORLD_SIZE={world}"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        return f"an initialized torch.distributed group of {dist.get_world_size()} processes"
    return None


def _from_env(backend=None, num_threads=None, consistency=None, device_cache=None):
    """A trainer context when $DISTEMB_CONFIG is set, else an embedded one.

    Raises:
        DistEmbError: $DISTEMB_CONFIG is unset but this process is one of several (see
            :func:`one_of_many`): an embedded table would be private to it, so every
            trainer would silently train its own copy.
    """
    path = os.environ.get("DISTEMB_CONFIG")
    if consistency is not None:
        consistency = Consistency.parse(consistency, "consistency")
    if not path:
        why = one_of_many()
        if why is not None:
            raise DistEmbError(
                f"this process is one of several ({why}) but $DISTEMB_CONFIG is not set, so "
                "its distemb tables would be private to it and each trainer would train its "
                "own copy. Start the job with distemb-launch, which starts distemb's "
                "servers and sets $DISTEMB_CONFIG/$DISTEMB_RANK for every trainer, e.g. "
                "`distemb-launch --ip-config ip.txt --num-servers 1 --num-trainers 2 -- "
                "python train.py` (it also sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE for "
                "torch.distributed); under torchrun, without servers, call "
                "distemb.initialize(mode='collective') (every rank holds a shard of every "
                "table); to join a running distemb cluster set "
                "DISTEMB_CONFIG=<its cluster.json> and DISTEMB_RANK=<trainer rank>. For a "
                "deliberately private table pass context=distemb.DistContext.embedded().")
        if consistency not in (None, Consistency.SYNC):
            raise DistEmbError(f"consistency='{consistency}': only meaningful for a trainer "
                               "of a cluster ($DISTEMB_CONFIG is not set)")
        return DistContext.embedded(backend=backend, num_threads=num_threads,
                                    device_cache=device_cache)
    if device_cache is not None:
        raise DistEmbError("device_cache: a trainer of a cluster takes its device cache "
                           f"from the cluster config ({path}: 'device_cache'), got "
                           f"{device_cache!r} here")
    role = os.environ.get("DISTEMB_ROLE", Role.TRAINER.value)
    if role != Role.TRAINER:
        raise DistEmbError(f"DISTEMB_ROLE: initialize() makes trainer contexts, got {role!r} "
                           "(servers run 'python -m distemb.server')")
    return DistContext.trainer(path, _env_rank(), backend, num_threads, consistency)


def initialize(backend=None, num_threads=None, consistency=None, device_cache=None,
               mode=None, timeout_s=60.0):
    """Create this process's context and make it current.

    Embedded unless ``$DISTEMB_CONFIG`` names a cluster config (``distemb-launch`` sets
    it, with ``$DISTEMB_RANK``): then a trainer context joining that cluster's servers.
    Never a silent private table in a process that is one of several: under DGL's
    launcher, with ``WORLD_SIZE`` > 1 or in a torch.distributed group of several
    processes, without ``$DISTEMB_CONFIG`` it raises, saying how to launch.

    Args:
        backend: backend name (default: $DISTEMB_BACKEND or 'pytorch').
        num_threads: kernel threads (default: $DISTEMB_NUM_THREADS or the usable cores).
        consistency: a :class:`~distemb.enums.Consistency` or its value: 'sync'
            (``step()`` returns once every server applied the update), 'sync_exact' (the
            servers sum all trainers' pushes of a step and apply them once) or 'async'
            (no wait; see docs). Default: the cluster config's.
        device_cache: embedded only: a GPU cache of each table's hot rows for
            ``emb(ids, device="cuda")`` (see :meth:`DistContext.embedded`); a cluster's
            trainers take it from the cluster config's ``device_cache``.
        mode: None (embedded, or a trainer under distemb-launch, as above) or
            ``'collective'``: this process is one rank of a torch.distributed job
            (torchrun) and holds one shard of every table, no servers
            (:meth:`DistContext.collective`; every step is exact).
        timeout_s: collective mode: seconds an exchange waits for the other ranks.

    Returns:
        the new :class:`DistContext`.

    Raises:
        ConfigError: ``consistency`` is not one of the modes, or ``device_cache`` is
            invalid.
        KVStoreError: collective mode: the ranks could not build their group.
        CudaUnavailableError: ``device_cache`` is given but no GPU can be used here.
        DistEmbError: already initialized, a non-sync mode without a cluster, or one of
            several processes without ``$DISTEMB_CONFIG`` (the message says how to launch
            or join).
    """
    if _current and not _current[0].closed:
        how = ("by an earlier initialize()" if not getattr(_current[0], "implicit", False)
               else "implicitly, by a table created before initialize()")
        raise DistEmbError(f"initialize(): distemb is already initialized in this process "
                           f"({how}); call initialize() before creating tables, or "
                           "distemb.shutdown() first")
    if mode not in (None, "collective"):
        raise DistEmbError(f"mode: expected None or 'collective', got {mode!r}")
    if mode == "collective":
        if device_cache is not None or consistency not in (None, "sync_exact"):
            raise DistEmbError("mode='collective': no device_cache yet, and every step is "
                               f"exact (consistency {consistency!r} is not available)")
        ctx = DistContext.collective(backend, num_threads, timeout_s)
    else:
        ctx = _from_env(backend, num_threads, consistency, device_cache)
    _current[:] = [ctx]
    return ctx


def current_context():
    """The current context; made on first use (a trainer's under distemb-launch)."""
    if not _current or _current[0].closed:
        ctx = _from_env()
        ctx.implicit = True
        _current[:] = [ctx]
    return _current[0]


def shutdown():
    """Close the current context (tables made in it become unusable)."""
    if _current:
        _current.pop().close()
