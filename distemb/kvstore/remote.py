"""RemoteKVClient: the KVClient of a trainer whose tables live in server processes.

Partition ``p`` of an array table belongs to server ``p % num_servers``; a keyed table
has a store on every server, its keys placed by its router
(:mod:`distemb.kvstore.remote_keyed`). Reads, writes, updates and checkpoints take one
path for both: each request is split by owning server (``_route``) and sent to all of
them before any reply is read, so servers work
concurrently; an update costs one round trip per server per step (the optimizer has
already deduplicated and coalesced the rows). With shared memory on, a server on this
trainer's machine is spoken to over its local (Unix-domain) socket, which hands over
shared memory as file descriptors (:mod:`distemb.transport.shm`): rows of its shards are
gathered straight from their memory files (no round trip); writes still go to the owning
server, the only writer of its rows, but their arrays travel through this trainer's
request slot (:class:`~distemb.transport.slots.RequestSlot`): the frame on the socket
only says where they lie (:mod:`distemb.kvstore.remote_shm`). Such a server answers an
update before it applies it (:mod:`distemb.kvstore.early`).

``init_data`` and ``init_optimizer`` are collective, as in DGL: every trainer calls them
in the same order (DistEmbedding/optimizer construction does), the first creator's
initial values win, and they return once every trainer has the table.

Example (servers started by ``distemb-launch``)::

    client = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    client.init_data("emb", (1000, 16), "float32", range_policy(1000, client.num_servers))
    rows = client.pull("emb", np.arange(10))
"""

import numpy as np

from distemb.kernels import half
from distemb.enums import Consistency
from distemb.errors import (KVStoreError, MissingKeyError, PartitionError, StoreError,
                            TransportError)
from distemb.kvstore import snapshot
from distemb.kvstore.types import (DataMeta, KVClient, check_entry_rows, check_new_name,
                                   check_rounding)
from distemb.kvstore.early import Applying
from distemb.kvstore.local import init_shard
from distemb.kvstore.remote_versions import HeldReplies, VersionedPulls
from distemb.kvstore.remote_keyed import IO_TIMEOUT_S, RemoteKeyedTables
from distemb.kvstore.remote_routes import Route, Routing, take_rows
from distemb.kvstore.remote_shm import SharedMemoryPaths
from distemb.rules import rule_of, state_name
from distemb.transport.connections import open_connections
from distemb.transport.base import FLAG_NO_REPLY, close_fds
from distemb.transport.messages import (Barrier, Bye, Create, Drop, Hello, Load, OptInit,
                                        Pull, Push, Reply, Save, Service, Update)
from distemb.transport.slots import RequestSlot

INIT_CHUNK_BYTES = 64 << 20
#: Error kinds a server reports that reach the user as their own type (else KVStoreError).
ERRORS = {"PartitionError": PartitionError, "StoreError": StoreError,
          "MissingKeyError": MissingKeyError}


