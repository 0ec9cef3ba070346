"""Checkpoints that scale out: every shard written where it lives, a manifest last.

A checkpoint is a directory (see :mod:`distemb.kvstore.checkpoint.snapshot` for its format, one
for every kind of table): one record per shard of every table, a segment file per
column (weight and optimizer states) plus one of its keys when they are not fixed,
written by the process holding that shard (each server writes its own, in parallel,
streaming in bounded blocks; the embedded store and collective ranks write the same
format), then ``manifest.json``: tables, shapes, dtypes, partition policies, the
optimizer's metadata and steps, and a CRC-32 per block. Every file is
written to a temporary name, fsynced and renamed, and the manifest goes last, so a save
that dies halfway leaves the previous checkpoint in the directory whole and loadable;
the files of the previous save are removed only once the new manifest is in place.

An incremental save (``incremental=True``) after a full one writes only the rows changed
since the directory's last save, and the keys removed or evicted since, as a delta whose
manifest names its parent (:mod:`distemb.kvstore.checkpoint.chain`); a load replays the
full save and every delta in order, and refuses a chain with a save missing or out of
order, naming it.

Rows are stored by key, so a checkpoint loads into any number of servers, any partition
policy or router, and any kind of table with the same rows: each loading shard reads
only the blocks that hold its keys. Version-2 checkpoints and a single ``.npz`` file
(this module's format before version 2) still load.

Example:
    >>> import numpy as np, tempfile, os
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> kv = LocalKVClient(); kv.init_data("w", (3, 2), "float32", range_policy(3))
    >>> p = os.path.join(tempfile.mkdtemp(), "ck")
    >>> save(p, kv, ["w"], {"note": "doc"}); read_meta(p)["note"]
    'doc'
    >>> sorted(os.listdir(p))[-1]
    'manifest.json'
"""
import json
import os
import time
import uuid
import zipfile

import numpy as np

from distemb.arrays import check_shape
from distemb.errors import DistEmbError, KVStoreError
from distemb.kvstore.checkpoint.chain import (chain_entry, link_file, read_chain,
                                              remove_unreferenced, write_manifest)
from distemb.kvstore.checkpoint.sink import read_evicted
from distemb.kvstore.checkpoint.manifest import FORMAT, MANIFEST, VERSION, read_manifest, \
    table_entry
from distemb.rules import state_name, state_owner
from distemb.stores.types import WEIGHT

CHUNK_ROWS = 1 << 20


