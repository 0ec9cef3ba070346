"""ShardCheckpoint: how a :class:`~distemb.kvstore.shard.ShardTable` writes and reads
its checkpoint records (the format is :mod:`distemb.kvstore.snapshot`'s).

An array table's rows are saved as the keys of its policy's progression; a store's with
its keys (as the table's keys, by its router). A load is all or nothing, and a store of
any key takes the saved keys its router gives it, as many as its capacity allows.

Example:
    >>> import tempfile
    >>> from distemb.kvstore.shard import ShardTable
    >>> from distemb.stores import DenseStore, HashStore
    >>> d = tempfile.mkdtemp()
    >>> a = ShardTable(DenseStore(3, 2))
    >>> a.push(np.array([1]), np.ones((1, 2), np.float32))
    >>> entry = snapshot.new_entry((3, 2), "float32", [a.save(d, "0123abcd", "t")])
    >>> b = ShardTable(HashStore(2))  # any key: it holds the saved keys afterwards
    >>> b.load(d, entry, name="t")
    >>> b.store.keys().tolist(), b.pull(np.array([1])).tolist()
    ([0, 1, 2], [[1.0, 1.0]])
"""
import numpy as np

from distemb.errors import KVStoreError, StoreError
from distemb.kvstore import snapshot
from distemb.kvstore.limits import check_fits
from distemb.stores.types import WEIGHT


class ShardCheckpoint:
    """Mixin of :class:`~distemb.kvstore.shard.ShardTable`: its :meth:`save` and
    :meth:`load` (it has ``store``, ``router``, ``part``, ``arrays``, the locks, the
    versions and the columns)."""

    def _saved_columns(self, columns):
        """``{column: (row_shape, dtype)}`` of ``columns`` (None: every one) as a
        checkpoint holds them: an array table's in their storage dtype, a store's weight
        as float32 (what it reads and writes)."""
        have = self.columns()
        names = list(have) if columns is None else list(columns)
        try:
            self._columns_of(names, "the shard")
        except StoreError as e:
            raise KVStoreError(f"checkpoint: {e}") from None
        return {c: (tuple(have[c][0]), "float32" if c == WEIGHT and not self.arrays
                    else have[c][1]) for c in names}

    def save(self, directory, save_id, name, columns=None, start=0, step=1):
        """Write ``columns`` (None: every one) of this shard of table ``name`` as a
        checkpoint record (:func:`~distemb.kvstore.snapshot.write_shard`).

        An array table's row ``k`` is the table's key ``start + k * step`` (its policy's
        progression); each block is copied under the read lock, so a save runs beside
        training and each block is consistent. A store's keys are saved with its rows
        (as the table's keys, by the router), the whole shard under the read lock.
        """
        cols = self._saved_columns(columns)
        if self.arrays:
            def reader(col):
                arr = self.store.column(col)

                def read(lo, hi):
                    with self.read():
                        return arr[lo:hi].copy()
                return read
            return snapshot.write_shard(
                directory, save_id, name, self.part, self.store.capacity,
                {c: (shape, dtype, reader(c)) for c, (shape, dtype) in cols.items()},
                start=start, step=step)
        with self.read():  # a store's slots move as it inserts: still for the whole save
            keys = self.store.keys()
            slots = self.store.slots(keys) if len(keys) else np.empty(0, np.int64)
            saved = keys if self.router is None else self.router.to_global(self.part, keys)

            def reader(col):
                return lambda lo, hi: self.store.read_rows(col, slots[lo:hi])
            return snapshot.write_shard(
                directory, save_id, name, self.part, len(keys),
                {c: (shape, dtype, reader(c)) for c, (shape, dtype) in cols.items()},
                keys=lambda lo, hi: saved[lo:hi])

    def load(self, directory, entry, columns=None, start=0, step=1, verify=True, apply=True,
             name="the shard"):
        """Fill ``columns`` (None: every one) of this shard from a table's checkpoint
        entry (:func:`~distemb.kvstore.snapshot.table_entry`), all or nothing.

        An array table's rows are keys ``start + k * step`` and must be covered exactly
        once. A store takes the saved keys its router gives this shard (all of them
        without a router); one that inserts holds the checkpoint's keys only afterwards.
        Every version changes (cached copies of the rows are void). ``verify`` and
        ``apply`` split the load into its checking and writing passes (a load of several
        shards checks them all first: :func:`~distemb.kvstore.snapshot.load_shard`).
        ``name`` names the table in errors.

        Raises:
            KVStoreError: see :func:`~distemb.kvstore.snapshot.load_shard`; a load that
                would not fit in memory.
        """
        cols = self._saved_columns(columns)
        if self.arrays:
            def write(col, local, rows):
                with self.write():
                    self.store.column(col)[local] = rows
                    self.bump(local)
            snapshot.load_shard(directory, entry, cols,
                                snapshot.Target.fixed(start, step, self.store.capacity), write,
                                verify=verify, apply=apply)
            return
        limit = self.store.capacity  # a hash store's; None: unbounded
        replaces = not self.store.fixed_keys
        if self.router is None:
            target = snapshot.Target.owned(lambda k: np.ones(len(k), bool), limit=limit,
                                           replaces=replaces)
        else:
            target = snapshot.Target.owned(lambda k: self.router.owns(self.part, k),
                                           lambda k: self.router.to_local(self.part, k),
                                           limit, replaces)
        if verify and not self.store.fixed_keys:
            # Before a block is read: this shard's share of the saved keys (a hash routes
            # 1/parts of them here) must fit, so a checkpoint far bigger than the machine
            # is refused, not half read.
            parts = self.router.num_parts if self.router is not None else 1
            share = -(-snapshot.entry_rows(entry) // parts)
            check_fits(share * (8 + sum(4 * int(np.prod(s, dtype=object))
                                        for s, _ in cols.values())),
                       f"load of {snapshot.entry_rows(entry):,} keys into {name!r}")
        if not apply:
            snapshot.load_shard(directory, entry, cols, target, None, apply=False)
            return
        with self.write():  # all or nothing: every check passes before a key is removed
            snapshot.load_shard(
                directory, entry, cols, target,
                lambda col, keys, rows: self.store.scatter(keys, rows, col),
                replace=(lambda: self.store.remove(self.store.keys())) if replaces else None,
                verify=verify)
        self.bump_all()
