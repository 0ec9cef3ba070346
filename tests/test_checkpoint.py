"""Scale-out checkpoints: each shard written where it lives, the manifest last; a crash
mid-save leaves the previous checkpoint loadable bit-exact; loads reshard (2 servers ->
3 servers, range -> hash, -> the embedded store); corrupt blocks are caught."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb import checkpoint
from distemb.config import parse_cluster_config
from distemb.errors import DistEmbError, KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import HashPartitionBook, NodePartitionPolicy, range_policy

pytestmark = pytest.mark.timeout(120)


def hash_policy(n, parts):
    return NodePartitionPolicy(HashPartitionBook(parts, node_counts={"_N": n}))


def cluster(tmp_path, group, n, tag):
    raw = cluster_dict(n, shared_memory=False, timeout_s=20.0)
    group.spawn_servers(write_json(tmp_path / f"{tag}.json", raw), n)
    return RemoteKVClient(parse_cluster_config(raw), 0)


def values(rows, dim, seed):
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def fill(kv, name, arr, policy, dtype="float32"):
    kv.init_data(name, arr.shape, dtype, policy)
    for s in range(0, arr.shape[0], 1 << 16):
        kv.push(name, np.arange(s, min(s + (1 << 16), arr.shape[0])), arr[s:s + (1 << 16)])


def test_embedded_round_trip_and_reshard_to_hash_partitions(tmp_path):
    a = values(1000, 8, 0)
    steps = np.arange(1000, dtype=np.int64)
    src = LocalKVClient()
    fill(src, "w", a, range_policy(1000, 2))
    src.init_optimizer("w", "adam_row_step", {})  # its state: columns of w's stores
    src.push("w~opt~row_step", np.arange(1000), steps)
    checkpoint.save(tmp_path / "ck", src, ["w", "w~opt~row_step"], {"steps": {"w": 3}})
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    # one entry per table: a record per shard, a segment per column (weight and state)
    assert list(manifest["tensors"]) == ["w"] and manifest["version"] == 3
    shards = manifest["tensors"]["w"]["shards"]
    assert [s["part"] for s in shards] == [0, 1] and [s["count"] for s in shards] == [500, 500]
    assert all(sorted(s["columns"]) == ["row_step", "weight"] and s["keys"] is None
               for s in shards)
    assert manifest["steps"] == {"w": 3} and manifest["tensors"]["w"]["dtype"] == "float32"
    dst = LocalKVClient()
    dst.init_data("w", (1000, 8), "float32", hash_policy(1000, 3))
    dst.init_optimizer("w", "adam_row_step", {})
    checkpoint.restore(tmp_path / "ck", dst, ["w", "w~opt~row_step"])
    np.testing.assert_array_equal(dst.pull("w", np.arange(1000)), a)
    np.testing.assert_array_equal(dst.pull("w~opt~row_step", np.arange(1000)), steps)


def test_a_second_save_replaces_the_first_and_removes_its_files(tmp_path):
    kv = LocalKVClient()
    fill(kv, "w", values(100, 4, 1), range_policy(100, 2))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    first = set(os.listdir(tmp_path / "ck"))
    kv.push("w", np.array([7]), np.zeros((1, 4), np.float32))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    second = set(os.listdir(tmp_path / "ck"))
    assert len(second) == 3 and first & second == {"manifest.json"}
    back = LocalKVClient()
    back.init_data("w", (100, 4), "float32", range_policy(100))
    checkpoint.restore(tmp_path / "ck", back, ["w"])
    assert back.pull("w", np.array([7])).tolist() == [[0.0] * 4]


def test_corrupt_truncated_or_mismatched_checkpoints_are_refused(tmp_path):
    kv = LocalKVClient()
    fill(kv, "w", values(100, 4, 2), range_policy(100, 2))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    seg = sorted(p for p in os.listdir(tmp_path / "ck") if p.endswith("p1.bin"))[0]
    with open(tmp_path / "ck" / seg, "r+b") as f:
        f.seek(17)
        f.write(b"\xff")
    with pytest.raises(KVStoreError, match="block 0 of segment .* is corrupt"):
        checkpoint.restore(tmp_path / "ck", kv, ["w"])
    other = LocalKVClient()
    other.init_data("w", (100, 5), "float32", range_policy(100))
    with pytest.raises(DistEmbError, match=r"column 'weight' was saved as rows \(4,\) "
                                           r"float32, the live one has rows \(5,\)"):
        checkpoint.restore(tmp_path / "ck", other, ["w"])
    fewer = LocalKVClient()
    fewer.init_data("w", (99, 4), "float32", range_policy(99))
    with pytest.raises(DistEmbError, match="saved with 100 rows, the live one has 99"):
        checkpoint.restore(tmp_path / "ck", fewer, ["w"])
    stateful = LocalKVClient()
    stateful.init_data("w", (100, 4), "float32", range_policy(100))
    stateful.init_optimizer("w", "adagrad", {})
    with pytest.raises(DistEmbError, match="column 'sum' was not saved"):
        checkpoint.restore(tmp_path / "ck", stateful, ["w", "w~opt~sum"])
    os.truncate(tmp_path / "ck" / seg, 8)
    with pytest.raises(KVStoreError, match="has 8 bytes, expected 800"):
        checkpoint.restore(tmp_path / "ck", kv, ["w"])
    os.remove(tmp_path / "ck" / "manifest.json")  # a save that never finished
    with pytest.raises(DistEmbError, match="not a distemb checkpoint"):
        checkpoint.read_meta(tmp_path / "ck")


@pytest.mark.multiprocess
def test_reshard_two_servers_to_three_servers_and_to_embedded(tmp_path):
    a = values(5000, 16, 3)
    with ProcessGroup() as group:
        two = cluster(tmp_path, group, 2, "two")
        fill(two, "w", a, range_policy(5000, 2))
        checkpoint.save(tmp_path / "ck", two, ["w"], {"note": 1})
        shards = checkpoint.read_meta(tmp_path / "ck")["tensors"]["w"]["shards"]
        assert sorted(s["part"] for s in shards) == [0, 1]  # one per shard, by its server
        three = cluster(tmp_path, group, 3, "three")
        three.init_data("w", (5000, 16), "float32", range_policy(5000, 3))
        three.init_data("h", (5000, 16), "float32", hash_policy(5000, 6))
        checkpoint.restore(tmp_path / "ck", three, ["w"])
        np.testing.assert_array_equal(three.pull("w", np.arange(5000)), a)
        with pytest.raises(DistEmbError, match="has no table 'h'"):
            checkpoint.restore(tmp_path / "ck", three, ["h"])
        for kv in (two, three):
            kv.close()
        group.wait_all(30)
    embedded = LocalKVClient()
    embedded.init_data("w", (5000, 16), "float32", range_policy(5000))
    checkpoint.restore(tmp_path / "ck", embedded, ["w"])
    np.testing.assert_array_equal(embedded.pull("w", np.arange(5000)), a)


@pytest.mark.multiprocess
def test_server_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    rows, dim = 1 << 20, 64  # 128 MiB per server: a write takes long enough to interrupt
    old = values(rows, dim, 4)
    ck = tmp_path / "ck"
    with ProcessGroup() as group:
        raw = cluster_dict(2, shared_memory=False, timeout_s=20.0)
        servers = group.spawn_servers(write_json(tmp_path / "c.json", raw), 2)
        kv = RemoteKVClient(parse_cluster_config(raw), 0)
        fill(kv, "w", old, range_policy(rows, 2))
        checkpoint.save(ck, kv, ["w"], {})
        first = checkpoint.read_meta(ck)["save_id"]
        kv.push("w", np.arange(rows), np.zeros((rows, dim), np.float32))
        failure = []
        saver = threading.Thread(target=lambda: failure.append(
            _raises(lambda: checkpoint.save(ck, kv, ["w"], {}))))
        saver.start()
        victim, deadline = None, time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            for name in os.listdir(ck):
                if name.endswith(".tmp") and not name.startswith(first):
                    victim = servers[int(name.split("-p")[1].split(".")[0]) % 2]
                    break
        assert victim is not None, "never saw the new save's segments being written"
        victim.send_signal(signal.SIGKILL)
        saver.join(60)
        for p in servers:
            p.expect = None  # killed by the test, or left without its peer
        assert failure and isinstance(failure[0], DistEmbError), failure
        assert checkpoint.read_meta(ck)["save_id"] == first
        kv.close(goodbye=False)
    back = LocalKVClient()
    back.init_data("w", (rows, dim), "float32", range_policy(rows, 3))
    checkpoint.restore(ck, back, ["w"])
    assert np.array_equal(back.pull("w", np.arange(rows)), old), "not bit-exact"


def _raises(fn):
    try:
        fn()
    except Exception as e:  # the test inspects it
        return e
    return None
