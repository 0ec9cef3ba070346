"""The keyed tables of a cluster's trainer: row stores sharded over the servers by a router.

A mixin of :class:`~distemb.kvstore.remote.RemoteKVClient` (it uses that client's
connections, rank, barrier and consistency), beside its array tables in one namespace;
:mod:`distemb.kvstore.keyed` has what keyed tables do differently at every client.

Each server holds one store per table (:mod:`distemb.kvstore.catalog`), made there
from the table's spec, with the keys the table's router (:mod:`distemb.routers`) gives
it: a dynamic table (:class:`~distemb.stores.hash.HashTableSpec`) has a hash store per
server holding the keys ``k`` for which ``key_partition(k, num_servers)`` names it
(:func:`~distemb.partition.key_partition`: splitmix64 of the key, modulo the server
count), so any key lands on the same server whichever trainer sends it; a file-backed
table (:class:`~distemb.stores.file.FileTableSpec`) has a FileStore per server holding
a range of its keys 0..N-1. A lookup of a dynamic table is a find-or-insert on the
owning server, which makes a new key's row with the table's initialiser, rebuilt there
from its spec (``key_normal``/``key_uniform``): the row a key gets does not depend on
the server count or on who asked first.

Every request is split by owning server and sent to all of them before a reply is read
(the cluster client's one send-then-collect routine, ``RemoteKVClient._call``, over
its connections). Updates follow the
job's consistency as array tables do: ``sync`` waits for every server, ``async`` does
not, ``sync_exact`` has every trainer push to every server each step (empty when it has
no rows there), and a server sums the step's contributions and applies them once.
Reads, writes and updates are the requests of every table (``Pull``, ``Push``,
``OptInit``, ``Update`` addressed to the server's shard ``parts=[server id]``, with the
table's keys as ids): pushes and updates to a co-located server hand their arrays over
in /dev/shm request slots, as for array tables. A co-located server's rows are read in
place where they never move (a file table's: the file, mapped read-only, under a
seqlock counter in shared memory); a store that inserts on read is read over the sockets.

Example (servers started by ``distemb-launch``)::

    kv = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    kv.create_table("users", HashTableSpec(16, init=key_normal(16, std=0.1)))
    rows = kv.pull("users", np.array([2**40, -3]))
"""
import numpy as np

from distemb.enums import Consistency, EvictPolicy
from distemb.errors import KVStoreError, StoreError
from distemb.kernels import half
from distemb.kernels.hashtable import table_keys
from distemb.kvstore import snapshot
from distemb.kvstore.keyed import ShardedKeyedTables
from distemb.kvstore.remote_versions import HeldReplies
from distemb.rules import rule_of, state_name
from distemb.stores.types import WEIGHT
from distemb.transport.messages import (Create, Drop, Export, Get, Info, Load, OptInit, Pull,
                                        Push, Remove, Save, Update, VersionedPull)

#: Bytes of rows per export or import request (well under any frame limit).
PAGE_BYTES = 16 << 20
IO_TIMEOUT_S = 6 * 3600.0  # a server writing or reading a checkpoint of a huge table


