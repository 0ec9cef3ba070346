"""The keyed tables of a collective job: row stores sharded across the ranks by a router.

A mixin of :class:`~distemb.kvstore.collective.CollectiveKVClient` (it uses that client's
exchange, routing and in-process server), beside its dense tables in one namespace;
:mod:`distemb.kvstore.keyed` has what keyed tables do differently at every client.

Rank ``r`` of ``W`` holds one store per keyed table, made from the table's spec as a
server makes its shard (:meth:`~distemb.stores.spec.HashTableSpec.make_store` of part
``r`` of ``W``), with the keys the table's router gives it: a dynamic table
(``DynamicEmbedding``, any int64 key) the keys ``k`` with ``key_partition(k, W) == r``,
a file-backed table (``StoreEmbedding(FileTableSpec)``) a range of 0..N-1. Lookups,
writes and updates are the client's own rounds (a lookup is a find-or-insert on the
owner: a new key's row is the initialiser's row of that key, whichever rank asked), so a
step of a keyed table is exact as a dense table's: one process stepping on the
concatenated batch, with the same keys.

Key management is collective, as every call of this client (every rank makes it, in the
same order):

- ``size``: the sum of every rank's count (an exchange: ``data_meta`` of a keyed table
  therefore gives ``(None, dim)``, its key count being a collective question);
- ``contains``, ``get``: each rank asks about its own keys; the owners answer;
- ``remove``: each rank removes its own keys; it gets the count of those present that
  its call removed (over all ranks, the count of one process removing them all);
- ``evict``: every rank evicts its store down to its share of the target by its own
  LRU/LFU order (as each server does), and gets every rank's evicted keys;
- ``export``: every rank gets the whole table (keys ascending); ``import_``: each rank's
  keys go to their owners;
- checkpoints (the client's ``save_table``/``load_table``): every rank writes its own
  store as one record of the table's entry, keys global, in the format of the servers
  and the embedded store (loads into any number of ranks or servers, and back);
- a keyed table's optimizer state is read and written by its KVStore name (``pull`` and
  ``push`` of held keys, routed as the table's keys), as on the other placements.

Example (inside a collective job)::

    kv.create_table("users", HashTableSpec(16, init=key_normal(16, std=0.1)))
    rows = kv.pull("users", np.array([2**40, -3]))   # inserted on their owners
"""
import dataclasses

import numpy as np

from distemb.errors import KVStoreError, MissingKeyError, StoreError
from distemb.kernels.hashtable import keys_array, table_keys
from distemb.kvstore.exchange import KEYS, Payload
from distemb.kvstore.keyed import ShardedKeyedTables
from distemb.kvstore.types import DataMeta
from distemb.stores.init import KeyInit
from distemb.stores.types import WEIGHT


