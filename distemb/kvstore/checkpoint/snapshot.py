"""Checkpoints on disk: one format for every table, written and read where its shards live.

A checkpoint is a directory. Every shard of every table is one *record*: a segment file
per column (the weight and each optimizer state), plus one of the shard's keys when its
keys are not fixed. A segment (:mod:`distemb.kvstore.checkpoint.segments`) holds rows in the
shard's order, in bounded blocks with a CRC-32 per block; the key of row ``k`` is the
keys segment's ``k``-th key, or, for a fixed key set, ``start + k * step`` (a range
partition has step 1, a hash partition step P). Names carry the save's id, so a new
save never touches the files of the previous one. ``manifest.json`` (written last, by
:mod:`distemb.checkpoint`) lists each table's entry (shape, dtype, records); a
checkpoint without it is not a checkpoint.

An incremental save is a *delta*: a record per shard of the rows that changed since its
parent save (with their keys, whatever the shard's keys) and a segment of *tombstones*,
the keys removed or evicted since. A table's entry read from a chain of saves
(:mod:`distemb.kvstore.checkpoint.chain`) holds the base's records in ``"shards"`` and
each delta's in ``"deltas"``, oldest first; :func:`load_shard` loads the newest row of
every key no later save removed, in one checking and one writing pass, as it loads a
full save.

A record loads into any shard of any table whose rows match: the loading shard says
which keys it holds (:class:`Target`: a fixed progression of keys, or whatever its
router owns), and reads from each record only the blocks holding some of them. So a
checkpoint written by W shards loads into W' shards of any partition policy or router,
a dense table's into a hash table and a hash table's into a dense one (which must then
be covered exactly once). Checkpoints of version 2 (one entry per tensor, optimizer
state as tensors ``<table>~opt~<state>``, or a dynamic table's entry of kind "store")
load as they are: :func:`~distemb.kvstore.checkpoint.manifest.table_entry` reads them
as this format.

Example:
    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> a = np.arange(12, dtype=np.float32).reshape(6, 2)
    >>> rec = write_shard(d, "ab12cd34", "w", 0, 6,
    ...                   {"weight": ((2,), "float32", lambda lo, hi: a[lo:hi])})
    >>> out = np.zeros((3, 2), np.float32)   # a shard holding global ids 1, 3, 5
    >>> load_shard(d, {"shards": [rec]}, {"weight": ((2,), "float32")},
    ...            Target.fixed(1, 2, 3), lambda col, j, rows: out.__setitem__(j, rows))
    >>> out[:, 0].tolist()
    [2.0, 6.0, 10.0]
"""

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kernels.hashtable import table_keys
from distemb.kvstore.limits import check_fits
from distemb.kvstore.checkpoint.segments import Segment, write_segment
from distemb.stores.types import WEIGHT

#: The segment of a record holding the shard's keys (when they are not fixed).
KEYS = "keys"
#: The segment of a delta's record holding the keys removed or evicted since its parent.
TOMBSTONES = "tombstones"
#: Row dtypes a load converts between (to float32 exactly, to half rounded to nearest-even).
CONVERTIBLE = ("float32", "bfloat16", "float16")


def write_shard(directory, save_id, name, part, count, columns, keys=None, start=0, step=1,
                tombstones=None):
    """Write one shard of table ``name`` as a record: a segment per column, and one of
    its keys when they are not fixed.

    Args:
        count: the shard's rows.
        columns: ``{column: (row_shape, dtype, read_block)}`` (see :func:`write_segment`).
        keys: ``read_block(lo, hi)`` of the shard's int64 keys in row order, or None when
            row ``k``'s key is ``start + k * step``.
        tombstones: a delta's int64 keys removed since its parent (None: a full save).

    Returns:
        the record: ``{"part", "count", "keys": segment or None, "columns": {column:
        {"shape", "dtype", "segment"}}}``, and a delta's ``"tombstones": segment``.
    """
    s0, st = (0, 1) if keys is not None else (start, step)
    record = {"part": int(part), "count": int(count), KEYS: None, "columns": {}}
    if keys is not None:
        record[KEYS] = write_segment(directory, save_id, f"{name}\x00{KEYS}", part, 0, 1,
                                     (count,), "int64", keys)
    if tombstones is not None:
        record[TOMBSTONES] = write_segment(
            directory, save_id, f"{name}\x00{TOMBSTONES}", part, 0, 1, (len(tombstones),),
            "int64", lambda lo, hi: tombstones[lo:hi])
    for col, (shape, dtype, read) in columns.items():
        seg = write_segment(directory, save_id, f"{name}\x00{col}", part, s0, st,
                            (count,) + tuple(shape), dtype, read)
        record["columns"][col] = {"shape": list(shape), "dtype": dtype, "segment": seg}
    return record


