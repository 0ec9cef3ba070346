"""KVServer: owns named shards and runs the pull, push and update handlers.

A shard is one part of one table: a :class:`~distemb.kvstore.server.shard.ShardTable`
over the store its spec makes (:mod:`distemb.stores.spec`: dense rows, a hash table, a
file), with the table's optimizer state (``"<table>~opt~<state>"``) as columns of the
same store. The server uses numpy only (it never imports torch): embedded, it lives
inside the trainer process and its arrays are shared zero-copy with torch; in a cluster
it runs in its own process.

Concurrency: the ShardTable's reader/writer lock guards a shard and its optimizer
state. Pulls hold it shared, pushes and updates exclusive, so a pull never sees a row
between an update's read and its write (no torn rows), pulls of one shard run in
parallel, and shards are updated in parallel. Readers outside the process (trainers
mapping the shard from /dev/shm) cannot take the lock: each write also makes the
shard's seqlock counters odd while it runs (see :mod:`distemb.transport.shm`).

Example:
    >>> import numpy as np
    >>> from distemb.stores.dense import DenseSpec
    >>> srv = KVServer()
    >>> spec = DenseSpec((4, 2))
    >>> _ = srv.create_table("w", spec, spec.router(), [0])
    >>> srv.push("w", 0, np.array([1]), np.ones((1, 2), np.float32))
    >>> srv.pull("w", 0, np.array([1, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
"""
import threading
from typing import Optional

import numpy as np

from distemb.errors import KVStoreError
from distemb.kvstore.checkpoint.shards import load_shard, save_shard
from distemb.kvstore.checkpoint.sink import make_sink
from distemb.kvstore.server.shard import VERSION_EPOCH, ShardTable
from distemb.rules import Hyper, rule_of, state_name
from distemb.stores.types import WEIGHT

