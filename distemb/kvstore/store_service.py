"""StoreTables: a server's tables on row stores, one store each, and their handlers.

A server holds row stores as it holds arrays: table ``name`` is one store here, made
from the table's spec (:data:`~distemb.stores.spec.SPECS`: a
:class:`~distemb.stores.hash.HashStore` for a dynamic table, a
:class:`~distemb.stores.file.FileStore` for a file-backed one), holding the keys the
table's router (:mod:`distemb.routers`) gives this server: ``key_partition(k, S)`` for
hash tables, a range of 0..N-1 for file tables. Requests carry the table's keys; the
handlers check that this server owns them and turn them into the store's keys (a range
shard's local ids) and back. The :class:`~distemb.kvstore.service.KVService` decodes
each request (every field and array checked by :mod:`distemb.transport.messages`) and
hands the STORE_* ones to the handlers here, which check them against the table
(columns, row shapes, dtypes, rules, what its store can do) before any store sees them;
any failure becomes an error reply.

Concurrency: each table's store is one :class:`~distemb.kvstore.shard.ShardTable`, the
shard type of array tables too: reads that cannot insert hold its lock shared; writes,
updates, removals and lookups of a store that inserts on read (a hash store may grow
its arrays and evict) hold it exclusive. One writer per row, as for arrays. Every write
of a row bumps its version (once versions are tracked), a hidden column evicted with
the row.

Example:
    >>> import numpy as np
    >>> from distemb.stores.spec import HashTableSpec
    >>> from distemb.transport.messages import StoreCreate, StoreRead
    >>> t = StoreTables(server_id=0, num_servers=1)
    >>> _ = t.create(StoreCreate(name="d", **HashTableSpec(2).fields()))
    >>> t.read(StoreRead(name="d", mode="lookup", column="weight",
    ...                  ids=np.array([2**60]))).arrays[0].tolist()
    [[0.0, 0.0]]
"""
import threading

import numpy as np

from distemb import kernels
from distemb.errors import KVStoreError, PartitionError, StoreError
from distemb.kvstore import snapshot, store_snapshot
from distemb.kvstore.shard import ShardTable
from distemb.kvstore.store_client import init_state_columns
from distemb.rules import rule_of
from distemb.stores.spec import spec_from_fields
from distemb.stores.types import WEIGHT
from distemb.transport.messages import Reply, Service


#: Longest row a server accepts for a dynamic table (a hostile dim must not allocate).
MAX_DIM = 1 << 16


class _Table:
    """A table's spec, router and this server's shard of it."""

    def __init__(self, spec, router, store):
        self.spec, self.router, self.shard = spec, router, ShardTable(store)
        self.store = store

    def lookup_lock(self):
        """The lock a lookup takes: exclusive when the store inserts on read."""
        return self.shard.write() if self.shard.inserts_on_read else self.shard.read()


