"""One checkpoint format for every kind of table (issue 21, item 6).

A table's entry is a record per shard, a segment per column plus one of keys when they
are not fixed: a dense table's checkpoint loads into a hash table and a hash table's of
keys 0..N-1 into a dense one, with their optimizer state; checkpoints of version 2 (a
dense table and its states as separate tensors; a dynamic table's entry of kind "store")
still load. The version-2 fixtures in tests/data/checkpoint_v2 were written by the code
before version 3 (``make.py`` there); their rows are known functions of the keys, so the
oracle is arithmetic, not this code."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from distemb import DistContext, DistEmbedding, DynamicEmbedding, SparseAdagrad, checkpoint
from distemb.errors import DistEmbError, KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.partition import HashPartitionBook, NodePartitionPolicy, range_policy
from distemb.stores import HashStore

V2 = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v2")
DIM = 3


def rows_of(keys):
    """The fixtures' weight rows: key * 0.5 + column."""
    return (np.asarray(keys)[:, None] * 0.5 + np.arange(DIM)).astype(np.float32)


def sums_of(keys):
    """The fixtures' Adagrad state rows: key + 0.25."""
    return (np.asarray(keys)[:, None] + 0.25 + np.zeros(DIM)).astype(np.float32)


def hash_policy(n, parts):
    return NodePartitionPolicy(HashPartitionBook(parts, node_counts={"_N": n}))


def test_a_version_2_dense_checkpoint_loads_resharded_and_into_a_hash_table():
    assert json.load(open(os.path.join(V2, "dense", "manifest.json")))["version"] == 2
    keys = np.arange(12)
    kv = LocalKVClient()  # saved as 2 range shards; loaded into 3 hash shards
    kv.init_data("dense", (12, DIM), "float32", hash_policy(12, 3))
    kv.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 9.0})
    checkpoint.restore(V2 + "/dense", kv, ["dense", "dense~opt~sum"])
    np.testing.assert_array_equal(kv.pull("dense", keys), rows_of(keys))
    np.testing.assert_array_equal(kv.pull("dense~opt~sum", keys), sums_of(keys))
    keyed = LocalKVClient()
    keyed.add_table("dense", HashStore(DIM))
    keyed.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 9.0})
    checkpoint.restore(V2 + "/dense", keyed, ["dense", "dense~opt~sum"])
    got_keys, cols = keyed.export("dense")
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(cols["weight"], rows_of(keys))
    np.testing.assert_array_equal(cols["sum"], sums_of(keys))


def test_a_version_2_keyed_checkpoint_loads_and_is_refused_by_a_dense_table():
    keys = np.array([-7, 3, 2 ** 40, 11], np.int64)
    kv = LocalKVClient()
    kv.add_table("keyed", HashStore(DIM))
    kv.init_optimizer("keyed", "adagrad", {"initial_accumulator_value": 9.0})
    kv.push("keyed", np.array([5], np.int64), np.ones((1, DIM), np.float32))  # replaced
    checkpoint.restore(V2 + "/keyed", kv, ["keyed", "keyed~opt~sum"])
    got_keys, cols = kv.export("keyed")
    np.testing.assert_array_equal(got_keys, np.sort(keys))
    np.testing.assert_array_equal(cols["weight"], rows_of(np.sort(keys)))
    np.testing.assert_array_equal(cols["sum"], sums_of(np.sort(keys)))
    dense = LocalKVClient()  # keys -7 and 2**40 are no rows of a 4-row table
    dense.init_data("keyed", (4, DIM), "float32", range_policy(4))
    dense.push("keyed", np.arange(4), np.full((4, DIM), 2.0, np.float32))
    with pytest.raises(KVStoreError, match="covers row 0 of the 4 asked for 0 times"):
        checkpoint.restore(V2 + "/keyed", dense, ["keyed"])
    np.testing.assert_array_equal(dense.pull("keyed", np.arange(4)),
                                  np.full((4, DIM), 2.0, np.float32))


def _train(emb, opt, steps, rng):
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, 50, 64))  # duplicate-heavy
        (emb(ids) ** 2).sum().backward()
        opt.step()