class CollectiveKeyedTables(ShardedKeyedTables):
    """The keyed tables of :class:`~distemb.kvstore.collective.CollectiveKVClient`: a
    store per rank per table; see the module docstring. The client's storage methods
    serve keyed tables through :meth:`_rows_of`, its routers and its server's shards;
    what only keyed tables have is here."""

    shard_holder = "rank"

    def _init_collective_keyed(self):
        self._init_keyed()

    def data_meta(self, name):
        """A keyed table's (None, dim) float32 rows and no policy: how many keys it holds
        is a collective question (:meth:`size`), and metadata is asked outside steps."""
        if self.is_keyed(name):
            return DataMeta((None, self.dim(name)), "float32", None)
        return super().data_meta(name)


    def _shard(self, name):
        """This rank's ShardTable of keyed table ``name``."""
        self._spec(name)
        return self.server.table(name, self.rank)

    def _everyone(self, what, name, arrays):
        """Send ``arrays`` (this rank's) to every rank: each rank's, in rank order (a
        header round, so ranks in other calls raise)."""
        payload = Payload(self.world_size)
        head = np.array([len(a) for a in arrays], np.int64)
        for d in range(self.world_size):
            payload.add(d, head)
            for a in arrays:
                payload.add(d, a)
        got = self._x.round(KEYS, [f"{what} of", name], payload)
        out = []
        for src in range(self.world_size):
            n = got.take(src, np.int64, (len(arrays),))
            out.append([got.take(src, a.dtype, (int(k),) + a.shape[1:]).copy()
                        for a, k in zip(arrays, n)])
        return out

    # -- tables -------------------------------------------------------------------------

    def create_table(self, name, spec):
        """Collective: every rank makes its store of keyed table ``name`` from ``spec``.

        Raises:
            KVStoreError: the ranks' specs differ (every rank raises, naming the first
                that differs), or ``name`` exists with another spec or as a dense table.
        """
        init = spec.init
        self._agree("creation", name, {
            "kind": spec.kind, "exists": name in self.names(),
            **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
               if f.name != "init"},
            # a KeyInit by its parameters; a function of the user's by its name
            "init": repr(init.spec()) if isinstance(init, KeyInit) else
            getattr(init, "__qualname__", type(init).__name__)})
        if self._exists(name, spec):
            return
        if name in self._meta:
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        store = spec.make_store(self.rank, self.world_size)
        self.server.add_table(name, self.rank, store, spec, spec.router(self.world_size))
        self._specs[name] = spec
        self._routers[name] = spec.router(self.world_size)

    # -- keys -----------------------------------------------------------------------------

    def size(self, name):
        """Keys held by every rank (collective)."""
        t = self._shard(name)
        with t.read():
            mine = np.array([t.store.size()], np.int64)
        return int(sum(a[0][0] for a in self._everyone("size", name, [mine])))

    def _fixed(self, name, what):
        spec = self._spec(name)
        if spec.fixed_keys:
            raise StoreError(f"{what}: {name!r} is a {spec.kind} table, which holds the "
                             f"fixed keys 0..{self._routers[name].num_keys - 1}; only hash "
                             f"tables {what} keys")

    def contains(self, name, keys):
        """Whether each key is held (False outside a fixed key space: every rank still
        takes part in the exchange, asking about the others)."""
        t = self._shard(name)
        keys = table_keys(keys)

        def answer(_, ids):
            local = self._at_owner(name, ids)[0][2]
            with t.read():
                return t.store.find(local) >= 0
        out = self._routers[name].inside(keys)
        out[out] = self._ask(KEYS, [name], [keys[out]], answer,
                             lambda _: (np.dtype(bool), ()), label=["contains", name])[0]
        return out

    def get(self, name, keys):
        """Rows of ``keys`` without inserting them (each rank asks about its own).

        Raises:
            MissingKeyError: on the ranks that asked about a key no rank holds.
        """
        keys = table_keys(keys)
        t, dim = self._shard(name), self.dim(name)

        def answer(_, ids):
            local = self._at_owner(name, ids)[0][2]
            out = np.zeros((len(local), dim + 1), np.float32)
            with t.read():
                found = t.store.find(local) >= 0
                if found.any():
                    out[found, :dim] = t.store.gather(local[found], insert=False)
            out[:, dim] = found
            return out
        got = self._ask(KEYS, [name], [keys], answer,
                        lambda _: (np.dtype(np.float32), (dim + 1,)), label=["get", name])[0]
        missing = np.flatnonzero(got[:, dim] == 0)
        if len(missing):
            raise MissingKeyError(f"get: key {int(keys[missing[0]])} is not in the store of "
                                  f"table {name!r} ({len(missing)} of {len(keys)} keys "
                                  "missing)")
        return np.ascontiguousarray(got[:, :dim])

    def remove(self, name, keys):
        """Remove each rank's ``keys``; how many of them were present (a key asked by
        several ranks counts for the first, in rank order)."""
        self._fixed(name, "remove")
        t = self._shard(name)

        def answer(_, ids):
            local = self._at_owner(name, ids)[0][2]
            with t.write():
                present = t.store.find(local) >= 0
                first = np.zeros(len(local), bool)
                first[np.unique(local, return_index=True)[1]] = True
                t.store.remove(local)
            return present & first
        got = self._ask(KEYS, [name], [table_keys(keys)], answer,
                        lambda _: (np.dtype(bool), ()), label=["remove", name])[0]
        return int(got.sum())

    def evict(self, name, target_size, policy=None):
        """Every rank evicts its store down to its share of ``target_size`` by its own
        order (as each server does); every rank gets all the evicted keys."""
        self._fixed(name, "evict")
        if isinstance(target_size, bool) or not isinstance(target_size, (int, np.integer)) \
                or target_size < 0:
            raise ValueError(f"target_size: expected an int >= 0, got {target_size!r}")
        share = target_size // self.world_size + (self.rank < target_size % self.world_size)
        t = self._shard(name)
        with t.write():
            evicted = t.store.evict(share, policy)
        router = self._routers[name]
        mine = router.to_global(self.rank, np.asarray(evicted, np.int64))
        return np.concatenate([a[0] for a in self._everyone("evict", name, [mine])])

    def export(self, name, columns=None):
        """(keys ascending, {column: rows}) of the whole table, on every rank."""
        t = self._shard(name)
        with t.read():
            keys, cols = t.store.export()
        have = t.columns()
        cols = {c: a for c, a in cols.items() if c in have}
        if columns is not None:
            missing = [c for c in columns if c not in cols]
            if missing:  # the same on every rank: all raise before any exchange
                raise KVStoreError(f"columns: {missing} not in table {name!r} "
                                   f"(has {sorted(cols)})")
            cols = {c: cols[c] for c in columns}
        names = sorted(cols)
        keys = self._routers[name].to_global(self.rank, np.asarray(keys, np.int64))
        parts = self._everyone("export", name, [keys] + [np.ascontiguousarray(cols[c])
                                                         for c in names])
        allkeys = np.concatenate([p[0] for p in parts])
        order = np.argsort(allkeys, kind="stable")
        return allkeys[order], {c: np.concatenate([p[1 + i] for p in parts])[order]
                                for i, c in enumerate(names)}

    def import_(self, name, keys, columns):
        """Upsert each rank's ``keys`` with its rows of ``columns`` on their owners (the
        weight first: it inserts absent keys; state columns then overwrite)."""
        keys = keys_array(keys, "keys")
        t = self._shard(name)
        have = t.columns()
        missing = [c for c in columns if c not in have]
        if missing:
            raise StoreError(f"columns: {missing} not in table {name!r} (has {sorted(have)})")
        order = sorted(columns, key=lambda c: (c != WEIGHT, c))
        cols = []
        for c in order:
            values = np.ascontiguousarray(columns[c])
            if len(values) != len(keys):
                raise KVStoreError(f"columns[{c!r}]: expected {len(keys)} rows, got "
                                   f"{len(values)}")
            cols.append(values.astype(np.float32, copy=False) if c == WEIGHT else values)
        (ids, rows, _), = self._send(KEYS, [name], [self._routed(name, keys)], [cols],
                                     label=["import", name] + order)[0]
        local = self._at_owner(name, ids)[0][2]
        if len(local):
            with t.write():
                for c, r in zip(order, rows):
                    t.store.scatter(local, r, c)
                t.bump(local)

    def flush(self, name):
        t = self._shard(name)
        with t.read():
            t.store.flush()
