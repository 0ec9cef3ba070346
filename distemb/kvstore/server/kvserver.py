"""KVServer: owns named shards and runs the pull, push and update handlers.

A shard is one partition of one named tensor: a :class:`~distemb.kvstore.server.shard.ShardTable`
over a :class:`~distemb.stores.dense.DenseStore` whose weight column is the array the
server was given, with the table's optimizer-state arrays (``"<table>~opt~<state>"``)
held as columns of the same store. The server uses
numpy only (it never imports torch): embedded, it lives inside the trainer process and
its arrays are shared zero-copy with torch; in a cluster it runs in its own process.

Concurrency: the ShardTable's reader/writer lock guards a shard and its optimizer
state. Pulls hold it shared, pushes and updates exclusive, so a pull never sees a row
between an update's read and its write (no torn rows), pulls of one shard run in
parallel, and shards are updated in parallel. Readers outside the process (trainers
mapping the shard from /dev/shm) cannot take the lock: each write also makes the
shard's seqlock counters odd while it runs (see :mod:`distemb.transport.shm`).

Example:
    >>> import numpy as np
    >>> srv = KVServer()
    >>> srv.create("w", 0, np.zeros((4, 2), np.float32))
    >>> srv.push("w", 0, np.array([1]), np.ones((1, 2), np.float32))
    >>> srv.pull("w", 0, np.array([1, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
"""
import threading
from typing import Optional

import numpy as np

from distemb.errors import KVStoreError, StoreError
from distemb.kernels import half
from distemb.kvstore.server.shard import VERSION_EPOCH, ShardTable
from distemb.rules import Hyper, rule_of, state_name, state_owner
from distemb.stores.dense import DenseStore
from distemb.stores.types import WEIGHT

