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

A record loads into any shard of any table whose rows match: the loading shard says
which keys it holds (:class:`Target`: a fixed progression of keys, or whatever its
router owns), and reads from each record only the blocks holding some of them. So a
checkpoint written by W shards loads into W' shards of any partition policy or router,
a dense table's into a hash table and a hash table's into a dense one (which must then
be covered exactly once). Checkpoints of version 2 (one entry per tensor, optimizer
state as tensors ``<table>~opt~<state>``, or a dynamic table's entry of kind "store")
load as they are: :func:`table_entry` reads them as this format.

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
import json
import os
import stat

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kernels.hashtable import table_keys
from distemb.kvstore.limits import check_fits
from distemb.kvstore.checkpoint.segments import Segment, write_segment
from distemb.rules import state_name, state_owner
from distemb.stores.types import WEIGHT

MANIFEST = "manifest.json"
FORMAT = "distemb-checkpoint"
VERSION = 3
MAX_MANIFEST_BYTES = 256 << 20
#: The segment of a record holding the shard's keys (when they are not fixed).
KEYS = "keys"
#: Row dtypes a load converts between (to float32 exactly, to half rounded to nearest-even).
CONVERTIBLE = ("float32", "bfloat16", "float16")


def write_shard(directory, save_id, name, part, count, columns, keys=None, start=0, step=1):
    """Write one shard of table ``name`` as a record: a segment per column, and one of
    its keys when they are not fixed.

    Args:
        count: the shard's rows.
        columns: ``{column: (row_shape, dtype, read_block)}`` (see :func:`write_segment`).
        keys: ``read_block(lo, hi)`` of the shard's int64 keys in row order, or None when
            row ``k``'s key is ``start + k * step``.

    Returns:
        the record: ``{"part", "count", "keys": segment or None, "columns": {column:
        {"shape", "dtype", "segment"}}}``.
    """
    s0, st = (0, 1) if keys is not None else (start, step)
    record = {"part": int(part), "count": int(count), KEYS: None, "columns": {}}
    if keys is not None:
        record[KEYS] = write_segment(directory, save_id, f"{name}\x00{KEYS}", part, 0, 1,
                                     (count,), "int64", keys)
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
            segs = [rec.get(KEYS)] + [c.get("segment") for c in
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


# -- reading --------------------------------------------------------------------------


def _records(entry):
    """The shard records of a (normalised) entry, each checked for its shape."""
    shards = entry.get("shards") if isinstance(entry, dict) else None
    if not isinstance(shards, list):
        raise KVStoreError("checkpoint: the table's entry lists no shards")
    for i, rec in enumerate(shards):
        ok = isinstance(rec, dict) and isinstance(rec.get("count"), int) and \
            not isinstance(rec["count"], bool) and rec["count"] >= 0 and \
            (rec.get(KEYS) is None or isinstance(rec.get(KEYS), dict)) and \
            isinstance(rec.get("columns"), dict) and all(
                isinstance(c, dict) and isinstance(c.get("shape"), list) and
                all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                    for d in c["shape"]) and
                isinstance(c.get("dtype"), str) and isinstance(c.get("segment"), dict)
                for c in rec["columns"].values())
        if not ok:
            raise KVStoreError(f"checkpoint: shard record {i} is malformed "
                               f"({str(rec)[:80]!r})")
    # The entry's shape (rows first) says the weight's row shape: every record's weight
    # must have it (a version-2 dynamic table's "dim" is this shape's second entry).
    shape = entry.get("shape")
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


def _pass(directory, records, columns, target, write=None):
    """One pass over what ``target`` holds of ``records``' columns: every block it needs
    read and CRC-checked, each handed to ``write(column, places, rows)`` when given.

    Returns:
        for a checking pass (no ``write``): of a target of fixed keys, how many times
        each of its keys was covered; of another, how many keys it takes. Else None.
    """
    covered = np.zeros(target.count, np.int64) \
        if target.count is not None and write is None else None
    taken = 0
    for rec in records:
        n = rec["count"]
        keys = None
        if rec[KEYS] is not None:
            check_fits(8 * n, f"checkpoint: the {n:,} keys of shard record {rec.get('part')}")
            seg = Segment(directory, rec[KEYS], "int64", (), n)
            try:
                keys = seg.read_all()
            finally:
                seg.close()
            try:  # no table holds the hash index's markers: a save never wrote them
                table_keys(keys, f"checkpoint: keys of shard record {rec.get('part')}")
            except ValueError as e:
                raise KVStoreError(str(e)) from None
        # the weight first: into a store that inserts, it makes the keys the states fill
        for i, col in enumerate(sorted(columns, key=lambda c: c != WEIGHT)):
            c = rec["columns"].get(col)
            if c is None:
                continue
            seg = Segment(directory, c["segment"], c["dtype"], c["shape"], n)
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
    second time to write them, so a refused load leaves the shard as it was.

    Args:
        directory: the checkpoint directory.
        entry: the table's entry (:func:`table_entry`).
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
    records = _records(entry)
    _check_columns(records, columns, target)
    for col in columns if verify else ():
        covered = _pass(directory, records, {col: columns[col]}, target)
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
    _pass(directory, records, columns, target, write)


# -- the manifest -------------------------------------------------------------------


def manifest_path(directory):
    return os.path.join(directory, MANIFEST)


def read_manifest(directory):
    """The manifest of checkpoint ``directory``, checked for its format.

    Raises:
        KVStoreError: no manifest (not a checkpoint, or a save that never finished), or
            one that is not a distemb checkpoint's.
    """
    path = manifest_path(directory)
    try:
        # O_NONBLOCK: a FIFO in its place cannot block the server; only a regular file is
        # read, and no more than the limit of it (a link to /dev/zero never ends).
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise KVStoreError(f"{path}: not a regular file")
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise KVStoreError(f"{path}: over {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise KVStoreError(f"{directory}: not a distemb checkpoint (no readable "
                           f"{MANIFEST}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("tensors"), dict):
        raise KVStoreError(f"{directory}: {MANIFEST} is not a distemb checkpoint's")
    return manifest


def table_entry(manifest, name, directory):
    """The entry of table ``name``, in this format whatever the checkpoint's version.

    A version-2 dense table was one entry per tensor, its optimizer states the entries
    ``<name>~opt~<state>``: they become the columns of one record per saved shard. A
    version-2 dynamic table (kind "store") already was records with keys.

    Raises:
        KVStoreError: the checkpoint has no such table (nor state of it).
    """
    tensors = manifest["tensors"]
    entry = tensors.get(name)
    if isinstance(entry, dict) and entry.get("kind") in ("table", "store"):
        if entry.get("kind") == "store":  # version 2's dynamic table: any key, dim columns
            return {"kind": "table", "shape": [None, entry.get("dim")],
                    "dtype": entry.get("dtype"), "shards": entry.get("shards")}
        return entry
    records = {}

    def add(column, old):
        shape, dtype, segs = old.get("shape"), old.get("dtype"), old.get("segments")
        if not isinstance(shape, list) or not shape or not isinstance(dtype, str) or \
                not isinstance(segs, list):
            raise KVStoreError(f"{directory}: the entry of {name!r} ({column}) is malformed")
        for seg in segs:
            if not isinstance(seg, dict):
                raise KVStoreError(f"checkpoint: malformed segment record {str(seg)[:80]!r}")
            key = tuple(str(seg.get(k)) for k in ("part", "start", "step", "count"))
            rec = records.setdefault(key, {"part": seg.get("part"), "count": seg.get("count"),
                                           KEYS: None, "columns": {}})
            rec["columns"][column] = {"shape": shape[1:], "dtype": dtype, "segment": seg}
    if isinstance(entry, dict):
        add(WEIGHT, entry)
    prefix = state_name(name, "")
    for tname, old in tensors.items():
        if state_owner(tname) == name and isinstance(old, dict):
            add(tname[len(prefix):], old)
    if not records:
        raise KVStoreError(f"{directory}: has no table {name!r} (has "
                           f"{sorted(tensors)[:10]})")
    shape = entry.get("shape") if isinstance(entry, dict) else None
    return {"kind": "table", "shape": shape, "dtype": (entry or {}).get("dtype"),
            "shards": list(records.values())}


def entry_rows(entry):
    """The rows a table entry holds in all (for memory checks before a load)."""
    return sum(r["count"] for r in entry.get("shards") or () if isinstance(r, dict) and
               isinstance(r.get("count"), int) and not isinstance(r["count"], bool))