def new_entry(shape, dtype, records, policy=None):
    """The manifest entry of a table: ``shape`` (rows first, None for any key), the
    weight's ``dtype``, its shards' ``records`` and, for a dense table, its policy."""
    entry = {"kind": "table", "shape": list(shape), "dtype": dtype, "shards": list(records)}
    if policy is not None:
        entry["policy"] = {"name": policy.policy_str, "num_partitions": policy.num_partitions}
    return entry


def entry_files(entry):
    """The segment files an entry (of this format) refers to."""
    out = []
    for rec in entry.get("shards") or ():
        if isinstance(rec, dict):
            segs = [rec.get(KEYS), rec.get(TOMBSTONES)] + [c.get("segment") for c in
                                      (rec.get("columns") or {}).values() if isinstance(c, dict)]
            out += [s["file"] for s in segs if isinstance(s, dict) and "file" in s]
    return out


# -- which saved keys a loading shard holds --------------------------------------------


class Target:
    """The keys a loading shard holds and where each goes.

    ``select(keys) -> (mask, local)``: which of the saved ``keys`` are the shard's, and
    their places in it (row numbers of a fixed key set, the store's keys otherwise).
    A shard of fixed keys must be covered exactly once by the checkpoint. A shard that
    ``replaces`` its keys by the checkpoint's (a store that inserts) takes the state of
    a key only with its weight, which inserts it.

    Example:
        >>> mask, local = Target.fixed(10, 2, 3).select(np.array([10, 11, 14, 16]))
        >>> mask.tolist(), local.tolist()
        ([True, False, True, False], [0, 2])
    """

    def __init__(self, select, count=None, limit=None, replaces=False):
        self.select, self.count, self.limit = select, count, limit
        self.replaces = replaces

    @classmethod
    def fixed(cls, start, step, count):
        """The keys ``start + step * k`` for k < ``count``, row k of the shard."""
        def select(keys):
            rel = keys - start
            mask = (rel >= 0) & (rel % step == 0) & (rel // step < count)
            return mask, rel[mask] // step
        return cls(select, count)

    @classmethod
    def owned(cls, owns, to_local=None, limit=None, count=None, replaces=False):
        """Keys where ``owns(keys)`` is True, as ``to_local(keys)`` (or themselves); at
        most ``limit`` of them (a store's capacity; None: any number). With ``count``,
        the places are a fixed key set 0..count-1, each to be covered exactly once;
        ``replaces``: the shard holds the checkpoint's keys only afterwards."""
        def select(keys):
            mask = np.asarray(owns(keys), dtype=bool)
            mine = keys[mask]
            return mask, (to_local(mine) if to_local is not None and len(mine) else mine)
        return cls(select, count, limit, replaces)

    def without(self, shadow):
        """This target less the saved keys ``shadow`` (sorted, distinct): those a newer
        save of a chain wrote or removed, whose rows here are out of date."""
        if not len(shadow):
            return self
        select = self.select

        def newest(keys):
            mask, local = select(keys)
            keep = ~_within(keys[mask], shadow)
            mask = np.array(mask, dtype=bool)
            mask[mask] = keep
            return mask, local[keep]
        return Target(newest, self.count, self.limit, self.replaces)


def _within(keys, sorted_keys):
    """Bool per key of ``keys``: whether it is in ``sorted_keys`` (sorted, distinct)."""
    if not len(sorted_keys) or not len(keys):
        return np.zeros(len(keys), bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys


# -- reading --------------------------------------------------------------------------


def _records(shards, shape, what="the table's entry", delta=False):
    """Shard records ``shards`` (of the base, or of a ``delta``: keys always saved),
    each checked for its shape and its weight's against the entry's ``shape``; ``what``
    names them in errors."""
    if not isinstance(shards, list):
        raise KVStoreError(f"checkpoint: {what} lists no shards")
    for i, rec in enumerate(shards):
        ok = isinstance(rec, dict) and isinstance(rec.get("count"), int) and \
            not isinstance(rec["count"], bool) and rec["count"] >= 0 and \
            (rec.get(KEYS) is None or isinstance(rec.get(KEYS), dict)) and \
            (isinstance(rec.get(KEYS), dict) or not delta) and \
            (rec.get(TOMBSTONES) is None or isinstance(rec.get(TOMBSTONES), dict)) and \
            isinstance(rec.get("columns"), dict) and all(
                isinstance(c, dict) and isinstance(c.get("shape"), list) and
                all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                    for d in c["shape"]) and
                isinstance(c.get("dtype"), str) and isinstance(c.get("segment"), dict)
                for c in rec["columns"].values())
        if not ok:
            raise KVStoreError(f"checkpoint: shard record {i} of {what} is malformed "
                               f"({str(rec)[:80]!r})")
    # The entry's shape (rows first) says the weight's row shape: every record's weight
    # must have it (a version-2 dynamic table's "dim" is this shape's second entry).
    if shape is not None:
        if not isinstance(shape, list) or not shape:
            raise KVStoreError(f"checkpoint: the table's shape is malformed "
                               f"({str(shape)[:80]!r})")
        for i, rec in enumerate(shards):
            weight = rec["columns"].get(WEIGHT)
            if weight is not None and weight["shape"] != shape[1:]:
                raise KVStoreError(f"checkpoint: shard record {i} has weight rows of shape "
                                   f"{tuple(weight['shape'])}, the table's entry says rows "
                                   f"of {tuple(shape[1:])} (shape {shape})")
    return shards


def _saved_keys(directory, rec, seg):
    """The int64 keys of segment ``seg`` (``KEYS`` or ``TOMBSTONES``) of record ``rec``,
    every block CRC-checked."""
    n = rec["count"] if seg == KEYS else rec[seg].get("count")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise KVStoreError(f"checkpoint: the {seg} of shard record {rec.get('part')!r:.20} "
                           f"count {n!r:.20} keys; expected an integer >= 0")
    check_fits(8 * n, f"checkpoint: the {n:,} {seg} of shard record {rec.get('part')}")
    s = Segment(directory, rec[seg], "int64", (), n)
    try:
        keys = s.read_all()
    finally:
        s.close()
    try:  # no table holds the hash index's markers: a save never wrote them
        return table_keys(keys, f"checkpoint: {seg} of shard record {rec.get('part')}")
    except ValueError as e:
        raise KVStoreError(str(e)) from None


def _links(directory, entry, target):
    """``[(records, target)]`` of a table entry, the base first, then its deltas in
    order (:mod:`distemb.kvstore.checkpoint.chain`): each link's target leaves out the
    keys a later link wrote or removed, so every key is read from the newest link that
    holds it, and not at all once removed."""
    if not isinstance(entry, dict):
        raise KVStoreError("checkpoint: the table's entry is malformed")
    deltas = entry.get("deltas") or []
    if not isinstance(deltas, list):
        raise KVStoreError("checkpoint: the table's entry has malformed deltas")
    shape = entry.get("shape")
    links = [_records(entry.get("shards"), shape)] + \
        [_records(d, shape, f"delta {k}", delta=True) for k, d in enumerate(deltas, 1)]
    out, shadow = [], np.empty(0, np.int64)
    for k in range(len(links) - 1, -1, -1):
        out.append((links[k], target.without(shadow)))
        if k == 0:
            break
        newer = [shadow]
        for rec in links[k]:
            for seg in (KEYS, TOMBSTONES):
                if rec.get(seg) is not None:
                    keys = _saved_keys(directory, rec, seg)
                    newer.append(keys[target.select(keys)[0]])
        shadow = np.unique(np.concatenate(newer))
    return out[::-1]


def _check_columns(records, columns, target):
    """KVStoreError unless every column asked for was saved with the live rows; into a
    shard that replaces its keys, with the weight of every key whose state it loads (the
    weight's write inserts the key)."""
    if target.replaces and columns:
        if WEIGHT not in columns:
            raise KVStoreError(f"checkpoint: a load of columns {sorted(columns)} into a "
                               "table of any key replaces its keys, so it loads the weight "
                               "too (its state alone would leave keys without their rows)")
        for i, rec in enumerate(records):
            if WEIGHT not in rec["columns"] and set(columns) & set(rec["columns"]):
                raise KVStoreError(f"checkpoint: shard record {i} holds state "
                                   f"{sorted(set(columns) & set(rec['columns']))} without "
                                   "the weight of its keys")
    saved = {}
    for rec in records:
        for col, c in rec["columns"].items():
            saved.setdefault(col, c)
    for col, (shape, dtype) in columns.items():
        c = saved.get(col)
        if c is None:
            raise KVStoreError(f"checkpoint: column {col!r} was not saved (saved: "
                               f"{sorted(saved)}; create the optimizer the checkpoint was "
                               "saved with, or load the weight alone)")
        if tuple(c["shape"]) != tuple(shape) or \
                (c["dtype"] != dtype and not {c["dtype"], dtype} <= set(CONVERTIBLE)):
            raise KVStoreError(f"checkpoint: column {col!r} was saved as rows "
                               f"{tuple(c['shape'])} {c['dtype']}, the live one has rows "
                               f"{tuple(shape)} {dtype}")


def _convert(rows, saved, live):
    """Rows saved as dtype ``saved`` as dtype ``live`` (both in CONVERTIBLE)."""
    if saved == live:
        return rows
    rows = half.decode(rows) if half.is_half(saved) else rows
    return half.encode(rows, live) if half.is_half(live) else rows


def _pass(directory, links, columns, write=None):
    """One pass over what each link's target holds of its records' columns (``links``:
    :func:`_links`): every block it needs read and CRC-checked, each handed to
    ``write(column, places, rows)`` when given.

    Returns:
        for a checking pass (no ``write``): of a target of fixed keys, how many times
        each of its keys was covered; of another, how many keys it takes. Else None.
    """
    count = links[0][1].count
    covered = np.zeros(count, np.int64) if count is not None and write is None else None
    taken = 0
    for records, target in links:
        for rec in records:
            keys = _saved_keys(directory, rec, KEYS) if rec[KEYS] is not None else None
            # the weight first: into a store that inserts, it makes the keys the states fill
            for i, col in enumerate(sorted(columns, key=lambda c: c != WEIGHT)):
                c = rec["columns"].get(col)
                if c is None:
                    continue
                seg = Segment(directory, c["segment"], c["dtype"], c["shape"], rec["count"])
                if keys is not None:
                    keys_of = lambda lo, hi: keys[lo:hi]  # noqa: E731
                else:
                    keys_of = lambda lo, hi, s=seg: \
                        s.start + np.arange(lo, hi, dtype=np.int64) * s.step  # noqa: E731
                try:
                    for local, rows in seg.blocks(keys_of, target):
                        if write is None:
                            if covered is not None:
                                np.add.at(covered, local, 1)
                            elif i == 0:
                                taken += len(local)
                        else:
                            write(col, local, _convert(rows, c["dtype"], columns[col][1]))
                finally:
                    seg.close()
    return None if write is not None else taken if covered is None else covered


def load_shard(directory, entry, columns, target, write, replace=None, verify=True,
               apply=True):
    """Fill one loading shard from a table's checkpoint entry, all or nothing.

    Every record, every segment and every block the shard needs is read and checked
    (CRC-32, sizes, and for a shard of fixed keys that each key is covered exactly once,
    for every column) before ``write`` sees the first row; the blocks are then read a
    second time to write them, so a refused load leaves the shard as it was. An entry
    read from a chain of saves gives each key's row from the newest save that wrote it,
    unless a later one removed it.

    Args:
        directory: the checkpoint directory.
        entry: the table's entry (:func:`~distemb.kvstore.checkpoint.manifest.table_entry`, or a chain's:
            :func:`~distemb.kvstore.checkpoint.chain.chain_entry`).
        columns: ``{column: (row_shape, dtype)}`` to load, as the live shard holds them
            (rows are converted between float32, bfloat16 and float16).
        target: the shard's keys (:class:`Target`).
        write: ``write(column, places, rows)`` stores rows (the weight's first).
        replace: called once every check passed, before the first write (a store that
            keys its rows removes its keys there, to hold the checkpoint's only).
        verify, apply: run the checking pass, the writing pass (a load of several shards
            checks them all before it writes any: ``apply=False`` on each, then
            ``verify=False``; the writing pass checks each block's CRC again anyway).

    Raises:
        KVStoreError: a malformed entry (a record's weight rows not of the entry's
            shape), a column not saved or saved with other rows, a missing, short or
            corrupt segment, a saved key the hash index reserves, keys of a fixed shard
            not covered exactly once, or (a shard that replaces its keys) state without
            its weight.
    """
    links = _links(directory, entry, target)
    for records, _ in links:
        _check_columns(records, columns, target)
    for col in columns if verify else ():
        covered = _pass(directory, links, {col: columns[col]})
        if target.count is None:
            if target.limit is not None and covered > target.limit:
                raise KVStoreError(f"checkpoint: {covered:,} saved keys go to a shard that "
                                   f"holds at most {target.limit:,} (its table's capacity); "
                                   "load into a table with a larger capacity")
            continue
        if (covered != 1).any():
            bad = int(np.flatnonzero(covered != 1)[0])
            raise KVStoreError(f"checkpoint: column {col!r} covers row {bad} of the "
                               f"{target.count} asked for {int(covered[bad])} times (every "
                               f"row must be saved exactly once)")
    if not apply:
        return
    if replace is not None:
        replace()
    _pass(directory, links, columns, write)
