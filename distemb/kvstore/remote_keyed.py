"""The keyed tables of a cluster's trainer: row stores sharded over the servers by a router.

A mixin of :class:`~distemb.kvstore.remote.RemoteKVClient`, beside its array tables in
one namespace: reads, writes, updates and checkpoints are that client's, for every table
(its routing takes a keyed table's router where an array table's takes its policy); what
is here is a keyed table's creation and key management. :mod:`distemb.kvstore.keyed` has
what keyed tables do differently at every client.

Each server holds one store per table (:mod:`distemb.kvstore.server.catalog`), made there
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

from distemb.enums import EvictPolicy
from distemb.errors import KVStoreError, StoreError
from distemb.kernels import half
from distemb.kernels.hashtable import table_keys
from distemb.kvstore.keyed import ShardedKeyedTables
from distemb.rules import state_name
from distemb.stores.types import WEIGHT
from distemb.transport.messages import Create, Export, Get, Info, Remove

#: Bytes of rows per export or import request (well under any frame limit).
PAGE_BYTES = 16 << 20
IO_TIMEOUT_S = 6 * 3600.0  # a server writing or reading a checkpoint of a huge table


class RemoteKeyedTables(ShardedKeyedTables):
    """The keyed tables of :class:`~distemb.kvstore.remote.RemoteKVClient`: a store per
    server per table, keys placed by the table's router; see the module docstring."""

    def _init_remote_keyed(self):
        self._init_keyed()
        self._routers = {}

    def _all(self, make, timeout=None):
        return self._call({sid: make(sid) for sid in range(self.num_servers)},
                                timeout=timeout)

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
        self._spec(name)
        routes, _ = self._route(name, table_keys(keys))
        replies = self._call({sid: Remove(name=name, ids=r.ids) for sid, r in routes.items()})
        return int(sum(r.fields["removed"] for r in replies.values()))

    def contains(self, name, keys):
        """Whether each key is held (False outside a fixed key space, asked of no one)."""
        self._spec(name)
        keys = table_keys(keys)
        out = self._routers[name].inside(keys)
        out[out] = self._read(name, keys[out], lambda r: Get(
            name=name, mode="contains", column=WEIGHT, ids=r.ids), (), np.bool_, np.bool_)
        return out

    def get(self, name, keys):
        dim = self.dim(name)
        return self._read(name, table_keys(keys), lambda r: Get(
            name=name, mode="get", column=WEIGHT, ids=r.ids), (dim,), np.float32, np.float32)

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
            target = name if c == WEIGHT else state_name(name, c)
            for lo in range(0, len(keys), page):
                self._write(target, name, keys[lo:lo + page], values[lo:lo + page])

    def _encoded(self, name, values):
        """float32 weight rows of ``name`` in its storage dtype: half rows are rounded
        here (to nearest-even, as the store would), so they cross the wire in 2 bytes."""
        dtype = self._spec(name).dtype
        values = np.asarray(values, np.float32)
        return half.encode(values, dtype) if half.is_half(dtype) else values
