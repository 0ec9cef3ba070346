"""Sinks of evicted rows: where a hash table's evictions hand every row they remove.

A hash table may be given a sink (``HashTableSpec(..., sink=...)``,
``DynamicEmbedding(..., sink=...)``): a callable, in the process that holds the table
(embedded, a collective rank), or a directory, which any holder writes to (servers too).
Every eviction, by ``evict()`` or by a lookup past the table's capacity, hands the sink
the keys it removes with their rows and optimizer state, under the shard's lock and
before they leave the store, so each shard's evictions reach the sink in the order they
happen. A removal (``remove()``) is not an eviction and is not sunk. If the sink raises,
nothing is evicted and the error reaches the caller (a lookup past the capacity fails):
no row leaves unseen.

A callable is called as ``sink(keys, columns)``: the table's int64 keys and
``{column: rows}`` (the weight as float32, as ``export`` gives it, and each optimizer
state). A directory gets one record of the checkpoint format per eviction (a keys
segment and a segment per column, rows as stored, CRC-checked and fsynced), then a line
naming it in its shard's log ``evicted-<table digest>-p<part>.jsonl``, fsynced:
:func:`read_evicted` gives them back, each shard's in order. A record without its line
(a process that died between the two) was never handed over, nor is a torn last line.

Example:
    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> sink = make_sink(d, "t", 0)
    >>> sink.write(np.array([7, -2]), {"weight": ((2,), "float32",
    ...                                           np.ones((2, 2), np.float32))})
    >>> [(part, keys.tolist(), rows["weight"].sum()) for part, keys, rows in
    ...  read_evicted(d, "t")]
    [(0, [7, -2], 4.0)]
"""
import hashlib
import json
import os
import re
import uuid

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kvstore.checkpoint.segments import Segment
from distemb.kvstore.checkpoint.snapshot import KEYS, write_shard
from distemb.kvstore.limits import check_fits

#: Rows as a sink takes them: ``{column: (row shape, dtype as stored, rows as stored)}``.
SunkColumns = dict


def log_file(name: str, part: int) -> str:
    """The log of shard ``part`` of table ``name`` in a sink directory (no user text in
    file names)."""
    return f"evicted-{hashlib.sha1(name.encode('utf-8')).hexdigest()[:16]}-p{int(part)}.jsonl"


def _float_rows(columns: SunkColumns) -> dict:
    """``{column: rows}``, half rows decoded to float32."""
    return {c: (half.decode(rows) if half.is_half(dtype) else rows)
            for c, (_, dtype, rows) in columns.items()}


class CallableSink:
    """A sink that calls ``fn(keys, {column: rows})`` (see the module docstring).

    Example:
        >>> got = []
        >>> CallableSink(lambda k, c: got.append(k.tolist())).write(
        ...     np.array([3]), {"weight": ((1,), "float32", np.zeros((1, 1), np.float32))})
        >>> got
        [[3]]
    """

    def __init__(self, fn):
        self.fn = fn

    def write(self, keys: np.ndarray, columns: SunkColumns) -> None:
        self.fn(keys, _float_rows(columns))


class DirectorySink:
    """A sink that writes each eviction of shard ``part`` of table ``name`` into
    ``directory`` (see the module docstring; :func:`make_sink` gives one).

    Raises:
        KVStoreError: the directory cannot be made.
    """

    def __init__(self, directory: str, name: str, part: int):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise KVStoreError(f"sink: cannot make directory {directory!r} ({e.strerror})") \
                from None
        self.directory, self.name, self.part = directory, name, int(part)
        self.log = os.path.join(directory, log_file(name, part))

    def write(self, keys: np.ndarray, columns: SunkColumns) -> None:
        """Write one eviction: its record, then its line in the log (both fsynced).

        Raises:
            KVStoreError: an I/O error (the eviction does not happen).
        """
        record = write_shard(self.directory, uuid.uuid4().hex, self.name, self.part,
                             len(keys),
                             {c: (shape, dtype, lambda lo, hi, r=rows: r[lo:hi])
                              for c, (shape, dtype, rows) in columns.items()},
                             keys=lambda lo, hi: keys[lo:hi])
        line = json.dumps({"table": self.name, "part": self.part, "record": record}) + "\n"
        new = not os.path.exists(self.log)
        try:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            if new:
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            raise KVStoreError(f"sink: cannot append to {self.log} ({e.strerror})") from None


def make_sink(target, name: str, part: int):
    """The sink of shard ``part`` of table ``name`` for a spec's ``sink`` (None, a
    callable or a directory), or None."""
    if target is None:
        return None
    if callable(target):
        return CallableSink(target)
    return DirectorySink(os.fspath(target), name, part)


def read_evicted(directory, table: str):
    """Every eviction of table ``table`` a directory sink received: yields ``(part, keys,
    {column: rows})`` per eviction (the weight as float32), shard by shard, each shard's
    in the order they happened.

    Raises:
        KVStoreError: a record that is corrupt or missing, or a log of another table.
    """
    directory = os.fspath(directory)
    prefix = log_file(table, 0)[:-len("0.jsonl")]
    parts = sorted(int(m.group(1)) for m in (re.match(re.escape(prefix) + r"([0-9]+)\.jsonl$", f)
                                             for f in os.listdir(directory)) if m)
    for part in parts:
        path = os.path.join(directory, log_file(table, part))
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        for i, raw in enumerate(lines[:-1]):  # the last is empty, or a torn line
            try:
                entry = json.loads(raw.decode("utf-8"))
                rec = entry["record"]
            except (ValueError, KeyError, TypeError):
                raise KVStoreError(f"{path}: line {i + 1} is malformed") from None
            if entry.get("table") != table or entry.get("part") != part:
                raise KVStoreError(f"{path}: line {i + 1} is of table "
                                   f"{entry.get('table')!r:.40} shard {entry.get('part')!r}, "
                                   f"not {table!r} shard {part}")
            yield part, _read(directory, rec, KEYS, "int64", ()), {
                c: _float_rows({c: (col["shape"], col["dtype"],
                                    _read(directory, rec, c, col["dtype"], col["shape"]))})[c]
                for c, col in rec["columns"].items()}


def _read(directory, rec, column, dtype, row_shape):
    """Every row of segment ``column`` of a sink's record, CRC-checked."""
    n = rec.get("count")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise KVStoreError(f"sink record: count must be an integer >= 0, got {n!r:.20}")
    seg_rec = rec[KEYS] if column == KEYS else rec["columns"][column]["segment"]
    check_fits(8 * n * max(1, int(np.prod(row_shape, dtype=object))),
               f"sink record of {n} rows")
    seg = Segment(directory, seg_rec, dtype, row_shape, n)
    try:
        return seg.read_all()
    finally:
        seg.close()
