"""A refused load changes nothing (issues 18, 37): a checkpoint damaged in a late block,
a table whose segments do not cover it, a manifest asking for oversized blocks, and
checkpoints a save never writes (a key the hash index reserves, an entry whose shape
contradicts its records' rows, state without its weight into a table of any key) are
refused before the first row of the live table is written, on every store kind (keyed
tables' loads used to remove every key before they found the damage)."""
import json
import os

import numpy as np
import pytest

from distemb import checkpoint
from distemb.errors import KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.checkpoint import segments, snapshot
from distemb.kvstore.checkpoint.manifest import FORMAT, VERSION, read_manifest, table_entry
from distemb.kvstore.checkpoint.shards import load_shard
from distemb.partition import range_policy
from distemb.rules import AdagradHyper
from distemb.stores import FileStore, HashStore


def _damage_last_block(directory, suffix):
    """Flip a byte in the last block of the (only) segment whose name ends in ``suffix``."""
    manifest = json.loads((directory / "manifest.json").read_text())
    segs = [c["segment"] for t in manifest["tensors"].values() for rec in t["shards"]
            for c in rec["columns"].values() if c["segment"]["file"].endswith(suffix)]
    seg = segs[0]
    assert len(seg["crc32"]) >= 3, "the test needs a segment of several blocks"
    path = directory / seg["file"]
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\x5a")


def test_a_corrupt_last_block_leaves_an_array_table_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "BLOCK_BYTES", 4 * 16)  # 4 rows of 4 floats a block
    rng = np.random.default_rng(1)
    kv = LocalKVClient()
    kv.init_data("w", (40, 4), "float32", range_policy(40))
    kv.push("w", np.arange(40), rng.standard_normal((40, 4)).astype(np.float32))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    live = rng.standard_normal((40, 4)).astype(np.float32)
    kv.push("w", np.arange(40), live)
    _damage_last_block(tmp_path / "ck", "p0.bin")
    with pytest.raises(KVStoreError, match="block 9 of segment .* is corrupt"):
        checkpoint.restore(tmp_path / "ck", kv, ["w"])
    np.testing.assert_array_equal(kv.pull("w", np.arange(40)), live)


def test_segments_that_miss_rows_or_ask_for_huge_blocks_change_nothing(tmp_path):
    kv = LocalKVClient()
    kv.init_data("w", (10, 2), "float32", range_policy(10, 2))
    kv.push("w", np.arange(10), np.ones((10, 2), np.float32))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    live = np.full((10, 2), 3.0, np.float32)
    kv.push("w", np.arange(10), live)
    entry = manifest["tensors"]["w"]
    one = LocalKVClient()  # the whole table in one shard: rows 0..9
    one.init_data("w", (10, 2), "float32", range_policy(10))
    one.push("w", np.arange(10), live)
    ck = str(tmp_path / "ck")
    shard = one.server.table("w", 0)
    half = dict(entry, shards=entry["shards"][:1])  # rows 0..4 only
    with pytest.raises(KVStoreError, match="covers row 5 of the 10 asked for 0 times"):
        load_shard(shard, ck, half)
    twice = dict(entry, shards=entry["shards"][:1] * 2)  # rows 0..4 twice, 5..9 never
    with pytest.raises(KVStoreError, match="covers row 0 of the 10 asked for 2 times"):
        load_shard(shard, ck, twice)
    np.testing.assert_array_equal(one.pull("w", np.arange(10)), live)
    big = dict(entry, shards=[dict(r, columns={"weight": dict(
        r["columns"]["weight"], segment=dict(r["columns"]["weight"]["segment"],
                                             block_rows=1 << 40, crc32=[0]))})
        for r in entry["shards"]])
    with pytest.raises(KVStoreError, match="block_rows .* is more than a save"):
        load_shard(kv.server.table("w", 0), ck, big)
    np.testing.assert_array_equal(kv.pull("w", np.arange(10)), live)


@pytest.mark.parametrize("damage", ["weight", "state", "keys"])
def test_a_refused_load_of_a_keyed_table_keeps_every_key(tmp_path, monkeypatch, damage):
    monkeypatch.setattr(segments, "BLOCK_BYTES", 8 * 4)
    kv = LocalKVClient()
    kv.add_table("t", HashStore(4))
    kv.init_optimizer("t", "adagrad", {"initial_accumulator_value": 0.0})
    keys = np.arange(-20, 40, dtype=np.int64) * 7919
    kv.push("t", keys, np.ones((len(keys), 4), np.float32))
    checkpoint.save(tmp_path / "ck", kv, ["t", "t~opt~sum"], {})
    kept = np.array([2 ** 50, -1], np.int64)  # not in the checkpoint
    kv.push("t", kept, np.full((2, 4), 5.0, np.float32))
    before_keys, before = kv.export("t")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    rec = manifest["tensors"]["t"]["shards"][0]
    seg = rec["keys"] if damage == "keys" else \
        rec["columns"]["weight" if damage == "weight" else "sum"]["segment"]
    assert len(seg["crc32"]) >= 3
    with open(tmp_path / "ck" / seg["file"], "r+b") as f:
        f.seek(os.path.getsize(tmp_path / "ck" / seg["file"]) - 2)
        f.write(b"\x33")
    with pytest.raises(KVStoreError, match="is corrupt"):
        checkpoint.restore(tmp_path / "ck", kv, ["t", "t~opt~sum"])
    after_keys, after = kv.export("t")
    np.testing.assert_array_equal(after_keys, before_keys)
    for col in before:
        np.testing.assert_array_equal(after[col], before[col])