class RemoteKVClient(SharedMemoryPaths, RemoteKeyedTables, VersionedPulls, Routing,
                     KVClient):
    """KVClient over a cluster of KVStore servers.

    Array tables (``init_data``) are partitioned by their policy; keyed tables
    (``create_table``) are a row store per server, keys routed by the table's router
    (:mod:`distemb.kvstore.remote_keyed`).

    Args:
        cfg: the job's :class:`~distemb.config.ClusterConfig`.
        rank: this trainer's rank (0..num_trainers-1).
        consistency: a :class:`~distemb.enums.Consistency` or its value (default:
            ``cfg.consistency``); all trainers of a job must use the same.
        connections: one :class:`~distemb.transport.base.Connection` per server (default:
            :func:`~distemb.transport.connections.open_connections`).
        num_threads: OpenMP threads of shared-memory gathers.

    Raises:
        ServerUnavailableError: a server cannot be reached within ``cfg.timeout_s``.
    """

    def __init__(self, cfg, rank, connections=None, num_threads=1, consistency=None):
        if not 0 <= rank < cfg.num_trainers:
            raise KVStoreError(f"rank: expected 0..{cfg.num_trainers - 1}, got {rank}")
        self.cfg, self.rank, self.num_threads = cfg, rank, num_threads
        self.num_servers, self.num_trainers = len(cfg.servers), cfg.num_trainers
        self.consistency = Consistency.parse(consistency or cfg.consistency, "consistency",
                                             KVStoreError)
        self._conns = list(connections) if connections is not None else \
            open_connections(cfg, rank)
        self._meta, self._shm, self._seq, self._slots = {}, {}, {}, {}
        self._applying = Applying(self._conns)
        self._closed = False
        self._init_remote_keyed()
        hello = {sid: Hello(rank=rank, token=cfg.job_token or "")
                 for sid in range(self.num_servers)}
        self.server_info = [r.fields for r in self._call(hello).values()]
        for sid, info in enumerate(self.server_info):
            if info.get("server_id") != sid or info.get("num_servers") != self.num_servers:
                raise KVStoreError(f"server {sid}: answers as server {info.get('server_id')} "
                                   f"of {info.get('num_servers')}, the config lists "
                                   f"{self.num_servers} servers")
        # Servers on this machine's local sockets hand over (and take) shared memory.
        self._local = {sid for sid, conn in enumerate(self._conns) if conn.passes_fds and
                       self.server_info[sid].get("shared_memory")}
        # Updates and pushes to them hand their arrays over in a request slot.
        self._slots = {sid: RequestSlot(cfg.job_id, rank, sid) for sid in self._local}

    # -- plumbing -----------------------------------------------------------------------

    def _call(self, requests, wait=True, on_reply=None, while_waiting=None, timeout=None):
        """Send ``{server id: message}`` to all, then read every reply.

        The one send-then-collect routine of this client: every request goes out before
        any reply is read (servers work concurrently), and every reply is read even after
        an error, so the connections stay in step.

        Args:
            requests: {server id: message}.
            wait: False for asynchronous updates (no reply is sent or read).
            on_reply: ``on_reply(sid, frame)`` for each successful reply frame; it may
                raise KVStoreError to report a malformed reply (collected like a server's).
            while_waiting: work to do after sending, before reading (e.g. shared-memory
                gathers while the remote rows travel).
            timeout: seconds to wait for each reply to begin (default: the connection's).

        Returns:
            {server id: Reply}.

        Raises:
            KVStoreError or PartitionError: a server answered with an error (the first
                one, after all replies were read).
            ServerUnavailableError: a server died or timed out.
        """
        self._check_open()
        for sid, msg in requests.items():
            self._applying.settle(sid, timeout)  # its slot is free, its failure raised
            if not wait:
                msg.flags |= FLAG_NO_REPLY
            frame = self._frame_for(sid, msg, wait)
            try:
                self._conns[sid].send(frame)
            finally:
                close_fds(frame)  # a new request slot's descriptor: the server has its own
        if while_waiting is not None:
            while_waiting()
        if not wait:
            return {}
        replies, failed = {}, []
        for sid in requests:
            frame = self._conns[sid].recv(timeout)
            if frame.service == Service.ERROR:
                failed.append((frame.fields.get("kind"), str(frame.fields.get("message"))))
            elif frame.service != Service.REPLY:
                raise TransportError(f"server {sid}: unexpected reply service {frame.service}")
            else:
                try:
                    if on_reply is not None:
                        on_reply(sid, frame)  # it takes the descriptors it keeps
                    replies[sid] = Reply.decode(frame)
                except KVStoreError as e:
                    failed.append((type(e).__name__, str(e)))
                finally:
                    close_fds(frame)
        if failed:
            kind, message = failed[0]
            raise ERRORS.get(kind, KVStoreError)(message)
        return replies

    def _check_open(self):
        if self._closed:
            raise KVStoreError("this RemoteKVClient is closed")

    # -- KVClient -----------------------------------------------------------------------

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        if self.is_keyed(name):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        check_new_name(self._meta, name)
        check_rounding(dtype, rounding_seed)
        by = self._parts_by_server(policy)
        seed = -1 if rounding_seed is None else int(rounding_seed)
        replies = self._call({sid: Create(name=name, dtype=dtype, row_shape=list(shape[1:]),
                                          parts=parts, part_rows=[policy.get_part_size(p)
                                                                  for p in parts],
                                          rounding_seed=seed)
                              for sid, parts in by.items()})
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)
        if init_func is not None:
            for sid, parts in by.items():
                for part in set(parts) - set(replies[sid].fields["existed"]):
                    self._init_shard(name, sid, part, policy, init_func, shape, dtype)
        self.barrier()
        self._map_shm(name, by)

    def _init_shard(self, name, sid, part, policy, init_func, shape, dtype):
        sshape = (policy.get_part_size(part),) + tuple(shape[1:])
        arr = init_shard(init_func, sshape, dtype, name)
        step = max(1, INIT_CHUNK_BYTES // max(1, arr[:1].nbytes))
        for s in range(0, sshape[0], step):
            chunk = arr[s:s + step]
            self._call({sid: Push(name=name, parts=[part], counts=[len(chunk)],
                                  ids=np.arange(s, s + len(chunk), dtype=np.int64),
                                  values=chunk)})

    def delete_data(self, name):
        if not (self.is_keyed(name) or name in self._meta):
            return
        servers = self._shards(name)
        if self.is_keyed(name):
            self._routers.pop(name)
            self._forget(name)
        else:
            del self._meta[name]
        for key in [k for k in self._shm if k[0] == name]:
            del self._shm[key]
        self._call({sid: Drop(name=name) for sid in servers})

    def pull(self, name, ids):
        self._check_open()
        table, shape, dtype = self._rows(name)
        return self._read(table, self._checked_ids(table, ids), lambda r: Pull(
            name=name, parts=r.parts, counts=r.counts, ids=r.ids), shape,
            half.row_dtype(dtype), half.storage_dtype(dtype), mapped=table == name)

    def _read(self, table, ids, ask, row_shape, dtype, wire, mapped=False):
        """Rows of ``ids`` of ``table``, asked of their servers with ``ask(route)``, in
        the order of ``ids``; replies carry rows of dtype ``wire`` (half rows, decoded
        here into ``dtype``). With ``mapped``, the rows of shards mapped from co-located
        servers are copied from there while the others travel (unless writes keep a
        shard busy: then its server is asked)."""
        routes, shm = self._route(table, ids, skip_shm=mapped and bool(self._shm))

        def mapped_rows(part, sent):  # None while writes keep the shard busy
            return self._gather(self._shm[(table, part)], self._shard_rows(table, part, sent),
                                part % self.num_servers, table, part)
        if not routes and len(shm) == 1:  # every row in one mapped shard: no copy of them
            rows = mapped_rows(shm[0][0], shm[0][2])
            if rows is not None and rows.dtype == np.dtype(dtype):
                return rows
        out = np.empty((len(ids),) + tuple(row_shape), dtype)
        busy = []

        def copy_shm():
            for part, pos, sent in shm:
                rows = mapped_rows(part, sent)
                if rows is None:
                    busy.append((part, pos, sent))
                else:
                    out[pos] = rows

        def ask_all(routes, while_waiting=None):
            def take(sid, frame):
                route = routes[sid]
                got = frame.arrays[0] if len(frame.arrays) == 1 else None
                if got is None or got.shape != (len(route.ids),) + tuple(row_shape) or \
                        got.dtype != wire:
                    raise KVStoreError(f"server {sid}: reply of the wrong shape or dtype "
                                       f"for {table!r}")
                out[route.positions] = half.as_rows(got)
            self._call({sid: ask(r) for sid, r in routes.items()}, on_reply=take,
                       while_waiting=while_waiting)

        ask_all(routes, copy_shm)
        for part, pos, sent in busy:  # writes kept these busy: asked of their server
            ask_all({part % self.num_servers: Route([part], [len(sent)], sent, pos)})
        return out

    def push(self, name, ids, values):
        table, shape, dtype = self._rows(name)
        ids = self._checked_ids(table, ids)
        values = np.ascontiguousarray(values, dtype=half.row_dtype(dtype)).reshape(
            (len(ids),) + shape)
        if half.is_half(dtype):  # rounded here: 16 bits on the wire
            values = half.encode(values, dtype)
        self._write(name, table, ids, values)

    def _write(self, name, table, ids, values):
        """Write ``values``, as stored, to rows ``ids`` of ``name`` (a table, or its
        state) in ``table``'s shards; a co-located server takes them from the request
        slot."""
        routes, _ = self._route(table, ids)
        self._call({sid: Push(name=name, parts=r.parts, counts=r.counts, ids=r.ids,
                              values=take_rows(values, r.positions)) for sid, r in routes.items()})

    def init_optimizer(self, name, rule, options):
        shards = self._shards(name)
        impl = rule_of(rule)
        opts = impl.options_from(options)  # every rank refuses, before the barrier
        # Collective: everyone is here before rank 0 resets the state, and nobody steps
        # before it has (a fresh optimizer starts from fresh state, as torch's does).
        self.barrier()
        if self.rank == 0:
            self._call({sid: OptInit(name=name, rule=impl.name.value, options=opts, parts=parts)
                        for sid, parts in shards.items()})
        self.barrier()
        self._seq[name] = 0
        if self.is_keyed(name):
            return self._state_names(name, rule)
        meta = self._meta_of(name)
        names = {}
        for spec in impl.states:
            sname = state_name(name, spec.name)
            self._meta[sname] = DataMeta((meta.shape[0],) + spec.shape(meta.shape[1]),
                                         spec.dtype, meta.policy)
            names[spec.name] = sname
        return names

    def push_update(self, name, ids, grads, rule, hyper):
        self.push_update_versions(name, ids, grads, rule, hyper, versions=False)

    def push_update_versions(self, name, ids, grads, rule, hyper, versions=True, have=None):
        """:meth:`push_update`, returning what a trainer cache needs after it.

        Args:
            versions: answer the rows' versions after the update.
            have: (sync_exact only) the version of each row the cache holds, -1 for rows
                it does not (see :class:`~distemb.transport.messages.Update`).

        Returns:
            with ``have``, a :class:`~distemb.kvstore.remote_versions.HeldRows`; else
            int64 versions, one per id (see :meth:`KVServer.versions
            <distemb.kvstore.server.KVServer.versions>`), or None when ``versions`` is
            False or the consistency is async (no reply).

        Raises:
            KVStoreError: ``have`` without sync_exact consistency.
        """
        impl = rule_of(rule)
        fields = impl.check_hyper(hyper).fields()
        ids = self._checked_ids(name, ids, policy=False)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        routes, _ = self._route(name, ids)
        exact = self._check_have(have)
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        wait = self.consistency != Consistency.ASYNC
        want = versions and wait and have is None

        def update(parts, counts, sent, rows, held=None):
            return Update(name=name, rule=impl.name.value, hyper=fields, seq=seq, exact=exact,
                          versions=want, parts=parts, counts=counts, ids=sent, grads=rows,
                          have=held)

        requests = {sid: update(r.parts, r.counts, r.ids, take_rows(grads, r.positions),
                                None if have is None else take_rows(have, r.positions))
                    for sid, r in routes.items()}
        if exact:
            # Every owning server hears from every trainer each step, even with no rows,
            # so it knows when the step's contributions are complete.
            for sid in self._shards(name):
                requests.setdefault(sid, update([], [], np.empty(0, np.int64),
                                                np.empty((0, grads.shape[1]), np.float32)))
        if have is not None:
            held = HeldReplies({sid: r.positions for sid, r in routes.items()},
                               grads.shape[1])
            self._call(requests, on_reply=held.take)
            return held.result()
        out = np.empty(len(ids), np.int64) if want else None

        def take(sid, frame):
            if sid not in routes:
                return
            route = routes[sid]
            if len(frame.arrays) != 1 or frame.arrays[0].shape != route.positions.shape:
                raise KVStoreError(f"server {sid}: update reply without the rows' versions")
            out[route.positions] = frame.arrays[0]

        def applying(sid, frame):  # a co-located server may answer before it applies
            if sid in routes:  # every early answer is noted: its outcome frame follows
                r = routes[sid]
                part = r.parts[0] if len(r.parts) == 1 else None
                self._applying.note(sid, name, part, frame, self._shard_rows(name, part, r.ids))
        self._call(requests, wait=wait, on_reply=take if want else applying)
        return out

    def _shard_requests(self, cls, name, **fields):
        """{server id: ``cls`` naming its shards of table ``name``} (with an array table's
        partitions, the ids each one holds: a progression ``start + step * local``)."""
        policy = None if self.is_keyed(name) else self._meta_of(name).policy
        requests = {}
        for sid, parts in self._shards(name).items():
            prog = [policy.id_progression(p) for p in parts] if policy else []
            requests[sid] = cls(name=name, parts=parts, starts=[p[0] for p in prog],
                                steps=[p[1] for p in prog], **fields)
        return requests

    def save_table(self, name, directory, save_id, columns):
        """Every server writes its own shards of ``name``, all at once (in parallel)."""
        replies = self._call(self._shard_requests(Save, name, directory=directory,
                                                  save_id=save_id, columns=list(columns)),
                             timeout=IO_TIMEOUT_S)
        records = [rec for sid in sorted(replies) for rec in replies[sid].fields["records"]]
        if self.is_keyed(name):
            spec = self._spec(name)
            rows = getattr(spec, "num_rows", None) if spec.fixed_keys else None
            return snapshot.new_entry((rows, spec.dim), spec.dtype, records)
        meta = self._meta_of(name)
        return snapshot.new_entry(meta.shape, meta.dtype, records, meta.policy)

    def load_table(self, name, directory, entry, columns):
        """Every server reads, from the checkpoint's records, the rows it owns (a keyed
        table's shards: the keys its router gives them, which replace theirs)."""
        if not self.is_keyed(name):
            check_entry_rows(entry, self._meta_of(name).shape[0], name, directory)
        self._call(self._shard_requests(Load, name, directory=directory,
                                        columns=list(columns)), timeout=IO_TIMEOUT_S)

    def coalesce(self, name, ids, grads, F):
        """As the host clients; in sync_exact mode an empty step still pushes (nothing).

        The servers of a sync_exact job wait for every trainer's push of each step, so a
        trainer without rows for a table pushes an empty update (and counts the step).
        """
        summed = super().coalesce(name, ids, grads, F)
        if summed is None and self.consistency == Consistency.SYNC_EXACT:
            return np.empty(0, np.int64), np.empty((0, self.row_dim(name)), np.float32)
        return summed

    def barrier(self):
        if self.cfg.num_trainers > 1:
            self._call({0: Barrier(rank=self.rank)})

    @property
    def closed(self):
        """True once :meth:`close` ran (the tables stay on the servers)."""
        return self._closed

    def close(self, goodbye=True):
        """Disconnect; with ``goodbye``, first tell every server this trainer is done.

        Servers exit once every trainer has said goodbye. Tables stay on the servers.
        """
        if self._closed:
            return
        try:
            if goodbye:
                self._call({sid: Bye(rank=self.rank) for sid in range(self.num_servers)})
        except TransportError:
            pass  # a server already gone needs no goodbye
        finally:
            self._closed = True
            self._shm.clear()
            for slot in self._slots.values():
                slot.close()
            for conn in self._conns:
                conn.close()
