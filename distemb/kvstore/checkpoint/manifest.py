"""A checkpoint's manifest: ``manifest.json``, written last, lists each table's entry (shape,
dtype, the records of its shards, and a chain's deltas); a directory without it is not
a checkpoint. Reading it, and a table's entry in it (checkpoints of version 2 read as
this format); the rows and keys an entry holds, for checks before a load.
"""
import json
import os
import stat

from distemb.errors import KVStoreError
from distemb.kvstore.checkpoint.snapshot import KEYS
from distemb.rules import state_name, state_owner
from distemb.stores.types import WEIGHT

MANIFEST = "manifest.json"
FORMAT = "distemb-checkpoint"
VERSION = 4  # 4: incremental saves (records with tombstones, manifests with a parent)
MAX_MANIFEST_BYTES = 256 << 20


def manifest_path(directory):
    return os.path.join(directory, MANIFEST)


def read_manifest(directory, file=MANIFEST):
    """The manifest of checkpoint ``directory`` (or its ``file``: an earlier save of its
    chain), checked for its format and version.

    Raises:
        KVStoreError: no manifest (not a checkpoint, or a save that never finished), one
            that is not a distemb checkpoint's, or one of a newer version.
    """
    path = os.path.join(directory, file)
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
                           f"{file}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("tensors"), dict):
        raise KVStoreError(f"{directory}: {file} is not a distemb checkpoint's")
    version = manifest.get("version", VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > VERSION:
        raise KVStoreError(f"{directory}: {file} is of format version {version!r}; this "
                           f"distemb reads versions up to {VERSION} (upgrade it)")
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


def _rows(records):
    return sum(r["count"] for r in records or () if isinstance(r, dict) and
               isinstance(r.get("count"), int) and not isinstance(r["count"], bool))


def entry_rows(entry):
    """The rows a table entry's full save holds in all (a table of fixed keys: its
    rows)."""
    return _rows(entry.get("shards"))


def entry_keys(entry):
    """The most keys a table entry holds (its full save's rows and every delta's; for
    memory checks before a load)."""
    return entry_rows(entry) + sum(_rows(d) for d in entry.get("deltas") or ()
                                   if isinstance(d, list))
