"""RemoteKVClient: the KVClient of a trainer whose tables live in server processes.

Every table is one path: its router puts each key on a shard, shard ``p`` on server
``p % num_servers`` (:mod:`distemb.kvstore.routes`); every server makes its shards'
stores from the table's spec (:mod:`distemb.kvstore.server.catalog`): a dense table's
partitions in shared memory when the server has it, a hash store holding the keys its
router gives it, a file table's range of keys. Reads, writes, updates, checkpoints and
key management are split by owning server and sent to all of them before any reply is
read (:class:`~distemb.kvstore.servers.Servers`), so servers work concurrently; an
update costs one round trip per server per step (the optimizer has already deduplicated
and coalesced the rows). Rows of co-located servers whose rows never move (a dense
shard's memory file, a file table's file) are gathered where they lie, and such a server
answers an update before it applies it (:mod:`distemb.kvstore.server.early`).

``create_table`` and ``init_optimizer`` are collective, as in DGL: every trainer calls
them in the same order (table and optimizer construction does), the first creator's
initial values win, and they return once every trainer has the table.

Example (servers started by ``distemb-launch``)::

    client = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    client.init_data("emb", (1000, 16), "float32", range_policy(1000, client.num_servers))
    rows = client.pull("emb", np.arange(10))
"""
import numpy as np

from distemb.enums import Consistency, EvictPolicy
from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.local import column_name
from distemb.kvstore.prefetch import Prefetch, Prefetches, Watch
from distemb.kvstore.routes import (Route, reply_rows, route, shards_by_server,
                                    take_rows)
from distemb.kvstore.servers import Servers
from distemb.kvstore.tables import TableClient, Tables
from distemb.kvstore.types import refuse_store
from distemb.rules import rule_of
from distemb.stores.types import WEIGHT
from distemb.transport.messages import (Barrier, Create, Drop, Export, Get, Info, Load,
                                        OptInit, Pull, Push, Remove, Save, Update)

#: Bytes of rows per export request (well under any frame limit).
PAGE_BYTES = 16 << 20
IO_TIMEOUT_S = 6 * 3600.0  # a server writing or reading a checkpoint of a huge table