class RemoteKeyedTables(ShardedKeyedTables):
    """The keyed tables of :class:`~distemb.kvstore.remote.RemoteKVClient`: a store per
    server per table; see the module docstring. The client's ``pull``, ``push``,
    ``push_update``, ``init_optimizer``, ``delete_data`` and checkpoint methods hand a
    keyed table to the ``_keyed_*`` methods here."""

    def _init_remote_keyed(self):
        self._init_keyed()
        self._routers = {}

    def _split(self, name, keys):
        """{server id: (positions in ``keys``, its keys)} of the servers owning some, by
        the table's router (:mod:`distemb.routers`)."""
        self._spec(name)  # the error for an unknown table
        return self._routers[name].split(keys)

    def _all(self, make, timeout=None):
        return self._call({sid: make(sid) for sid in range(self.num_servers)},
                                timeout=timeout)

    def _gather_keyed(self, name, keys, make, row_shape, dtype, mapped=False, wire=None):
        """Rows of ``keys`` asked of their owners with ``make(server id, keys)``, in key
        order; with ``mapped``, the weight rows of shards mapped from co-located servers
        are read in place (unless writes keep them busy). Replies carry rows of dtype
        ``wire`` (default ``dtype``): half weight rows, decoded here."""
        wire = np.dtype(dtype if wire is None else wire)
        keys = table_keys(keys)
        out = np.empty((len(keys),) + row_shape, dtype)
        split = self._split(name, keys)
        for sid in [s for s in split if mapped and (name, s) in self._shm]:
            pos, k = split[sid]
            rows = self._gather(self._shm[(name, sid)], self._routers[name].to_local(sid, k),
                                sid, name, sid)
            if rows is not None and len(pos) == len(keys) and rows.dtype == out.dtype:
                return rows  # every key's row, in order (a split's positions ascend)
            if rows is not None:
                out[pos] = rows
                del split[sid]

        def take(sid, frame):
            pos = split[sid][0]
            got = frame.arrays[0] if len(frame.arrays) == 1 else None
            if got is None or got.shape != (len(pos),) + row_shape or got.dtype != wire:
                raise KVStoreError(f"server {sid}: reply of the wrong shape or dtype for "
                                   f"{name!r}")
            out[pos] = half.as_rows(got)

        self._call({sid: make(sid, k) for sid, (_, k) in split.items()}, on_reply=take)
        return out

    # -- tables -------------------------------------------------------------------------

    def create_table(self, name, spec):
        """Make dynamic table ``name`` on every server (collective, as ``init_data``).

        Raises:
            TypeError: the spec's initialiser is a plain function (servers cannot run it).
            KVStoreError: ``name`` exists here, or on the servers with another spec.
        """
        if self._exists(name, spec):
            return
        self._all(lambda sid: Create.of_spec(name, spec))
        self._specs[name] = spec
        self._routers[name] = spec.router(self.num_servers)
        self.barrier()
        if spec.fixed_keys:  # rows that never move: co-located shards are read in place
            self._map_shm(name, {sid: [sid] for sid in range(self.num_servers)})

    def _info(self, name, evict_to=None, policy=None):
        spec = self._spec(name)
        share = [-1] * self.num_servers
        if evict_to is not None:
            if isinstance(evict_to, bool) or not isinstance(evict_to, (int, np.integer)) or \
                    evict_to < 0:
                raise ValueError(f"target_size: expected an int >= 0, got {evict_to!r}")
            share = [evict_to // self.num_servers + (sid < evict_to % self.num_servers)
                     for sid in range(self.num_servers)]
        pol = "" if policy is None else EvictPolicy.parse(policy, "policy", ValueError).value
        return spec, self._all(lambda sid: Info(name=name, evict_to=share[sid], policy=pol))

    def size(self, name):
        return int(sum(r.fields["size"] for r in self._info(name)[1].values()))

    def remove(self, name, keys):
        split = self._split(name, table_keys(keys))
        replies = self._call({sid: Remove(name=name, ids=k) for sid, (_, k) in split.items()})
        return int(sum(r.fields["removed"] for r in replies.values()))

    def contains(self, name, keys):
        self._spec(name)
        return self._gather_keyed(name, keys, lambda sid, k: Get(
            name=name, mode="contains", column=WEIGHT, ids=k), (), np.bool_)

    def get(self, name, keys):
        dim = self.dim(name)
        return self._gather_keyed(name, keys, lambda sid, k: Get(
            name=name, mode="get", column=WEIGHT, ids=k), (dim,), np.float32)

    def evict(self, name, target_size, policy=None):
        """Each server evicts down to its share of ``target_size`` by its own LRU/LFU
        order (the order is per server: no global ranking crosses the network)."""
        replies = self._info(name, target_size, policy)[1]
        return np.concatenate([replies[sid].arrays[0] for sid in sorted(replies)])

    def export(self, name, columns=None):
        spec = self._spec(name)
        cols = list(columns) if columns is not None else None
        keys, rows = [], {}
        for sid in range(self.num_servers):
            start = 0
            while True:
                page = max(1, PAGE_BYTES // (8 + 16 * spec.dim))  # weight + 3 states at most
                r = self._call({sid: Export(name=name, start=start, count=page,
                                            columns=cols or [])})[sid]
                names = r.fields["columns"]
                if len(r.arrays) != 1 + len(names):
                    raise KVStoreError(f"server {sid}: export reply of the wrong shape")
                keys.append(r.arrays[0])
                for c, a in zip(names, r.arrays[1:]):
                    rows.setdefault(c, []).append(a)
                start += len(r.arrays[0])
                if start >= r.fields["total"] or not len(r.arrays[0]):
                    break
        allkeys = np.concatenate(keys)
        order = np.argsort(allkeys, kind="stable")
        return allkeys[order], {c: np.concatenate(a)[order] for c, a in rows.items()}

    def import_(self, name, keys, columns):
        keys = table_keys(keys)
        for c, values in columns.items():
            if len(values) != len(keys):
                raise KVStoreError(f"columns[{c!r}]: expected {len(keys)} rows, got "
                                   f"{len(values)}")
        have = self._info(name)[1][0].fields["columns"]  # every server's store has the same
        missing = [c for c in columns if c not in have]
        if missing:  # refused before any row is written
            raise StoreError(f"columns: {missing} not in table {name!r} (has {sorted(have)})")
        # the weight first: it inserts absent keys, state columns then overwrite
        for c in sorted(columns, key=lambda c: c != WEIGHT):
            values = np.asarray(columns[c])
            if c == WEIGHT:
                values = self._encoded(name, values)
            page = max(1, PAGE_BYTES // max(1, values[:1].nbytes + 8))
            for lo in range(0, len(keys), page):
                self._write(name, keys[lo:lo + page], values[lo:lo + page], c)

    def _write(self, name, keys, values, column):
        """Upsert ``values`` into ``column`` of ``keys``: a Push of the table (its weight)
        or of the state's name (a co-located server takes it from shared memory)."""
        split = self._split(name, keys)
        target = name if column == WEIGHT else state_name(name, column)
        self._call({sid: Push(name=target, parts=[sid], counts=[len(k)], ids=k,
                                    values=np.ascontiguousarray(values[pos]))
                          for sid, (pos, k) in split.items()})

    def _keyed_delete(self, name):
        self._routers.pop(name, None)
        for key in [k for k in self._shm if k[0] == name]:
            del self._shm[key]
        self._forget(name)
        self._all(lambda sid: Drop(name=name))

    # -- the client's storage methods, for a keyed table --------------------------------

    def _keyed_pull(self, name, ids):
        """Rows of keyed table ``name``, or of a keyed table's state by its name (held
        keys only): each server answers for its keys."""
        state = self.state_of(name)
        table, shape, dtype = (name, (self.dim(name),), np.float32) if state is None else \
            (state[0], state[2], state[3])
        return self._gather_keyed(table, ids, lambda sid, k: Pull(
            name=name, parts=[sid], counts=[len(k)], ids=k), shape, dtype,
            mapped=state is None, wire=half.storage_dtype(self._spec(table).dtype)
            if state is None else None)

    def _keyed_push(self, name, ids, values):
        state = self.state_of(name)
        if state is not None:
            self._write(state[0], table_keys(ids), np.asarray(values, state[3]).reshape(
                (len(ids),) + state[2]), state[1])
            return
        self._write(name, table_keys(ids), self._encoded(name, np.asarray(
            values, np.float32).reshape(len(ids), self.dim(name))), WEIGHT)

    def _encoded(self, name, values):
        """float32 weight rows of ``name`` in its storage dtype: half rows are rounded
        here (to nearest-even, as the store would), so they cross the wire in 2 bytes."""
        dtype = self._spec(name).dtype
        values = np.asarray(values, np.float32)
        return half.encode(values, dtype) if half.is_half(dtype) else values

    def _keyed_init_optimizer(self, name, rule, options):
        """Fresh state columns on every server (collective, as for array tables)."""
        self._spec(name)
        impl = rule_of(rule)
        opts = {k: float(v) for k, v in options.items()}
        self.barrier()
        if self.rank == 0:
            self._all(lambda sid: OptInit(name=name, rule=impl.name.value, options=opts,
                                          parts=[sid]))
        self.barrier()
        self._seq[name] = 0
        return self._state_names(name, rule)

    def _keyed_push_update(self, name, ids, grads, rule, hyper, versions=False, have=None):
        """The update of keyed table ``name``; with ``versions`` (and a reply awaited),
        the rows' versions after it, one per id (for a trainer cache), else None; with
        ``have`` (sync_exact), the held rows' answer (:class:`HeldRows
        <distemb.kvstore.remote_versions.HeldRows>`)."""
        impl = rule_of(rule)
        fields = impl.check_hyper(hyper).fields()
        dim = self.dim(name)
        exact = self._check_have(have)
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        grads = np.asarray(grads, np.float32)
        ids = table_keys(ids)
        split = self._split(name, ids)
        wait = self.consistency != Consistency.ASYNC
        want = versions and wait and have is None
        def share(a, pos):  # no copy for one server's whole request (positions ascend)
            return a if a is None or len(pos) == len(ids) else a[pos]
        requests = {sid: Update(name=name, rule=impl.name.value, hyper=fields, seq=seq,
                                exact=exact, versions=want, parts=[sid], counts=[len(k)],
                                ids=k, grads=np.ascontiguousarray(share(grads, pos)),
                                have=share(have, pos))
                    for sid, (pos, k) in split.items()}
        if exact:
            # every server hears from every trainer each step, so it knows when the
            # step's contributions are complete
            for sid in range(self.num_servers):
                requests.setdefault(sid, Update(
                    name=name, rule=impl.name.value, hyper=fields, seq=seq, exact=True,
                    parts=[sid], counts=[0], ids=np.empty(0, np.int64),
                    grads=np.empty((0, dim), np.float32)))
        if have is not None:
            held = HeldReplies({sid: pos for sid, (pos, _) in split.items()}, dim)
            self._call(requests, on_reply=held.take)
            return held.result()
        out = np.empty(len(ids), np.int64) if want else None

        def take(sid, frame):
            if sid not in split:
                return
            pos = split[sid][0]
            if len(frame.arrays) != 1 or frame.arrays[0].shape != pos.shape:
                raise KVStoreError(f"server {sid}: update reply without the rows' versions")
            out[pos] = frame.arrays[0]

        def applying(sid, frame):  # a co-located server may answer before it applies
            if sid in split:  # every early answer is noted: its outcome frame follows
                self._applying.note(sid, name, sid, frame,  # the rows' slots in its file
                                    self._routers[name].to_local(sid, split[sid][1]))
        self._call(requests, wait=wait, on_reply=take if want else applying)
        return out

    def _keyed_pull_versioned(self, name, keys, have, states):
        """:meth:`~distemb.kvstore.remote_versions.VersionedPulls.pull_versioned` of a
        keyed table: each server answers for the keys it owns (inserting absent ones, as
        a lookup does)."""
        keys, have = table_keys(keys), np.ascontiguousarray(have, dtype=np.int64)
        dim = self.dim(name)
        split = self._split(name, keys)
        got = {}

        def take(sid, frame):
            a, pos = frame.arrays, split[sid][0]
            n = a[0].shape[0] if a else -1
            if len(a) != 3 + len(states) or a[0].dtype != np.int64 or \
                    a[1].shape[0] != n or a[2].shape != (n, dim) or n > len(pos) or \
                    (n and (a[0].min() < 0 or a[0].max() >= len(pos))):
                raise KVStoreError(f"server {sid}: versioned pull reply of the wrong shape")
            got[sid] = (pos[a[0]], a[1], a[2], a[3:])

        self._call({sid: VersionedPull(name=name, parts=[sid], counts=[len(k)],
                                       states=list(states), ids=k, have=have[pos])
                    for sid, (pos, k) in split.items()}, on_reply=take)
        parts = [got[sid] for sid in split]
        if not parts:
            return (np.empty(0, np.int64), np.empty(0, np.int64),
                    np.empty((0, dim), np.float32), [])
        return (np.concatenate([g[0] for g in parts]), np.concatenate([g[1] for g in parts]),
                np.concatenate([g[2] for g in parts]),
                [np.concatenate([g[3][i] for g in parts]) for i in range(len(states))])

    def _keyed_save(self, name, directory, save_id, columns):
        """Every server writes its own store of ``name`` (in parallel)."""
        spec = self._spec(name)
        replies = self._all(lambda sid: Save(name=name, directory=directory, save_id=save_id,
                                             parts=[sid], starts=[], steps=[],
                                             columns=list(columns)), timeout=IO_TIMEOUT_S)
        rows = getattr(spec, "num_rows", None) if spec.fixed_keys else None
        return snapshot.new_entry((rows, spec.dim), spec.dtype,
                                  [rec for sid in sorted(replies)
                                   for rec in replies[sid].fields["records"]])

    def _keyed_load(self, name, directory, columns):
        """Every server replaces its keys with the checkpoint's keys it owns now."""
        self._all(lambda sid: Load(name=name, directory=directory, parts=[sid], starts=[],
                                   steps=[], columns=list(columns)), timeout=IO_TIMEOUT_S)