# -- checkpoints a load must refuse in its checking pass, on every store kind -----------

N, D = 12, 4
INT64_MIN = np.iinfo(np.int64).min


def _table(kind, tmp_path):
    """An embedded client holding table "t" of store ``kind`` (with Adagrad state), its
    rows and state unlike any checkpoint's."""
    kv = LocalKVClient()
    if kind in ("dense", "half"):
        kv.init_data("t", (N, D), "bfloat16" if kind == "half" else "float32",
                     range_policy(N))
    else:
        kv.add_table("t", HashStore(D) if kind == "hash" else
                     FileStore(str(tmp_path / "live"), N, D))
    kv.init_optimizer("t", "adagrad", {"initial_accumulator_value": 0.25})
    kv.push("t", np.arange(N), np.full((N, D), 3.0, np.float32))
    kv.push_update("t", np.array([1, 5]), np.ones((2, D), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))
    return kv


def _state(kv):
    """Every key, row and state row of "t", as bytes."""
    keys, cols = kv.export("t")
    return [keys.tobytes()] + [cols[c].tobytes() for c in sorted(cols)]


def _record(d, part, keys, columns=("weight", "sum")):
    """One keyed record of ``keys`` in directory ``d`` (rows 7.0, state 9.0)."""
    cols = {c: ((D,), "float32", lambda lo, hi, c=c: np.full(
        (hi - lo, D), 7.0 if c == "weight" else 9.0, np.float32)) for c in columns}
    return snapshot.write_shard(str(d), "0123abcd", "t", part, len(keys), cols,
                                keys=lambda lo, hi: keys[lo:hi])


def _hostile(tmp_path, name, keys, edit=None, more=()):
    """A checkpoint of one keyed record of ``keys`` (every CRC right), and ``more``
    records ``(part, keys, columns)``, its manifest entry edited by ``edit``."""
    d = tmp_path / name
    d.mkdir()
    records = [_record(d, 0, keys)] + [_record(d, *r) for r in more]
    entry = snapshot.new_entry((N, D), "float32", records)
    if edit:
        entry = edit(entry)
    (d / "manifest.json").write_text(json.dumps(
        {"format": FORMAT, "version": VERSION, "tensors": {"t": entry}}))
    return d


def _load(kv, directory, columns=("weight", "sum")):
    """Load "t" from ``directory`` as a server's Load of its one shard does (the embedded
    client's own check of the row count left out, as a token holder leaves it out)."""
    entry = table_entry(read_manifest(directory), "t", directory)
    kv.server.load("t", [0], str(directory), entry, list(columns))


KEYS = np.arange(N, dtype=np.int64)
HOSTILE = {
    # a key the hash index reserves (a save never writes one), beside keys 0..N-1
    "reserved_min": (lambda p: _hostile(p, "ck", np.append(KEYS, INT64_MIN)),
                     "is reserved by the hash table"),
    "reserved_marker": (lambda p: _hostile(p, "ck", np.insert(KEYS, 3, INT64_MIN + 1)),
                        "is reserved by the hash table"),
    # the entry's shape (version 3) or dim (version 2) contradicts its records' rows
    "shape": (lambda p: _hostile(p, "ck", KEYS, lambda e: dict(e, shape=[N, D + 1])),
              r"weight rows of shape \(4,\), the table's entry says rows of \(5,\)"),
    "dim_v2": (lambda p: _hostile(p, "ck", KEYS, lambda e: {
        "kind": "store", "dim": D - 1, "dtype": "float32", "shards": e["shards"]}),
        r"weight rows of shape \(4,\), the table's entry says rows of \(3,\)"),
}


@pytest.mark.parametrize("kind", ["dense", "half", "hash", "file"])
@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_a_hostile_checkpoint_is_refused_before_any_key_row_or_state_changes(
        tmp_path, kind, hostile):
    """Checkpoints a save never writes, every block's CRC right, are refused in the
    checking pass on every store kind, and every key, row and state row of the table
    stays the same, bit for bit. (A hash table lost every key: the writing pass removed
    them, then refused the reserved key; the other kinds loaded what the entry's shape
    contradicted, or the rows beside the reserved key.)"""
    kv = _table(kind, tmp_path)
    before = _state(kv)
    make, message = HOSTILE[hostile]
    with pytest.raises(KVStoreError, match=message):
        _load(kv, make(tmp_path))
    assert _state(kv) == before
    _load(kv, _hostile(tmp_path, "fine", KEYS))  # the same checkpoint undamaged loads
    np.testing.assert_array_equal(kv.pull("t", KEYS), np.full((N, D), 7.0, np.float32))


def test_state_without_its_weight_is_refused_by_a_table_of_any_key(tmp_path):
    """A table of any key holds the checkpoint's keys after a load, each made by the
    write of its weight: a load of its state alone, or of a record holding state and no
    weight, is refused before a key changes (the first gave every key a fresh row, the
    second inserted keys that have no saved row)."""
    kv = _table("hash", tmp_path)
    before = _state(kv)
    with pytest.raises(KVStoreError, match="loads the weight too"):
        _load(kv, _hostile(tmp_path, "whole", KEYS), ["sum"])
    bare = _hostile(tmp_path, "bare", KEYS, more=[(1, KEYS + 100, ("sum",))])
    with pytest.raises(KVStoreError, match=r"record 1 holds state \['sum'\] without the "
                                           "weight"):
        _load(kv, bare)
    assert _state(kv) == before