def all_rows(client, name: str) -> np.ndarray:
    """Every row of tensor ``name`` of ``client``, as one numpy array, pulled in chunks."""
    n = client.data_meta(name).shape[0]
    parts = [client.to_host(client.pull(
                 name, client.from_host(np.arange(s, min(s + CHUNK_ROWS, n), dtype=np.int64))))
             for s in range(0, n, CHUNK_ROWS)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def push_rows(client, name: str, array: np.ndarray) -> None:
    """Write ``array`` (every row of ``name``) into ``client``, in chunks of CHUNK_ROWS rows.

    Chunks keep each request under a transport's frame limit for remote tables.
    """
    for s in range(0, array.shape[0], CHUNK_ROWS):
        ids = np.arange(s, min(s + CHUNK_ROWS, array.shape[0]), dtype=np.int64)
        client.push(name, client.from_host(ids),
                    client.from_host(np.ascontiguousarray(array[s:s + len(ids)])))


def save(path, client, names, meta, incremental=False):
    """Write tensors ``names`` of ``client`` and ``meta`` as checkpoint directory ``path``.

    The same as :func:`save_items` with ``[(client, name) for name in names]``.
    """
    save_items(path, [(client, name) for name in names], meta, incremental=incremental)


def table_columns(items):
    """``{table: (client, [column, ...])}`` of ``(client, name)`` items: a table's name
    is its weight, ``<table>~opt~<state>`` its optimizer state ``<state>``."""
    tables = {}
    for client, name in items:
        owner = state_owner(name)
        table = owner or name
        column = name[len(state_name(table, "")):] if owner else WEIGHT
        held, columns = tables.setdefault(table, (client, []))
        if held is not client:
            raise DistEmbError(f"checkpoint: table {table!r} and its optimizer state must "
                               "come from one client")
        if column not in columns:
            columns.append(column)
    return tables


def save_items(path, items, meta, writer=True, incremental=False):
    """Write tensors ``items`` (``(client, name)`` pairs) and ``meta`` as checkpoint
    directory ``path``; each client writes its own shards, where they live.

    A table and its optimizer states (``<table>~opt~<state>`` items) make one entry: a
    record per shard with a segment per column (and its keys, for a keyed table).

    With ``incremental``, the save is a delta of the directory's last save (its head,
    full or incremental): each shard writes the rows whose version moved since that save
    (every column of them) and the keys removed or evicted since, and the new manifest
    names that save as its parent. A shard that did not make or load that save itself
    refuses (it cannot know what changed since).

    One writer: call it from one process (the optimizer's collective ``save`` does, after
    a barrier); the servers write their shards in parallel. Not safe against a second
    save into the same directory at the same time.

    Args:
        path: the checkpoint directory (made if missing; an earlier checkpoint there is
            replaced only once this one is complete; a delta adds to it).
        items: ``(client, name)``: a tensor (a table, or a table's optimizer state) and
            the :class:`~distemb.kvstore.KVClient` holding it.
        meta: JSON-able metadata stored in the manifest (optimizer, steps, ...).
        writer: False on the other ranks of a collective client (its
            ``all_ranks_checkpoint``): they write their shards of every item, in the same
            order, and leave the manifest to the writer.
        incremental: write a delta of the directory's last save (see above).

    Raises:
        DistEmbError: ``path`` is a file, or a server could not write (the previous
            checkpoint at ``path`` is untouched); an incremental save where no
            checkpoint is, of other tables or columns than its parent, or by shards that
            did not make or load the parent (a full save is needed).
    """
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental: expected a bool, got {incremental!r:.40}")
    path = os.path.abspath(path)
    if os.path.isfile(path):
        raise DistEmbError(f"{path}: is a file (a single-file checkpoint of an older "
                           f"version?); checkpoints are directories now: save elsewhere")
    os.makedirs(path, exist_ok=True)
    tables = table_columns(items)
    head = _parent(path, tables) if incremental else None
    parent = None if head is None else head["save_id"]
    save_id = uuid.uuid4().hex
    tensors = {}
    for table, (client, columns) in tables.items():
        if client.data_meta(table) is None:
            raise DistEmbError(f"save: no table {table!r} in the KVStore")
        tensors[table] = client.save_table(table, path, save_id, columns, parent)
    if not writer:
        return
    manifest = dict(meta, format=FORMAT, version=VERSION, save_id=save_id,
                    created=time.time(), parent=parent,
                    links=[] if head is None else (head.get("links") or []) + [parent],
                    tensors=tensors)
    if head is not None:  # the parent's manifest kept as it is, before the head moves on
        write_manifest(path, head, link_file(parent))
    write_manifest(path, manifest)
    remove_unreferenced(path, read_chain(path))


def _parent(path, tables):
    """The head manifest of checkpoint ``path``, the parent of an incremental save of
    ``tables`` (``{table: (client, columns)}``), checked to hold those tables and
    columns.

    Raises:
        DistEmbError: no checkpoint at ``path``, or one of other tables or columns.
    """
    try:
        head = read_manifest(path)
        read_chain(path)
    except KVStoreError as e:
        raise DistEmbError(f"incremental save: {path} holds no checkpoint to add to ({e}); "
                           "make a full save there first") from None
    if not isinstance(head.get("save_id"), str):
        raise DistEmbError(f"incremental save: {path}'s last save has no save id")
    have = {}
    for name in {state_owner(n) or n for n in head["tensors"]}:
        entry = table_entry(head, name, path)
        have[name] = sorted({c for rec in entry.get("shards") or () if isinstance(rec, dict)
                             for c in rec.get("columns") or ()})
    want = {t: sorted(cols) for t, (_, cols) in tables.items()}
    if have != want:
        raise DistEmbError(f"incremental save: {path}'s last save (save {head['save_id']}) "
                           f"holds {dict(sorted(have.items()))}, this save "
                           f"{dict(sorted(want.items()))} (table: columns); a delta "
                           "saves the tables and columns of the save before it: make a "
                           "full save")
    return head


def read_meta(path):
    """The metadata (the manifest of its last save) of checkpoint ``path``.

    Raises:
        DistEmbError: ``path`` is not a complete distemb checkpoint.
    """
    if os.path.isdir(path):
        return read_manifest(path)
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise DistEmbError(f"{path}: not a distemb checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise DistEmbError(f"{path}: not a distemb checkpoint (format {meta.get('format')!r})")
    return meta


def restore(path, client, names):
    """Load the saved rows of ``names`` (tables, and optimizer states as
    ``<table>~opt~<state>``) into ``client``, under any partitioning: a chain's full
    save and every delta after it, in order. Returns the metadata of its last save.

    Raises:
        DistEmbError: no such table or column, other rows, a corrupt or missing segment,
            or a save of the chain missing or out of order.
    """
    meta = read_meta(path)
    if not os.path.isdir(path):
        return _restore_npz(path, client, names, meta)
    path = os.path.abspath(path)
    chain = read_chain(path)
    for table, (_, columns) in table_columns([(client, n) for n in names]).items():
        entry = chain_entry(chain, table, path)
        if client.data_meta(table) is None:
            raise DistEmbError(f"{path}: table {table!r} is not in the live store")
        client.load_table(table, path, entry, columns)
    return meta


def _restore_npz(path, client, names, meta):
    with np.load(path) as z:
        for name in names:
            key = f"t/{name}"
            if key not in z.files:
                raise DistEmbError(f"{path}: has no tensor {name!r} (has {meta['tensors']})")
            arr = z[key]
            want = client.data_meta(name)
            if want is None:
                raise DistEmbError(f"{path}: tensor {name!r} is not in the live store")
            check_shape(f"{path}: tensor {name!r}", arr.shape, want.shape, DistEmbError)
            push_rows(client, name, arr)
    return meta


__all__ = ["save", "save_items", "restore", "read_meta", "read_evicted", "all_rows",
           "push_rows", "MANIFEST"]