class KVServer:
    """Holds shards ``(name, part) -> array`` and applies requests to them.

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

    def create(self, name, part, array, owner=None, version=None, rounding_seed=None):
        """Own ``array`` as shard ``part`` of ``name``.

        Args:
            owner: the table whose shard ``part`` this one is optimizer state of (by
                default the table :func:`~distemb.rules.state_owner` names, when this
                server holds its shard): the array becomes a column of that table's
                store, so an update of both is one critical section.
            version: a 1-element int64 array this server makes odd while it writes the
                shard (the counter of a shared-memory shard), or None.
            rounding_seed: for a bfloat16 shard, round its updates stochastically from
                this seed (mixed with ``part``); None rounds half rows to nearest-even.

        Half-precision shards (``numpy.float16``, or :data:`~distemb.kernels.half.BFLOAT16`
        bits) are updated by the half kernels: float32 maths and state, rounded on store.

        Raises:
            KVStoreError: the shard exists, or a state's rows differ from its table's.
        """
        key = (name, part)
        owner = owner or state_owner(name)
        with self._meta_lock:
            if key in self._shards:
                raise KVStoreError(f"shard {part} of {name!r} already exists on server "
                                   f"{self.server_id}")
            table = self._tables.get((owner, part)) if owner else None
            if table is not None:
                column = name[len(state_name(owner, "")):]
                with table.write():
                    try:
                        table.store.adopt_column(column, array)
                    except StoreError as e:
                        raise KVStoreError(f"shard {part} of {name!r}: {e} (the rows of "
                                           f"shard {part} of {owner!r})") from None
            else:
                if rounding_seed is None:
                    store = DenseStore.from_array(array)
                else:
                    store = DenseStore.from_array(array, "stochastic",
                                                  half.shard_seed(rounding_seed, part))
                table, column = ShardTable(store, part=part, arrays=True), WEIGHT
                self._tables[key] = table
            self._shards[key] = (table, column)
            if version is not None:
                table.set_counter(column, version)

    def add_table(self, name, part, store, spec=None, router=None):
        """Hold ``store`` as shard ``part`` of table ``name``; returns its ShardTable.

        Args:
            store: a :class:`~distemb.stores.types.RowStore` (made from ``spec``, or a
                user's); it is closed when the shard is dropped.
            spec: the spec it was made from, or None.
            router: the table's router when requests carry the table's keys (a server's
                shard of a spec'd table), or None (the holder routes: one shard holds
                every key).

        Raises:
            KVStoreError: the shard exists.
        """
        with self._meta_lock:
            if (name, part) in self._shards:
                raise KVStoreError(f"shard {part} of {name!r} already exists on server "
                                   f"{self.server_id}")
            table = ShardTable(store, spec, router, part)
            self._tables[(name, part)] = table
            self._shards[(name, part)] = (table, WEIGHT)
        return table

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
        """Forget every shard of table ``name`` and of its optimizer state."""
        for name_, part in self.shards_of(name):
            self.drop_shard(name_, part)

    def shards_of(self, name):
        """``[(name, part)]`` of every shard of table ``name`` held here, its optimizer
        state's first (a table's state dies with it)."""
        keys = [k for k in list(self._shards) if k[0] == name or state_owner(k[0]) == name]
        return sorted(keys, key=lambda k: k[0] == name)

    def drop_shard(self, name, part):
        """Forget shard ``part`` of ``name`` (no-op when absent). Dropping a table's own
        shard while state shards of it remain keeps their arrays (their holder frees
        them: :meth:`shards_of` lists them first)."""
        with self._meta_lock:
            entry = self._shards.pop((name, part), None)
            if entry is None:
                return
            table, column = entry
            table.set_counter(column, None)
            if column == WEIGHT:
                self._tables.pop((name, part), None)
                if not table.arrays:  # its store is closed with it (a file flushes)
                    for key in [k for k, (t, _) in self._shards.items() if t is table]:
                        del self._shards[key]
                    with table.write():
                        table.store.close()
            elif table.arrays:
                with table.write():
                    table.store.drop_column(column)

    def close(self):
        """Close the stores of tables other than array tables (a file store flushes and
        unlocks its directory): the holder is exiting. Array shards are their holder's to
        free."""
        for name, part in [k for k, (t, c) in list(self._shards.items())
                           if c == WEIGHT and not t.arrays]:
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

    def update_later(self, name: str, part: int, local_ids, grads, rule, hyper: Hyper):
        """:meth:`update` in two halves (one trainer's gradients): checked, and the shard
        locked for writing with its seqlock counters odd, now; applied, and the lock
        released, by the function it returns (see :meth:`ShardTable.update_later
        <distemb.kvstore.server.shard.ShardTable.update_later>`).

        Returns:
            (the weight's seqlock counter while locked, or None when it has none; apply).

        Raises:
            KVStoreError: as :meth:`update`, before anything is locked.
        """
        table, impl, hyper = self._update_of(name, part, rule, hyper)
        return table.update_later(impl, local_ids, grads, hyper, self.num_threads)

    def save(self, name, shards, directory, save_id, columns=None):
        """Checkpoint records of ``shards`` (``[(part, start, step)]``: an array table's
        parts with their key progressions, a keyed table's shard with ``(0, 1)``) of
        table ``name``, its optimizer state with it (see :meth:`ShardTable.save
        <distemb.kvstore.server.shard_checkpoint.ShardCheckpoint.save>`)."""
        return [self.table(name, part).save(directory, save_id, name, columns, start, step)
                for part, start, step in shards]

    def load(self, name, shards, directory, entry, columns=None):
        """Fill ``shards`` (as :meth:`save`'s) of table ``name`` from its checkpoint
        ``entry``, all or nothing: every shard is checked before any is written.

        Raises:
            KVStoreError: see :meth:`ShardTable.load <distemb.kvstore.server.shard_checkpoint.ShardCheckpoint.load>`.
        """
        tables = [(self.table(name, part), start, step) for part, start, step in shards]
        passes = [{}] if len(tables) == 1 else [{"apply": False}, {"verify": False}]
        for kw in passes:  # one shard checks before it writes on its own
            for table, start, step in tables:
                table.load(directory, entry, columns, start, step, name=name, **kw)

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