def _state(emb, opt):
    keys = np.arange(50)
    st = opt.state_dict()["state"][emb.name]
    rows = emb.weight[torch.from_numpy(keys)].numpy()
    sums = st["sum"] if "keys" not in st else st["sum"][np.argsort(st["keys"])]
    return rows, np.asarray(sums)


def test_a_dense_table_trained_and_saved_resumes_as_a_dynamic_table_and_back(tmp_path):
    rng = np.random.default_rng(5)
    ctx = DistContext.embedded()
    dense = DistEmbedding(50, DIM, name="t", context=ctx,
                          init_func=lambda s, d: torch.randn(
                              s, generator=torch.Generator().manual_seed(1)))
    opt = SparseAdagrad([dense], lr=0.1)
    _train(dense, opt, 5, rng)
    opt.save(tmp_path / "dense")
    want_rows, want_sums = _state(dense, opt)
    _train(dense, opt, 3, np.random.default_rng(6))
    after_rows, after_sums = _state(dense, opt)
    ctx.close()
    manifest = json.load(open(tmp_path / "dense" / "manifest.json"))
    assert sorted(manifest["tensors"]["t"]["shards"][0]["columns"]) == ["sum", "weight"]
    ctx = DistContext.embedded()
    dyn = DynamicEmbedding(DIM, name="t", context=ctx)
    opt = SparseAdagrad([dyn], lr=0.1)
    opt.load(tmp_path / "dense")
    assert dyn.size() == 50
    rows, sums = _state(dyn, opt)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(sums, want_sums)
    _train(dyn, opt, 3, np.random.default_rng(6))  # the same steps as the dense table
    rows, sums = _state(dyn, opt)
    np.testing.assert_array_equal(rows, after_rows)
    np.testing.assert_array_equal(sums, after_sums)
    opt.save(tmp_path / "dynamic")
    ctx.close()
    ctx = DistContext.embedded()  # keys 0..49: the dynamic table's loads into 2 shards
    back = DistEmbedding(50, DIM, name="t", part_policy=range_policy(50, 2), context=ctx)
    opt = SparseAdagrad([back], lr=0.1)
    opt.load(tmp_path / "dynamic")
    rows, sums = _state(back, opt)
    np.testing.assert_array_equal(rows, after_rows)
    np.testing.assert_array_equal(sums, after_sums)
    ctx.close()


def test_a_bfloat16_table_saved_in_its_bits_loads_into_float32_rows_exactly(tmp_path):
    kv = LocalKVClient()
    kv.init_data("h", (8, DIM), "bfloat16", range_policy(8, 2))
    vals = rows_of(np.arange(8))  # multiples of 0.5 below 8: exact in bfloat16
    kv.push("h", np.arange(8), vals)
    checkpoint.save(tmp_path / "ck", kv, ["h"], {})
    entry = checkpoint.read_meta(tmp_path / "ck")["tensors"]["h"]
    assert entry["shards"][0]["columns"]["weight"]["dtype"] == "bfloat16"
    f32 = LocalKVClient()
    f32.init_data("h", (8, DIM), "float32", range_policy(8))
    checkpoint.restore(tmp_path / "ck", f32, ["h"])
    np.testing.assert_array_equal(f32.pull("h", np.arange(8)), vals)


def test_a_mixed_checkpoint_is_loaded_all_or_nothing(tmp_path):
    """A damaged state segment of one shard: neither the weight nor any shard changes."""
    shutil.copytree(V2 + "/dense", tmp_path / "ck")
    manifest = json.load(open(tmp_path / "ck" / "manifest.json"))
    seg = manifest["tensors"]["dense~opt~sum"]["segments"][1]  # a version-2 entry
    with open(tmp_path / "ck" / seg["file"], "r+b") as f:
        f.seek(5)
        f.write(b"\x7f")
    kv = LocalKVClient()
    kv.init_data("dense", (12, DIM), "float32", range_policy(12, 3))
    kv.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 9.0})
    with pytest.raises(DistEmbError, match="is corrupt"):
        checkpoint.restore(tmp_path / "ck", kv, ["dense", "dense~opt~sum"])
    np.testing.assert_array_equal(kv.pull("dense", np.arange(12)), np.zeros((12, DIM)))
    np.testing.assert_array_equal(kv.pull("dense~opt~sum", np.arange(12)),
                                  np.full((12, DIM), 9.0))