class RemoteKVClient(TableClient):
    """KVClient over a cluster of KVStore servers (see the module docstring).

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

    sharded = True

    def __init__(self, cfg, rank, connections=None, num_threads=1, consistency=None):
        if not 0 <= rank < cfg.num_trainers:
            raise KVStoreError(f"rank: expected 0..{cfg.num_trainers - 1}, got {rank}")
        self.cfg, self.rank, self.num_threads = cfg, rank, num_threads
        self.num_trainers = cfg.num_trainers
        self.consistency = Consistency.parse(consistency or cfg.consistency, "consistency",
                                             KVStoreError)
        self.servers = Servers(cfg, rank, connections, num_threads)
        self.num_servers = self.servers.count
        self.tables = Tables(self)
        #: rows read ahead for coming lookups (:meth:`prefetch`)
        self.prefetches = Prefetches()
        self._seq = {}

    @property
    def server_info(self):
        """What each server said of itself in its Hello reply."""
        return self.servers.info

    @property
    def closed(self):
        """True once :meth:`close` ran (the tables stay on the servers)."""
        return self.servers.closed

    def _call(self, requests, **kw):
        return self.servers.call(requests, **kw)

    def _shards(self, table):
        return shards_by_server(table.router, self.num_servers)

    # -- tables -----------------------------------------------------------------------

    def create_table(self, name, spec):
        """Make table ``name`` on the servers (collective, as DGL's ``init_data``): every
        server makes the stores of its shards from ``spec``; returns once every trainer
        has it.

        Raises:
            TypeError: the spec's initialiser is a plain function servers cannot run.
            KVStoreError: ``name`` exists here or on the servers with another spec.
        """
        if name in self.tables:
            return super().create_table(name, spec)
        super().create_table(name, spec)
        self.barrier()
        table = self.tables.table(name)
        if spec.fixed_keys:  # rows that never move: co-located shards are read in place
            self.servers.map(name, self._shards(table))

    def _make(self, name, spec, router):
        replies = self.servers.all(lambda sid: Create.of_spec(name, spec))
        return {p for p in range(router.num_parts)
                if not replies[p % self.num_servers].fields["existed"]}

    def delete_data(self, name):
        if self.tables.drop(name) is None:
            return
        self.prefetches.drop(name)
        self.servers.forget(name)
        self.servers.all(lambda sid: Drop(name=name))

    # -- rows -------------------------------------------------------------------------

    def prefetch(self, name, ids):
        """Send the Pulls of rows ``ids`` of ``name`` now, read their replies while the
        trainer goes on (:meth:`Servers.ahead <distemb.kvstore.servers.Servers.ahead>`),
        and name the rows in the table's updates until their lookup, whose owners answer
        with the rows each update writes (:mod:`distemb.kvstore.prefetch`). Rows a
        co-located server shares are read in place (:meth:`Servers.expect`). Absent keys
        are inserted and accesses counted, as the lookup would.

        Raises:
            KVStoreError: no table ``name``; a store that evicts on its own (a hash table
                with a capacity: a prefetched key could be evicted before its lookup).
        """
        table = self.tables.table(name)
        if table.num_keys is None and table.spec.capacity is not None:
            raise refuse_store(
                self, name, f"a {table.spec.kind} store with a capacity "
                f"({table.spec.capacity} keys)", "prefetch: such a store evicts keys on "
                "its own, and a prefetched key could be evicted by another lookup before "
                "its own; prefetch tables without a capacity (evict() them yourself)")
        keys = keys_array(ids, "ids")
        table.router.check(keys, f"ids of {name!r}")
        mapped = self.servers.expect(name, table.router, keys)
        if mapped is None:  # every row is read in place
            return
        keys = np.unique(keys)
        rows, ok, wait = self._pull_ahead(table, keys, mapped)
        if ok.any():
            self.prefetches.add(name, Prefetch(keys, rows, ok, wait))

    def prefetch_stats(self):
        """Counters of :meth:`prefetch` (:class:`~distemb.kvstore.prefetch.Prefetches`)."""
        return dict(self.prefetches.stats)

    def _read(self, table, column, ids):
        return self._pull_rows([(table, column, ids)])[0]

    def pull_many(self, requests):
        """Rows of every ``(table, ids)`` of ``requests`` in one round trip per server:
        each server gets its Pulls of every table back to back (a PyG feature store's
        multi-get, a grouped lookup)."""
        return self._pull_rows([self.tables.rows(n) + (ids,) for n, ids in requests])

    def _pull_rows(self, requests):
        """Rows of each ``(table, column, ids)``: a table's rows its prefetch holds from
        there (:meth:`prefetch`), the others from their servers (:meth:`_read_rows`)."""
        return self.prefetches.serve(requests, self._read_rows)

    def _read_rows(self, requests):
        """Rows of each ``(table, column, ids)``, asked of their servers, in the order of
        its ids; replies carry rows as stored (half rows decoded here). The rows of
        shards mapped from co-located servers are copied from there while the others
        travel (unless writes keep a shard busy: then its server is asked)."""
        plans = []
        for table, column, ids in requests:
            shape, dtype = table.columns()[column]
            mapped = {p for (n, p) in self.servers.mapped if n == table.name} \
                if column == WEIGHT else ()
            routes, shm = route(table.router, ids, self.num_servers, mapped)
            plans.append((table, column_name(table, column), tuple(shape),
                          half.storage_dtype(dtype), half.row_dtype(dtype), routes, shm))

        def mapped_rows(table, part, sent):  # None while writes keep the shard busy
            return self.servers.gather(table.name, part, table.router.to_local(part, sent))
        if len(plans) == 1 and not plans[0][5] and len(plans[0][6]) == 1:
            table, _, _, _, rows_dtype, _, ((part, _, sent),) = plans[0]
            rows = mapped_rows(table, part, sent)  # every row in one mapped shard: no copy
            if rows is not None and rows.dtype == np.dtype(rows_dtype):
                return [rows]
        outs = [np.empty((len(ids),) + p[2], p[4]) for p, (_, _, ids) in zip(plans, requests)]
        busy = []

        def copy_shm():
            for k, (table, *_, shm) in enumerate(plans):
                for part, pos, sent in shm:
                    rows = mapped_rows(table, part, sent)
                    if rows is None:
                        busy.append((k, part, pos, sent))
                    else:
                        outs[k][pos] = rows

        def ask_all(asked, while_waiting=None):  # asked: {sid: [(plan, route)]}
            seen = {sid: 0 for sid in asked}

            def take(sid, frame):
                k, r = asked[sid][seen[sid]]
                seen[sid] += 1
                table, _, shape, wire = plans[k][:4]
                outs[k][r.positions] = half.as_rows(reply_rows(sid, frame, r, shape, wire,
                                                               table.name))
            msgs = {sid: [Pull(name=plans[k][1], parts=r.parts, counts=r.counts, ids=r.ids)
                          for k, r in lst] for sid, lst in asked.items()}
            self._call({sid: m if len(m) > 1 else m[0] for sid, m in msgs.items()},
                       on_reply=take, while_waiting=while_waiting)

        asked = {}
        for k, plan in enumerate(plans):
            for sid, r in plan[5].items():
                asked.setdefault(sid, []).append((k, r))
        ask_all(asked, copy_shm)
        for k, part, pos, sent in busy:  # writes kept these busy: asked of their server
            ask_all({part % self.num_servers: [(k, Route([part], [len(sent)], sent, pos))]})
        return outs

    def _write(self, table, column, ids, rows):
        """Write ``rows``, as stored, to rows ``ids``; a co-located server takes them
        from the request slot. Prefetched copies of the rows are void."""
        if column == WEIGHT:
            self.prefetches.void(table.name, np.asarray(ids))
        kvname = column_name(table, column)
        routes, _ = route(table.router, ids, self.num_servers)
        self._call({sid: Push(name=kvname, parts=r.parts, counts=r.counts, ids=r.ids,
                              values=take_rows(rows, r.positions))
                    for sid, r in routes.items()})

    def _init_states(self, table, rule, options):
        opts = {k: float(v) for k, v in options.items()}
        # Collective: everyone is here before rank 0 resets the state, and nobody steps
        # before it has (a fresh optimizer starts from fresh state, as torch's does).
        self.barrier()
        if self.rank == 0:
            self._call({sid: OptInit(name=table.name, rule=rule_of(rule).name.value,
                                     options=opts, parts=parts)
                        for sid, parts in self._shards(table).items()})
        self.barrier()
        self._seq[table.name] = 0

    def push_update(self, name, ids, grads, rule, hyper):
        self.push_update_versions(name, ids, grads, rule, hyper, versions=False)

    def update_requests(self, name, ids, grads, rule, hyper, versions=False, have=None):
        """The Update requests of one step of table ``name`` by server, with their routes.

        Args:
            versions: the replies carry the rows' versions after the update.
            have: (sync_exact only) the version of each row a trainer cache holds, -1
                for rows it does not (see :class:`~distemb.transport.messages.Update`).

        Returns:
            ({sid: Update}, {sid: Route}).

        Raises:
            KVStoreError: ``have`` without sync_exact consistency.
        """
        table = self.tables.table(name)
        impl = rule_of(rule)
        fields = impl.check_hyper(hyper).fields()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        routes, _ = route(table.router, ids, self.num_servers)
        exact = self.consistency == Consistency.SYNC_EXACT
        if have is not None and not exact:
            raise KVStoreError(f"have: the held rows' versions go with sync_exact updates "
                               f"only (a step summed at the owner); consistency is "
                               f"{self.consistency.value!r}")
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq

        def update(parts, counts, sent, rows, held=None):
            return Update(name=name, rule=impl.name.value, hyper=fields, seq=seq, exact=exact,
                          versions=versions, parts=parts, counts=counts, ids=sent,
                          grads=rows, have=held)

        requests = {sid: update(r.parts, r.counts, r.ids, take_rows(grads, r.positions),
                                None if have is None else take_rows(have, r.positions))
                    for sid, r in routes.items()}
        if exact:
            # Every owning server hears from every trainer each step, even with no rows,
            # so it knows when the step's contributions are complete.
            for sid in self._shards(table):
                requests.setdefault(sid, update([], [], np.empty(0, np.int64),
                                                np.empty((0, grads.shape[1]), np.float32)))
        return requests, routes

    def push_update_versions(self, name, ids, grads, rule, hyper, versions=True):
        """:meth:`push_update`, returning the rows' versions after it (a trainer cache's
        check of its copies): int64, one per id (see :meth:`KVServer.versions
        <distemb.kvstore.server.kvserver.KVServer.versions>`), or None when ``versions``
        is False or the consistency is async (no reply)."""
        wait = self.consistency != Consistency.ASYNC
        want = versions and wait
        requests, routes = self.update_requests(name, ids, grads, rule, hyper, want)
        out = np.empty(len(ids), np.int64) if want else None
        router = self.tables.table(name).router  # (a reply may be read after a drop)

        def take(sid, frame):
            if sid not in routes:
                return
            r = routes[sid]
            if len(frame.arrays) != 1 or frame.arrays[0].shape != r.positions.shape:
                raise KVStoreError(f"server {sid}: update reply without the rows' versions")
            out[r.positions] = frame.arrays[0]

        def applying(sid, frame):  # a co-located server may answer before it applies
            self.servers.applying.note(sid, router, requests[sid], frame)
        self.send_update(name, requests, take if want else applying, wait)
        return out

    def send_update(self, name, requests, on_reply=None, wait=True):
        """Send one update of table ``name`` (``{sid: Update}`` of
        :meth:`update_requests`) with its :class:`~distemb.kvstore.prefetch.Watch` of the
        rows prefetched for coming lookups, then release the prefetches lookups used. An
        async update has no reply: the prefetched rows it writes are read again behind it.

        Args:
            on_reply: ``on_reply(sid, frame)`` for each reply frame, without its answer
                to the watch.
        """
        watch = Watch(self.prefetches, name, requests, self.tables.table(name).router,
                      self.num_servers) if wait else None

        def take(sid, frame):
            if watch is not None:
                watch.peel(sid, frame)
            if on_reply is not None:
                on_reply(sid, frame)
        self._call(requests, wait=wait, on_reply=take, later=True)
        if watch is not None:
            watch.patch()
        else:  # read again behind the update (each connection is ordered), ahead
            table = self.tables.table(name)
            self.prefetches.refetch(name, [m.ids for m in requests.values()],
                                    lambda keys: self._pull_ahead(table, keys)[2])
        self.prefetches.stepped(name)

    def _pull_ahead(self, table, keys, mapped=()):
        """Rows ``keys`` of ``table`` asked now, but for those of shards ``mapped``:
        (the rows' array, filled as the replies are read; bool per key: asked; a
        callable that waits for the replies and returns the array)."""
        shape, dtype = table.columns()[WEIGHT]
        wire = half.storage_dtype(dtype)
        routes, _ = route(table.router, keys, self.num_servers, mapped)
        rows = np.empty((len(keys),) + tuple(shape), half.row_dtype(dtype))
        asked = np.zeros(len(keys), bool)
        for r in routes.values():
            asked[r.positions] = True

        def take(sid, frame):  # on the thread that reads the reply
            r = routes[sid]
            rows[r.positions] = half.as_rows(reply_rows(sid, frame, r, shape, wire,
                                                        table.name))
        ahead = self.servers.ahead({sid: Pull(name=table.name, parts=r.parts,
                                              counts=r.counts, ids=r.ids)
                                    for sid, r in routes.items()}, on_reply=take)

        def wait():
            ahead.wait(self.servers.errors)
            return rows
        return rows, asked, wait

    def coalesce(self, name, ids, grads, F):
        """As the host clients, but a sync_exact step without rows pushes nothing: its
        servers wait for every trainer's push of each step."""
        summed = super().coalesce(name, ids, grads, F)
        if summed is None and self.consistency == Consistency.SYNC_EXACT:
            return np.empty(0, np.int64), np.empty((0, self.row_dim(name)), np.float32)
        return summed

    def _sum_buffer(self, name, n, dim):
        """With the whole table on one co-located server: a buffer in its request slot,
        so the sums reach it with no copy (``push_update`` follows ``coalesce``)."""
        sids = list(self._shards(self.tables.table(name)))
        buf = self.servers.slot_buffer(sids[0], (max(n, 1), dim)) if len(sids) == 1 else None
        return buf if buf is not None else super()._sum_buffer(name, n, dim)

    # -- keys -------------------------------------------------------------------------

    def _info(self, name, evict_to=None, policy=None):
        """Every server's Info reply: its size; with ``evict_to`` (checked by
        :meth:`evict`), after evicting down to its share of it by ``policy``."""
        share = [-1] * self.num_servers if evict_to is None else \
            [evict_to // self.num_servers + (sid < evict_to % self.num_servers)
             for sid in range(self.num_servers)]
        pol = "" if policy is None else EvictPolicy.parse(policy, "policy", ValueError).value
        return self.servers.all(lambda sid: Info(name=name, evict_to=share[sid], policy=pol))

    def size(self, name):
        table = self.tables.table(name)
        if table.num_keys is not None:  # a fixed key space: nobody need be asked
            return table.num_keys
        return int(sum(r.fields["size"] for r in self._info(name).values()))

    def _ask(self, table, keys, make, row_shape, dtype):
        """One answer row per key of ``table`` from its servers, ``make(route)`` the
        request; in the order of ``keys``."""
        routes, _ = route(table.router, keys, self.num_servers)
        out = np.empty((len(keys),) + tuple(row_shape), dtype)

        def take(sid, frame):
            r = routes[sid]
            out[r.positions] = reply_rows(sid, frame, r, row_shape, None, table.name)
        self._call({sid: make(r) for sid, r in routes.items()}, on_reply=take)
        return out

    def contains(self, name, keys):
        """Whether each key is held (False outside a fixed key space, asked of no one)."""
        table = self.tables.table(name)
        keys = keys_array(keys)
        out = table.router.inside(keys)
        out[out] = self._ask(table, keys[out], lambda r: Get(
            name=name, mode="contains", column=WEIGHT, parts=r.parts, counts=r.counts,
            ids=r.ids), (), np.bool_)
        return out

    def get(self, name, keys):
        table = self.tables.table(name)
        return self._ask(table, keys_array(keys), lambda r: Get(
            name=name, mode="get", column=WEIGHT, parts=r.parts, counts=r.counts,
            ids=r.ids), table.row_shape, np.float32)

    def _remove(self, table, keys):
        self.prefetches.void(table.name, keys)
        routes, _ = route(table.router, keys, self.num_servers)
        replies = self._call({sid: Remove(name=table.name, parts=r.parts, counts=r.counts,
                                          ids=r.ids) for sid, r in routes.items()})
        return int(sum(r.fields["removed"] for r in replies.values()))

    def _evict(self, table, target_size, policy):
        """Each server evicts down to its share of ``target_size`` by its own LRU/LFU
        order (the order is per server: no global ranking crosses the network)."""
        replies = self._info(table.name, target_size, policy)
        evicted = np.concatenate([replies[sid].arrays[0] for sid in sorted(replies)])
        self.prefetches.void(table.name, evicted)
        return evicted

    def _export(self, table, columns):
        """Every shard's rows, a page of about :data:`PAGE_BYTES` per request."""
        asked = columns or [WEIGHT]  # an export names its columns (none: every one)
        row_bytes = 8 + sum(4 * int(np.prod(table.columns()[c][0])) for c in asked)
        parts = []
        for sid, shards in self._shards(table).items():
            for part in shards:
                start = 0
                while True:
                    r = self._call({sid: Export(name=table.name, part=part, start=start,
                                                count=max(1, PAGE_BYTES // row_bytes),
                                                columns=asked)})[sid]
                    if len(r.arrays) != 1 + len(asked):
                        raise KVStoreError(f"server {sid}: export reply of the wrong shape")
                    parts.append((r.arrays[0], dict(zip(asked, r.arrays[1:]))))
                    start += len(r.arrays[0])
                    if start >= r.fields["total"] or not len(r.arrays[0]):
                        break
        return parts

    # -- checkpoints ------------------------------------------------------------------

    def _save(self, table, directory, save_id, columns, parent):
        """Every server writes its own shards, all at once (in parallel)."""
        replies = self._call({sid: Save(name=table.name, parts=parts, directory=directory,
                                        save_id=save_id, columns=columns,
                                        parent=parent or "")
                              for sid, parts in self._shards(table).items()},
                             timeout=IO_TIMEOUT_S)
        return [rec for sid in sorted(replies) for rec in replies[sid].fields["records"]]

    def _load(self, table, directory, entry, columns):
        """Every server reads, from the checkpoint's records, the keys its shards hold."""
        self.prefetches.drop(table.name)
        self._call({sid: Load(name=table.name, parts=parts, directory=directory,
                              columns=columns)
                    for sid, parts in self._shards(table).items()}, timeout=IO_TIMEOUT_S)

    def barrier(self):
        if self.cfg.num_trainers > 1:
            self._call({0: Barrier(rank=self.rank)})

    def close(self, goodbye=True):
        """Disconnect; with ``goodbye``, first tell every server this trainer is done.

        Servers exit once every trainer has said goodbye. Tables stay on the servers.
        """
        self.servers.close(goodbye)
