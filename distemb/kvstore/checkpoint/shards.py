"""How one shard (a :class:`~distemb.kvstore.server.shard.ShardTable`) writes and reads
its checkpoint record, in the format of :mod:`~distemb.kvstore.checkpoint.snapshot`.

One rule for every store: rows are saved as stored (half rows in 16 bits), keyed by the
table's keys. A shard of fixed keys whose store keys are a progression of the table's
(``start + step * k``, a partition of a range or hash policy) saves no keys segment and
is written block by block under the read lock, so a save runs beside training; any other
shard saves its keys (as the table's keys, by its router), the whole shard under the read
lock (a hash store's slots move as it inserts). A load is all or nothing: every block is
read and checked (CRCs, the keys the shard takes, each of a fixed shard's keys covered
exactly once, a store of any key's share within its capacity and the machine's memory)
before the first row is written; a store of any key then holds the checkpoint's keys
only.

Example:
    >>> import tempfile
    >>> from distemb.kvstore.server.shard import ShardTable
    >>> from distemb.routers import KeyHashRouter, PolicyRouter
    >>> from distemb.stores import DenseStore, HashStore
    >>> d = tempfile.mkdtemp()
    >>> a = ShardTable(DenseStore(3, 2), PolicyRouter.ranges(3, 1))
    >>> a.push(np.array([1]), np.ones((1, 2), np.float32))
    >>> entry = snapshot.new_entry((3, 2), "float32", [save_shard(a, d, "0123abcd", "t")])
    >>> b = ShardTable(HashStore(2), KeyHashRouter(1))  # any key: it holds the saved keys
    >>> load_shard(b, d, entry, name="t")
    >>> b.store.keys().tolist(), b.pull(np.array([1])).tolist()
    ([0, 1, 2], [[1.0, 1.0]])
"""
import numpy as np

from distemb.errors import KVStoreError, StoreError
from distemb.kvstore.checkpoint import manifest, snapshot
from distemb.kvstore.limits import check_fits


def saved_columns(table, columns=None):
    """``{column: (row_shape, dtype)}`` of ``columns`` (None: every one) of ``table`` as
    its store holds them.

    Raises:
        KVStoreError: a column the shard does not have.
    """
    have = table.columns()
    names = list(have) if columns is None else list(columns)
    missing = [c for c in names if c not in have]
    if missing:
        raise KVStoreError(f"checkpoint: columns {missing} not in the shard (has "
                           f"{sorted(have)})")
    return {c: (tuple(have[c][0]), have[c][1]) for c in names}


def _progression(table):
    """(start, step) of a shard of fixed keys whose store keys are a progression of the
    table's, else None."""
    return table.router.progression(table.part) if table.store.fixed_keys else None


def save_shard(table, directory, save_id, name, columns=None, parent=None):
    """Write ``columns`` (None: every one) of shard ``table`` of table ``name`` as one
    checkpoint record (:func:`~distemb.kvstore.checkpoint.snapshot.write_shard`), and
    mark the save (:class:`~distemb.kvstore.checkpoint.changes.Changes`) once its rows
    have versions.

    With ``parent``, the record is a delta: the rows (every column) whose version moved
    since save ``parent``, which this shard made or loaded, with their keys, and the
    keys removed or evicted since as tombstones.

    Returns:
        the record.

    Raises:
        KVStoreError: a column the shard lacks; a ``parent`` this shard did not make or
            load, or that holds fewer columns.
    """
    cols = saved_columns(table, columns)
    if parent is not None:
        return _save_delta(table, directory, save_id, name, cols, parent)
    store = table.store
    prog = _progression(table)
    if prog is not None:
        with table.read():  # rows written from here on are in the next delta
            snap = _snapshot(table)
        record = snapshot.write_shard(
            directory, save_id, name, table.part, store.capacity,
            {c: (shape, dtype, _rows_of(table, c, None, locked=False))
             for c, (shape, dtype) in cols.items()},
            start=prog[0], step=prog[1])
    else:
        with table.read():  # a store's slots move as it inserts: still for the whole save
            snap = _snapshot(table)
            keys = store.keys()
            slots = store.slots(keys) if len(keys) else np.empty(0, np.int64)
            saved = table.router.to_global(table.part, keys)
            record = snapshot.write_shard(
                directory, save_id, name, table.part, len(keys),
                {c: (shape, dtype, _rows_of(table, c, slots, locked=True))
                 for c, (shape, dtype) in cols.items()},
                keys=lambda lo, hi: saved[lo:hi])
    if snap is not None:
        table.changes.mark(save_id, snap, cols)
    return record


def _snapshot(table):
    """The shard's versions and removal log now (None while rows have no versions); the
    caller holds its lock."""
    versions = table.row_versions()
    return None if versions is None else table.changes.snapshot(versions)