class KVServer:
    """Holds shards ``(name, part) -> ShardTable`` and applies requests to them.

    Each table's shard is one :class:`~distemb.kvstore.server.shard.ShardTable`; the shards of
    its optimizer state (named ``state_name(table, state)``) are columns of that table's
    store, so they share its lock, seqlock and row versions.

    Args:
        server_id: this server's rank among the servers.
        num_threads: OpenMP threads for gather and update kernels.
    """

    def __init__(self, server_id=0, num_threads=1):
        self.server_id = server_id
        self.num_threads = num_threads
        self._tables = {}  # (table, part) -> ShardTable
        self._shards = {}  # (name, part) -> (ShardTable, column): weights and states
        self._meta_lock = threading.Lock()  # the two dicts above and the epoch count
        self._epochs = 0

    def create_table(self, name, spec, router, parts, allocator=None, make=None):
        """Make shards ``parts`` of table ``name`` from ``spec`` (each store made by
        ``spec.make_store``, its columns through ``allocator`` where the store takes one,
        or by ``make(part)`` where its holder makes it: a device client's; the
        ShardTables route by ``router``), all or none; returns their ShardTables.

        Raises:
            KVStoreError: a shard exists. StoreError: a store cannot be made, or a given
                store backs another table (those made are closed again).
        """
        made = []
        try:
            for part in parts:
                kw = {} if allocator is None else {"allocator": allocator}
                store = make(part) if make is not None else \
                    spec.make_store(part, router.num_parts, **kw)
                made.append(store)
                store.claim(name)
        except BaseException:
            for store in made:
                if store.owner == name:
                    store.close()
            raise
        with self._meta_lock:
            taken = [p for p in parts if (name, p) in self._shards]
            if taken:
                for store in made:
                    store.close()
                raise KVStoreError(f"shard {taken[0]} of {name!r} already exists on server "
                                   f"{self.server_id}")
            tables = []
            for part, store in zip(parts, made):
                table = ShardTable(store, router, part, spec,
                                   make_sink(spec.sink, name, part))
                self._tables[(name, part)] = table
                self._shards[(name, part)] = (table, WEIGHT)
                tables.append(table)
        return tables

    def attach_states(self, name, part, states):
        """Name the state columns ``states`` of table ``name``'s store (made by the store
        itself) as its shards ``state_name(name, state)``."""
        table = self.table(name, part)
        with self._meta_lock:
            for key in [k for k, (t, c) in self._shards.items() if t is table and c != WEIGHT]:
                del self._shards[key]
            for state in states:
                self._shards[(state_name(name, state), part)] = (table, state)

    def drop(self, name):
        """Forget every shard of table ``name`` (its optimizer state with it: columns of
        its stores, which are closed; a file store keeps its files)."""
        for part in self.parts_of(name):
            self.drop_shard(name, part)

    def drop_shard(self, name, part):
        """Forget shard ``part`` of ``name`` (no-op when absent): a table's closes its store
        and forgets its state's names; a state's drops that column of the table's store."""
        with self._meta_lock:
            entry = self._shards.pop((name, part), None)
            if entry is None:
                return
            table, column = entry
            table.set_counter(column, None)
            if column == WEIGHT:  # its store is closed with it (a file flushes)
                self._tables.pop((name, part), None)
                for key in [k for k, (t, _) in self._shards.items() if t is table]:
                    del self._shards[key]
                with table.write():
                    table.store.close()
            else:
                with table.write():
                    table.store.drop_column(column)

    def close(self):
        """Close every store (a file store flushes and unlocks its directory): the holder
        is exiting."""
        for name, part in [k for k, (t, c) in list(self._shards.items()) if c == WEIGHT]:
            self.drop_shard(name, part)

    def _entry(self, name, part):
        try:
            return self._shards[(name, part)]
        except KeyError:
            raise KVStoreError(f"server {self.server_id} has no shard {part} of "
                               f"{name!r}") from None

    def table(self, name, part):
        """The :class:`~distemb.kvstore.server.shard.ShardTable` of shard ``part`` of ``name``
        (a state's name gives its table's)."""
        return self._entry(name, part)[0]

    def row_dtype(self, name, part):
        """The dtype of shard ``part`` of ``name``'s rows in requests and replies: a
        table's :attr:`~distemb.kvstore.server.shard.ShardTable.wire_dtype`, a state's own."""
        table, column = self._entry(name, part)
        return table.wire_dtype if column == WEIGHT else table.store.column(column).dtype

    def has(self, name, part):
        return (name, part) in self._shards

    def parts_of(self, name):
        """Partition ids of ``name`` held here."""
        return [p for (n, p) in list(self._shards) if n == name]

    def shard(self, name, part):
        """The array of shard ``part`` of ``name`` (shared, not copied)."""
        table, column = self._entry(name, part)
        return table.store.column(column)

    def pull(self, name, part, local_ids, out=None, access=True):
        """Rows ``local_ids`` of the shard, into ``out`` when given (see
        :meth:`ShardTable.pull <distemb.kvstore.server.shard.ShardTable.pull>`)."""
        table, column = self._entry(name, part)
        return table.pull(local_ids, column, out, self.num_threads, access)

    def versions(self, name, part, local_ids, insert=True):
        """Write counters of rows ``local_ids`` of shard ``part`` of ``name`` (see
        :meth:`ShardTable.versions <distemb.kvstore.server.shard.ShardTable.versions>`).

        A row's version changes with every write of the row or of its optimizer state;
        an update adds the number of trainers' gradients it applied (sync_exact sums).
        The counters are made on first use, each table's from a new epoch.
        """
        table = self.table(name, part)
        first = None
        if not table.tracks_versions:
            with self._meta_lock:
                self._epochs += 1
                first = self._epochs * VERSION_EPOCH
        return table.versions(local_ids, first, insert)

    def bump_all(self, name, part):
        """Change every version of shard ``part`` of ``name`` (its state was reset)."""
        self.table(name, part).bump_all()

    def push(self, name, part, local_ids, values):
        """Write rows ``local_ids`` of the shard (float32 values into a half shard are
        rounded to nearest-even)."""
        table, column = self._entry(name, part)
        table.push(local_ids, values, column)

    def update(self, name: str, part: int, local_ids, grads, rule, hyper: Hyper,
               contributions=1) -> Optional[np.ndarray]:
        """Apply optimizer rule ``rule`` in place to unique rows ``local_ids``.

        ``contributions`` (an int, or one per id) is how many trainers' gradients each
        row's sum holds; it is added to the rows' versions.

        Returns:
            the rows' versions before the update (None while the shard has none).

        Raises:
            KVStoreError: no such shard, state or rule, or ``hyper`` is not the rule's type.
        """
        table, impl, hyper = self._update_of(name, part, rule, hyper)
        return table.update(impl, local_ids, grads, hyper, self.num_threads, contributions)

    def update_later(self, name: str, part: int, local_ids, grads, rule, hyper: Hyper,
                     first=0):
        """:meth:`update` in two halves (one trainer's gradients): checked, and the shard
        locked for writing with its seqlock counters odd, now; applied (the first
        ``first`` rows first), and the lock released, by the function it returns (see
        :meth:`ShardTable.update_later <distemb.kvstore.server.shard.ShardTable.update_later>`).

        Returns:
            (the weight's seqlock counter while locked, or None when it has none; apply).

        Raises:
            KVStoreError: as :meth:`update`, before anything is locked.
        """
        table, impl, hyper = self._update_of(name, part, rule, hyper)
        return table.update_later(impl, local_ids, grads, hyper, self.num_threads, first)

    def save(self, name, parts, directory, save_id, columns=None, parent=None):
        """Checkpoint records of shards ``parts`` of table ``name``, its optimizer state
        with it (:func:`~distemb.kvstore.checkpoint.shards.save_shard`): of every row, or
        with ``parent``, of the rows changed since that save (a delta).

        From the first save or load on, rows have versions: what a delta is made of."""
        self._track(name, parts)
        return [save_shard(self.table(name, part), directory, save_id, name, columns,
                           parent) for part in parts]

    def _track(self, name, parts):
        """Give the rows of shards ``parts`` of ``name`` versions (no-op once they have)."""
        for part in parts:
            self.versions(name, part, np.empty(0, np.int64), insert=False)

    def load(self, name, parts, directory, entry, columns=None):
        """Fill shards ``parts`` of table ``name`` from its checkpoint ``entry``, all or
        nothing: every shard is checked before any is written.

        Raises:
            KVStoreError: see :func:`~distemb.kvstore.checkpoint.shards.load_shard`.
        """
        tables = [self.table(name, part) for part in parts]
        self._track(name, parts)
        passes = [{}] if len(tables) == 1 else [{"apply": False}, {"verify": False}]
        for kw in passes:  # one shard checks before it writes on its own
            for table in tables:
                load_shard(table, directory, entry, columns, name=name, **kw)

    def _update_of(self, name, part, rule, hyper):
        """(table, rule, checked hyperparameters) of an update of shard ``part``."""
        impl = rule_of(rule)
        hyper = impl.check_hyper(hyper)
        table, column = self._entry(name, part)
        if column != WEIGHT:
            raise KVStoreError(f"update: {name!r} is optimizer state of a table, not a "
                               "table")
        have = table.store.columns()
        for s in impl.states:
            if s.name not in have:
                self.shard(state_name(name, s.name), part)  # the error naming it
        return table, impl, hyper