class StoreTables:
    """The dynamic tables of one server; see the module docstring.

    Args:
        server_id, num_servers: this server's place; it holds the keys
            each table's router sends to ``server_id``.
        num_threads: OpenMP threads of the update kernels.
        has_array: ``has_array(name) -> bool``: whether ``name`` is an array table here
            (a name is one or the other).
    """

    def __init__(self, server_id, num_servers, num_threads=1, has_array=None):
        self.server_id, self.num_servers, self.num_threads = server_id, num_servers, num_threads
        self._has_array = has_array or (lambda name: False)
        self._tables = {}
        self._lock = threading.Lock()  # the dict above

    def handlers(self):
        """{service: handler(message, session=None)} of every STORE_* request but
        STORE_UPDATE (the service applies updates through :meth:`apply`, see there)."""
        return {Service.STORE_CREATE: self.create, Service.STORE_OPT_INIT: self.opt_init,
                Service.STORE_READ: self.read, Service.STORE_WRITE: self.write,
                Service.STORE_REMOVE: self.remove, Service.STORE_INFO: self.info,
                Service.STORE_EXPORT: self.export, Service.STORE_SAVE: self.save,
                Service.STORE_LOAD: self.load}

    def has(self, name):
        return name in self._tables

    def table(self, name):
        try:
            return self._tables[name]
        except KeyError:
            raise KVStoreError(f"server {self.server_id} has no dynamic table "
                               f"{name!r}") from None

    def drop(self, name):
        with self._lock:
            t = self._tables.pop(name, None)
        if t is not None:
            with t.shard.write():
                t.store.close()  # a file store flushes and unlocks its directory

    def close(self):
        """Close every store (file stores flush): the server is exiting."""
        for name in list(self._tables):
            self.drop(name)

    # -- handlers ---------------------------------------------------------------------

    def create(self, m, session=None):
        if not m.name or len(m.name) > 256 or not m.name.isprintable():
            raise KVStoreError(f"table name: expected 1..256 printable characters, got "
                               f"{m.name[:64]!r}")
        if not 1 <= m.dim <= MAX_DIM or m.capacity < 0:
            raise KVStoreError(f"dynamic table {m.name!r}: expected 1 <= dim <= {MAX_DIM} and "
                               f"capacity >= 0, got dim {m.dim}, capacity {m.capacity}")
        fields = {f: getattr(m, f) for f in type(m).FIELDS}
        try:
            spec = spec_from_fields(fields)
        except (TypeError, ValueError) as e:
            raise KVStoreError(f"table {m.name!r}: {e}") from None
        with self._lock:
            if self._has_array(m.name):
                raise KVStoreError(f"name {m.name!r} is an array table on server "
                                   f"{self.server_id}, not a dynamic one")
            have = self._tables.get(m.name)
            if have is not None:
                if have.spec != spec:
                    raise KVStoreError(f"table {m.name!r} exists with {have.spec}, "
                                       f"asked for {spec}")
                return Reply(fields={"existed": True})
            store = spec.make_store(self.server_id, self.num_servers)
            self._tables[m.name] = _Table(spec, spec.router(self.num_servers), store)
        return Reply(fields={"existed": False})

    def opt_init(self, m, session=None):
        t = self.table(m.name)
        rule_of(m.rule)  # an unknown rule fails before the table changes
        with t.shard.write():
            init_state_columns(t.store, m.rule, m.options)
        t.shard.bump_all()  # cached copies of the state are void

    def _local(self, t, m):
        """The store's keys of ``m.ids``; KVStoreError when a key is not this server's (a
        trainer routed it with another server count: its rows would be lost to every
        other trainer) or outside a fixed key space."""
        if not len(m.ids):
            return m.ids
        try:
            owner = t.router.part_of(m.ids)
        except PartitionError as e:
            raise KVStoreError(f"{m.name!r}: {e}") from None
        if (owner != self.server_id).any():
            bad = int(np.flatnonzero(owner != self.server_id)[0])
            raise KVStoreError(f"key {int(m.ids[bad])} of {m.name!r} belongs to server "
                               f"{int(owner[bad])} of {self.num_servers}, not server "
                               f"{self.server_id}")
        return t.router.to_local(self.server_id, m.ids)

    def read(self, m, session=None):
        t = self.table(m.name)
        keys = self._local(t, m)
        if m.mode == "lookup":
            if m.column != WEIGHT:
                raise KVStoreError(f"lookup of {m.name!r}: reads the weight, not column "
                                   f"{m.column!r}")
            with t.lookup_lock():
                return Reply(arrays=[t.store.lookup(keys)])
        with t.shard.read():
            if m.mode == "contains":
                return Reply(arrays=[t.store.find(keys) >= 0])
            if m.column not in t.shard.columns():
                t.store.column(None)  # the StoreError naming the columns
            return Reply(arrays=[t.store.gather(keys, m.column, insert=False)])

    def write(self, m, session=None):
        t = self.table(m.name)
        keys = self._local(t, m)
        with t.shard.write():
            shape, dtype = t.shard.columns().get(m.column, (None, None))
            if shape is None:
                raise StoreError(f"column: no column {m.column!r} in {m.name!r} (has "
                                 f"{sorted(t.shard.columns())})")
            want = "float32" if m.column == WEIGHT else dtype
            if m.values.dtype.name != want or m.values.shape[1:] != tuple(shape):
                raise StoreError(f"values of {m.name!r}.{m.column}: expected {want} rows of "
                                 f"shape {tuple(shape)}, got {m.values.dtype} "
                                 f"{m.values.shape[1:]}")
            t.store.scatter(keys, m.values, m.column)
            t.shard.bump(t.store.slots(keys))

    def remove(self, m, session=None):
        t = self.table(m.name)
        if t.spec.fixed_keys:
            raise StoreError(f"remove: {m.name!r} is a {t.spec.kind} table, which holds the "
                             f"fixed keys 0..{t.router.num_keys - 1}; only hash tables "
                             "remove keys")
        with t.shard.write():
            return Reply(fields={"removed": t.store.remove(m.ids)})

    def info(self, m, session=None):
        t = self.table(m.name)
        if m.evict_to >= 0 and t.spec.fixed_keys:
            raise StoreError(f"evict: {m.name!r} is a {t.spec.kind} table, which holds the "
                             f"fixed keys 0..{t.router.num_keys - 1}; only hash tables evict")
        with t.shard.write():
            evicted = np.empty(0, np.int64)
            if m.evict_to >= 0:
                evicted = t.store.evict(m.evict_to, m.policy or None)
            cols = {c: [list(s), d] for c, (s, d) in t.shard.columns().items()}
            return Reply(fields={"size": t.store.size(), "capacity": t.store.capacity,
                                 "columns": cols}, arrays=[evicted])

    def export(self, m, session=None):
        t = self.table(m.name)
        with t.shard.read():
            have = t.shard.columns()
            cols = list(m.columns) or list(have)
            missing = [c for c in cols if c not in have]
            if missing:
                raise StoreError(f"columns: {missing} not in {m.name!r} (has {sorted(have)})")
            keys = t.store.keys()
            sel = keys[m.start:m.start + m.count]
            slots = t.store.slots(sel) if len(sel) else np.empty(0, np.int64)
            rows = [t.store.decode(t.store.column(c)[slots]) if c == WEIGHT
                    else t.store.column(c)[slots] for c in cols]
            return Reply(fields={"total": int(len(keys)), "columns": cols},
                         arrays=[t.router.to_global(self.server_id, sel)] + rows)

    def check_update(self, m):
        """Check an update against its table before it is applied (or buffered)."""
        t = self.table(m.name)
        self._local(t, m)
        m.hyper = rule_of(m.rule).hyper_from(m.hyper)
        if m.grads.dtype != np.float32 or m.grads.ndim != 2 or \
                m.grads.shape[1] != t.spec.dim:
            raise KVStoreError(f"grads of {m.name!r}: expected float32 rows of {t.spec.dim}, "
                               f"got {m.grads.dtype} {m.grads.shape[1:]}")

    def apply(self, contribs):
        """Apply the updates ``contribs`` (one trainer's, or every trainer's step in
        sync_exact mode) as one: their gradients of equal keys summed, one update."""
        first = contribs[0]
        t = self.table(first.name)
        ids = np.concatenate([c.ids for c in contribs])
        grads = np.concatenate([c.grads for c in contribs])
        # summing also makes a hostile request's duplicate keys harmless
        uniq, summed = kernels.dedup_sum(ids, np.ascontiguousarray(grads),
                                         num_threads=self.num_threads)
        impl = rule_of(first.rule)
        keys = t.router.to_local(self.server_id, uniq)
        with t.shard.write():
            t.store.update(impl, keys, summed, first.hyper, self.num_threads)
            t.shard.bump(t.store.slots(keys), len(contribs))
        return {}

    def save(self, m, session=None):
        t = self.table(m.name)
        with t.shard.read():
            rec = store_snapshot.save_store(
                m.directory, m.save_id, m.name, self.server_id, t.store,
                lambda keys: t.router.to_global(self.server_id, keys), t.shard.columns())
        return Reply(fields={"record": rec})

    def load(self, m, session=None):
        t = self.table(m.name)
        entry = snapshot.tensor_entry(snapshot.read_manifest(m.directory), m.name,
                                      m.directory)
        store_snapshot.check_entry(entry, m.name, t.spec.dim, m.directory)
        with t.shard.write():
            if not t.spec.fixed_keys:  # a fixed key set: the checkpoint overwrites each key
                t.store.remove(t.store.keys())
            store_snapshot.load_store(m.directory, entry, t.store,
                                      lambda keys: t.router.owns(self.server_id, keys),
                                      lambda keys: t.router.to_local(self.server_id, keys))
        t.shard.bump_all()  # cached copies of every row are void