def _rows_of(table, column, slots, locked):
    """``read_block(lo, hi)`` of rows ``slots[lo:hi]`` (None: slots lo..hi-1) of
    ``column`` as stored; unless ``locked`` (the caller holds the lock for the whole
    save), each block under the read lock (rows that never move: each block consistent
    on its own)."""
    store = table.store

    def read(lo, hi):
        at = np.arange(lo, hi, dtype=np.int64) if slots is None else slots[lo:hi]
        if locked:
            return store.read_rows(column, at, stored=True)
        with table.read():
            return store.read_rows(column, at, stored=True)
    return read


def _save_delta(table, directory, save_id, name, cols, parent):
    """The delta record of ``table`` since save ``parent`` (see :func:`save_shard`)."""
    store = table.store
    with table.read():
        mark = table.changes.since(parent, cols, f"shard {table.part} of {name!r}")
        versions = table.row_versions()
        if store.fixed_keys:  # its keys are its slots, which never move
            slots = np.flatnonzero(versions != mark.versions)
            keys = slots
        else:
            held = store.keys()
            at = store.slots(held) if len(held) else np.empty(0, np.int64)
            before = np.full(len(at), -1, np.int64)  # a slot past the mark's: a new row
            inside = at < len(mark.versions)
            before[inside] = mark.versions[at[inside]]
            changed = versions[at] != before
            keys, slots = held[changed], at[changed]
        snap = table.changes.snapshot(versions)
        tombstones = table.changes.removed_since(mark)
        saved = table.router.to_global(table.part, keys)

        def write(locked):
            return snapshot.write_shard(
                directory, save_id, name, table.part, len(saved),
                {c: (shape, dtype, _rows_of(table, c, slots, locked))
                 for c, (shape, dtype) in cols.items()},
                keys=lambda lo, hi: saved[lo:hi],
                tombstones=tombstones if len(tombstones) else None)
        if not store.fixed_keys:  # a store's slots move as it inserts: still for the save
            record = write(locked=True)
    if store.fixed_keys:  # rows never move: each block under the lock on its own
        record = write(locked=False)
    table.changes.mark(save_id, snap, cols, keep=parent)
    return record


def _target(table):
    """The keys shard ``table`` takes from a checkpoint (:class:`~distemb.kvstore.
    checkpoint.snapshot.Target`): a progression, or what its router owns, checked as
    the table's keys (a key a hash index reserves is refused in the checking pass)."""
    store, router, part = table.store, table.router, table.part
    prog = _progression(table)
    if prog is not None:
        return snapshot.Target.fixed(prog[0], prog[1], store.capacity)
    fixed = store.fixed_keys

    def owns(keys):
        try:
            router.check(keys, "keys")
        except ValueError as e:
            raise KVStoreError(f"checkpoint: {e}") from None
        return router.owns(part, keys)
    return snapshot.Target.owned(owns, lambda k: router.to_local(part, k),
                                 limit=None if fixed else store.capacity,
                                 count=store.capacity if fixed else None,
                                 replaces=not fixed)


def load_shard(table, directory, entry, columns=None, verify=True, apply=True,
               name="the shard"):
    """Fill ``columns`` (None: every one) of shard ``table`` from a table's checkpoint
    ``entry`` (:func:`~distemb.kvstore.checkpoint.manifest.table_entry`), all or nothing.

    ``verify`` and ``apply`` split the load into its checking and writing passes (a load
    of several shards checks them all first). Every version changes (cached copies of
    the rows are void). A load of every column of a chain's entry marks its last save
    (an incremental save may follow it); any load forgets the marks before it. ``name``
    names the table in errors.

    Raises:
        KVStoreError: see :func:`~distemb.kvstore.checkpoint.snapshot.load_shard`; a key
            the table cannot hold; a load that would not fit in memory.
    """
    cols = saved_columns(table, columns)
    store = table.store
    target = _target(table)
    if verify and not store.fixed_keys:
        # Before a block is read: this shard's share of the saved keys (a hash routes
        # 1/parts of them here) must fit, so a checkpoint far bigger than the machine is
        # refused, not half read.
        share = -(-manifest.entry_keys(entry) // table.router.num_parts)
        check_fits(share * (8 + sum(4 * int(np.prod(s, dtype=object))
                                    for s, _ in cols.values())),
                   f"load of {manifest.entry_keys(entry):,} keys into {name!r}")
    if not apply:
        snapshot.load_shard(directory, entry, cols, target, None, apply=False)
        return

    def write(col, keys, rows):
        try:
            store.scatter(keys, rows, col)
        except StoreError as e:
            raise KVStoreError(f"checkpoint: {e}") from None
    table.changes.forget()  # the rows are replaced: no earlier save describes them
    with table.write():  # all or nothing: every check passes before a row is written
        snapshot.load_shard(directory, entry, cols, target, write,
                            replace=None if store.fixed_keys else
                            lambda: store.remove(store.keys()), verify=verify)
    table.bump_all()
    if entry.get("save_id") is not None and set(cols) == set(table.columns()):
        with table.read():
            snap = _snapshot(table)
        if snap is not None:
            table.changes.mark(entry["save_id"], snap, cols)
