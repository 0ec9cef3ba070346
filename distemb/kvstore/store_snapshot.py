"""Checkpoint segments of a dynamic table's hash stores, resharded by key on load.

A store shard (one server's hash store, or the embedded table's only one) is saved as
one segment per column plus one of its keys (ascending), with the checkpoint machinery
of :mod:`distemb.kvstore.snapshot` (bounded blocks, CRC-32 per block, tmp + fsync +
rename, the manifest last). The weight is saved as float32 whatever its storage dtype.
The manifest entry of the table lists every shard's record. Loading reads every saved
shard's keys, keeps those the loading shard owns (``owns(keys)``: by
:func:`~distemb.partition.key_partition` in a cluster) and upserts their rows and state
block by block, so a table saved by S servers loads into S' servers. Eviction counters
(last lookup, lookup count) are not saved: loaded keys start with fresh counters.

Example:
    >>> import numpy as np, tempfile
    >>> from distemb.stores import HashStore
    >>> s = HashStore(2); s.scatter(np.array([7, -1]), np.ones((2, 2), np.float32))
    >>> d = tempfile.mkdtemp(); rec = save_store(d, "ab12cd34", "t", 0, s)
    >>> t = HashStore(2); load_store(d, {"shards": [rec]}, t, lambda k: k > 0)
    >>> t.keys().tolist()
    [7]
"""
import numpy as np

from distemb.errors import KVStoreError
from distemb.kvstore import snapshot
from distemb.stores.types import WEIGHT

KEYS = "keys"


def _segment_name(name, column):
    # "\x00" never occurs in a table name (names are printable): no clash with a tensor
    return f"{name}\x00{column}"


def save_store(directory, save_id, name, part, store, to_global=None, columns=None):
    """Write ``store`` (shard ``part`` of table ``name``) as segments.

    The caller holds whatever lock keeps the store still (the server's table lock).
    ``to_global(store keys) -> table keys`` (a router's, for shards of a range-routed
    table): the checkpoint holds the table's keys, so it loads under any shard count.
    ``columns`` (``{name: (row_shape, dtype)}``, default all of the store's) are the
    columns saved: a ShardTable leaves out its hidden version column.

    Returns:
        the shard's manifest record: ``{"part", "count", "keys": segment, "columns":
        {column: {"shape", "dtype", "segment"}}}``.
    """
    keys = store.keys()
    slots = store.slots(keys) if len(keys) else np.empty(0, np.int64)
    n = len(keys)
    saved = keys if to_global is None else to_global(keys)
    record = {"part": int(part), "count": n,
              KEYS: snapshot.write_segment(directory, save_id, _segment_name(name, KEYS),
                                           part, 0, 1, (n,), "int64",
                                           lambda lo, hi: saved[lo:hi]),
              "columns": {}}
    for col, (shape, dtype) in (store.columns() if columns is None else columns).items():
        arr = store.column(col)
        if col == WEIGHT:
            dtype = "float32"

            def read(lo, hi, arr=arr):
                return store.decode(arr[slots[lo:hi]])
        else:
            def read(lo, hi, arr=arr):
                return arr[slots[lo:hi]]
        seg = snapshot.write_segment(directory, save_id, _segment_name(name, col), part, 0,
                                     1, (n,) + tuple(shape), dtype, read)
        record["columns"][col] = {"shape": list(shape), "dtype": dtype, "segment": seg}
    return record


def _check_record(rec, i):
    ok = isinstance(rec, dict) and isinstance(rec.get("count"), int) and \
        rec["count"] >= 0 and isinstance(rec.get(KEYS), dict) and \
        isinstance(rec.get("columns"), dict) and WEIGHT in rec["columns"] and all(
            isinstance(c, dict) and isinstance(c.get("shape"), list) and
            isinstance(c.get("dtype"), str) and isinstance(c.get("segment"), dict)
            for c in rec["columns"].values())
    if ok:  # every segment of the record holds its count of rows, no more, no fewer
        segs = [rec[KEYS]] + [c["segment"] for c in rec["columns"].values()]
        ok = all(s.get("count") == rec["count"] for s in segs)
    if not ok:
        raise KVStoreError(f"checkpoint: shard record {i} of a dynamic table is malformed "
                           f"({str(rec)[:80]!r})")


