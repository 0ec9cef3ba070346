"""LocalKVClient: the embedded default, every shard of every table in this process.

The client holds an in-process :class:`~distemb.kvstore.server.kvserver.KVServer` and is
holder ``rank`` of ``num_holders`` of its tables' shards (shard ``p`` of a table is the
holder ``p % num_holders``'s): embedded it is the one holder of all of them; a
collective rank (:class:`~distemb.kvstore.collective.CollectiveKVClient`) is one of a
job's, and reads and writes here the keys the exchange brought it. Every table is read,
written, updated, checkpointed and has its keys managed through the shards'
:class:`~distemb.kvstore.server.shard.ShardTable` alike, whatever its store.

Example:
    >>> from distemb.partition import range_policy
    >>> from distemb.stores import HashStore
    >>> kv = LocalKVClient()
    >>> kv.init_data("t", (5, 2), "float32", range_policy(5))
    >>> kv.add_table("h", HashStore(2))
    >>> kv.pull("t", np.array([4])).shape, kv.pull("h", np.array([10**15, -7])).shape
    ((1, 2), (2, 2))
    >>> kv.size("h"), kv.contains("t", np.array([4, 5])).tolist()
    (2, [True, False])
"""
from typing import List, Tuple

import numpy as np

from distemb.kernels import half
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.tables import Table, TableClient, Tables
from distemb.rules import state_name
from distemb.stores.types import WEIGHT


def column_name(table: Table, column: str) -> str:
    """The KVStore name of ``column`` of ``table`` (the table's own, or its state's)."""
    return table.name if column == WEIGHT else state_name(table.name, column)


class LocalKVClient(TableClient):
    """Embedded KVClient: every shard of every table lives in this process.

    Args:
        server: the in-process :class:`KVServer` (a new one when None).
        num_threads: OpenMP threads of that server's kernels.

    Example:
        >>> from distemb.partition import range_policy
        >>> kv = LocalKVClient()
        >>> kv.init_data("t", (5, 2), "float32", range_policy(5))
        >>> kv.pull("t", np.array([4])).shape
        (1, 2)
    """

    #: This process's place among the holders of the tables' shards.
    rank = 0
    num_holders = 1

    def __init__(self, server=None, num_threads=1):
        self.server = server or KVServer(num_threads=num_threads)
        self.num_threads = self.server.num_threads
        self.tables = Tables(self)

    # -- the shards held here -------------------------------------------------------

    def held(self, table: Table) -> List[int]:
        """The shards of ``table`` this process holds."""
        return [p for p in range(table.router.num_parts)
                if p % self.num_holders == self.rank]

    def _shards(self, table: Table):
        return [self.server.table(table.name, p) for p in self.held(table)]

    def _split(self, table: Table, keys) -> List[Tuple[int, object, np.ndarray]]:
        """``[(shard, positions or None for all, store keys)]`` of ``keys`` of ``table``
        (all of them held here), checked by its router."""
        router = table.router
        groups = router.split(keys)
        if len(groups) == 1:
            (part, (_, mine)), = groups.items()
            return [(part, None, router.to_local(part, mine))]
        return [(p, pos, router.to_local(p, mine)) for p, (pos, mine) in groups.items()]

    def _make(self, name, spec, router):
        parts = [p for p in range(router.num_parts) if p % self.num_holders == self.rank]
        self.server.create_table(name, spec, router, parts)
        return set(parts)

    def delete_data(self, name):
        table = self.tables.drop(name)
        if table is not None:
            self.server.drop(name)  # a store is closed with its table (a file flushes)

    # -- rows -------------------------------------------------------------------------

    def _read(self, table, column, ids):
        shape, dtype = table.columns()[column]
        out = np.empty((len(ids),) + tuple(shape), half.row_dtype(dtype))
        kvname = column_name(table, column)
        if table.router.identity:  # one shard, keyed as the table: its store checks them
            return self.server.pull(kvname, 0, ids, out=out)
        for part, pos, local in self._split(table, ids):
            if pos is None:  # one shard, in order: in place
                return self.server.pull(kvname, part, local, out=out)
            out[pos] = self.server.pull(kvname, part, local,
                                        out=np.empty((len(local),) + tuple(shape), out.dtype))
        return out

    def _write(self, table, column, ids, rows):
        kvname = column_name(table, column)
        for part, pos, local in self._split(table, ids):
            self.server.push(kvname, part, local, rows if pos is None else rows[pos])

    def push_update(self, name, ids, grads, rule, hyper):
        table = self.tables.table(name)
        if table.router.identity:  # as in _read
            self.server.update(name, 0, ids, grads, rule, hyper)
            return
        for part, pos, local in self._split(table, ids):
            self.server.update(name, part, local, grads if pos is None else grads[pos],
                               rule, hyper)

    def _init_states(self, table, rule, options):
        for shard in self._shards(table):
            self.server.attach_states(table.name, shard.part,
                                      shard.init_states(rule, options))

    # -- keys -------------------------------------------------------------------------

    def size(self, name):
        total = 0
        for shard in self._shards(self.tables.table(name)):
            with shard.read():
                total += shard.store.size()
        return total

    def contains(self, name, keys):
        table = self.tables.table(name)
        keys = keys_array(keys)
        out = table.router.inside(keys)
        found = np.zeros(int(out.sum()), bool)
        for part, pos, local in self._split(table, keys[out]):
            found[slice(None) if pos is None else pos] = \
                self.server.table(name, part).contains(local)
        out[out] = found
        return out

    def get(self, name, keys):
        table = self.tables.table(name)
        keys = keys_array(keys)
        out = np.empty((len(keys),) + table.row_shape, np.float32)
        for part, pos, local in self._split(table, keys):
            out[slice(None) if pos is None else pos] = \
                self.server.table(name, part).get(local, name=name)
        return out

    def _remove(self, table, keys):
        return sum(self.server.table(table.name, part).remove(local, table.name)
                   for part, _, local in self._split(table, keys))

    def _evict(self, table, target_size, policy):
        shards = self._shards(table)
        n = max(1, len(shards))
        out = [np.empty(0, np.int64)]
        for i, shard in enumerate(shards):
            share = target_size // n + (i < target_size % n)
            out.append(table.router.to_global(shard.part,
                                              shard.evict(share, policy, table.name)))
        return np.concatenate(out)

    def _export(self, table, columns):
        return [shard.export(columns=columns, name=table.name)
                for shard in self._shards(table)]

    def flush(self, name):
        for shard in self._shards(self.tables.table(name)):
            with shard.read():
                shard.store.flush()

    def store(self, name):
        """The RowStore of table ``name`` when one store holds it (a table of one shard).

        Raises:
            KVStoreError: no such table. AttributeError: its rows are in several shards.
        """
        shards = self._shards(self.tables.table(name))
        if len(shards) != 1:
            raise AttributeError(f"{name!r} is {len(shards)} shards held by "
                                 f"{type(self).__name__}: it has no one row store")
        return shards[0].store

    # -- checkpoints ------------------------------------------------------------------

    def _save(self, table, directory, save_id, columns, parent):
        return self.server.save(table.name, self.held(table), directory, save_id, columns,
                                parent)

    def _load(self, table, directory, entry, columns):
        self.server.load(table.name, self.held(table), directory, entry, columns)

    def close(self):
        """Drop every table; stores are flushed and closed."""
        for table in self.tables.tables():
            self.delete_data(table.name)
        self.closed = True
