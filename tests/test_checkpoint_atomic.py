"""A refused load changes nothing (issue 18): a checkpoint damaged in a late block, a
table whose segments do not cover it, or a manifest asking for oversized blocks is
refused before the first row of the live table is written, for array tables and for
keyed tables (whose load used to remove every key before it found the damage)."""
import json
import os

import numpy as np
import pytest

from distemb import checkpoint
from distemb.errors import KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.checkpoint import segments
from distemb.kvstore.checkpoint.shards import load_shard
from distemb.partition import range_policy
from distemb.stores import HashStore


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