def load_store(directory, entry, store, owns, to_local=None, replace=False):
    """Upsert, into ``store``, the saved keys ``owns(keys)`` selects, with every column
    (as the store's keys ``to_local(keys)`` when given: a range-routed shard's).

    All or nothing: the entry, every record and every segment (CRC-32 of each block it
    needs, coverage) are checked before the store changes, so a refused load leaves it
    as it was. The caller holds the store's write lock.

    Args:
        directory: the checkpoint directory.
        entry: the table's manifest entry (``{"shards": [record, ...], ...}``).
        store: the live shard (it must have every saved column: create the optimizer
            before loading a checkpoint that has optimizer state).
        owns: ``owns(keys) -> bool mask`` of the keys this shard holds.
        to_local: ``to_local(keys) -> store keys`` of a range-routed shard.
        replace: remove every key first (once the checks passed), so the store then
            holds the checkpoint's keys only (a fixed key set is overwritten instead).

    Raises:
        KVStoreError: a malformed entry, a corrupt or missing segment, or a saved column
            the live store lacks or holds with other rows.
    """
    shards = entry.get("shards")
    if not isinstance(shards, list):
        raise KVStoreError("checkpoint: the entry of a dynamic table lists no shards")
    live = store.columns()
    for i, rec in enumerate(shards):
        _check_record(rec, i)
        for col, c in rec["columns"].items():
            if col not in live:
                raise KVStoreError(f"checkpoint: column {col!r} was saved, the live table has "
                                   f"{sorted(live)} (create the optimizer before loading)")
            if tuple(c["shape"]) != tuple(live[col][0]):
                raise KVStoreError(f"checkpoint: column {col!r} was saved with rows "
                                   f"{tuple(c['shape'])}, the live one has {live[col][0]}")
    for rec in shards:  # every check before the first write
        n = rec["count"]
        snapshot.check_segments(directory, [rec[KEYS]], "int64", (), 0, 1, n)
        for c in rec["columns"].values():
            snapshot.check_segments(directory, [c["segment"]], c["dtype"],
                                    tuple(c["shape"]), 0, 1, n)
    if replace and not store.fixed_keys:
        store.remove(store.keys())
    for rec in shards:
        n = rec["count"]
        keys = np.empty(n, np.int64)
        snapshot.write_checked(directory, [rec[KEYS]], "int64", (), 0, 1, n,
                               lambda j, rows: keys.__setitem__(j, rows))
        mine = np.asarray(owns(keys), dtype=bool)
        mapped = keys.copy()
        if to_local is not None and mine.any():
            mapped[mine] = to_local(keys[mine])
        # the weight first: it inserts the keys, then state columns overwrite fresh state
        order = [WEIGHT] + [c for c in rec["columns"] if c != WEIGHT]
        for col in order:
            c = rec["columns"][col]

            def write(j, rows, col=col):
                m = mine[j]
                if m.any():
                    store.scatter(mapped[j][m], rows[m], col)
            snapshot.write_checked(directory, [c["segment"]], c["dtype"], tuple(c["shape"]),
                                   0, 1, n, write)


def store_entry(dim, dtype, records):
    """The manifest entry of a dynamic table saved as ``records`` (one per shard)."""
    segments = [r[KEYS] for r in records] + [c["segment"] for r in records
                                              for c in r["columns"].values()]
    return {"kind": "store", "dim": int(dim), "dtype": dtype, "shards": records,
            "segments": segments}


def check_entry(entry, name, dim, path):
    """KVStoreError unless ``entry`` is a dynamic table's of row length ``dim``."""
    if not isinstance(entry, dict) or entry.get("kind") != "store":
        raise KVStoreError(f"{path}: tensor {name!r} was not saved as a dynamic table")
    if entry.get("dim") != dim:
        raise KVStoreError(f"{path}: dynamic table {name!r} was saved with dim "
                           f"{entry.get('dim')}, the live one has dim {dim}")
