"""The chain of saves of an incremental checkpoint (issue 38 item 3), and the sink of a
hash table's evicted rows (item 4), in one process: refusals named, crashes survived,
old formats extended. The placements' oracles are tests/test_checkpoint_deltas.py.

The oracle of every load is the live table it was saved from (``export``: keys, rows and
every optimizer state), or the rows a full save of the same moment loads.
"""
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import torch

from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb import checkpoint, serving
from distemb.config import parse_cluster_config
from distemb.errors import DistEmbError, KVStoreError, MissingKeyError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.checkpoint import chain, segments
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.rules import AdagradHyper
from distemb.stores import key_normal
from distemb.stores.spec import HashTableSpec

pytestmark = pytest.mark.timeout(120)
D = 4
NAMES = ["w", "w~opt~sum", "h", "h~opt~sum"]
V2 = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v2")


def tables(parts=2):
    """A client with a dense table ``w`` (100 rows) and a hash table ``h``, both with
    Adagrad state."""
    kv = LocalKVClient()
    kv.init_data("w", (100, D), "float32", range_policy(100, parts))
    kv.create_table("h", HashTableSpec(D, init=key_normal(D, seed=3)))
    for name in ("w", "h"):
        kv.init_optimizer(name, "adagrad", {"initial_accumulator_value": 0.0})
    return kv


def train(kv, seed, n=10):
    """Adagrad updates of a few rows of ``w`` and of ``h`` (keys inserted by lookup)."""
    rng = np.random.default_rng(seed)
    hyper = AdagradHyper(0.1, 1e-10)
    ids = np.unique(rng.integers(0, 100, n))
    kv.push_update("w", ids, rng.standard_normal((len(ids), D)).astype(np.float32), "adagrad",
                   hyper)
    keys = np.unique(rng.integers(-2 ** 40, 2 ** 40, n))
    kv.pull("h", keys)
    kv.push_update("h", keys, rng.standard_normal((len(keys), D)).astype(np.float32),
                   "adagrad", hyper)


def a_chain(path, deltas=2):
    """A client, its full save into ``path`` and ``deltas`` incremental saves, with keys
    of ``h`` removed and evicted between them; returns the client and those keys."""
    kv = tables()
    train(kv, 0, 60)
    checkpoint.save(path, kv, NAMES, {})
    gone = []
    for k in range(deltas):
        train(kv, k + 1)
        gone.append(kv.export("h")[0][:3])
        kv.remove("h", gone[-1])
        gone.append(kv.evict("h", kv.size("h") - 4))
        checkpoint.save(path, kv, NAMES, {}, incremental=True)
    return kv, np.concatenate(gone)


def exported(kv):
    return {n: kv.export(n) for n in ("w", "h")}


def assert_same(got, want):
    for name in want:
        np.testing.assert_array_equal(got[name][0], want[name][0], err_msg=f"{name}: keys")
        for col in want[name][1]:
            np.testing.assert_array_equal(got[name][1][col], want[name][1][col],
                                          err_msg=f"{name}: {col}")


def restored(path, parts=3):
    kv = tables(parts)
    checkpoint.restore(path, kv, NAMES)
    return kv


def test_a_chain_loads_as_its_live_table_resharded_and_serves(tmp_path):
    ck = tmp_path / "ck"
    kv, gone = a_chain(ck)
    want = exported(kv)
    assert_same(exported(restored(ck)), want)
    w = serving.load(ck, "w")
    np.testing.assert_array_equal(w.weight.numpy(), want["w"][1]["weight"])
    h = serving.load(ck, "h")
    keys = want["h"][0]
    np.testing.assert_array_equal(h(torch.from_numpy(keys)).numpy(), want["h"][1]["weight"])
    assert len(gone) == 14 and not np.isin(gone, keys).any()
    for key in gone:  # removed and evicted keys are not served, though the full save has them
        with pytest.raises(MissingKeyError):
            h(torch.tensor([int(key)]))
    # every file in the directory is one the chain names
    saves = chain.read_chain(str(ck))
    names = set(os.listdir(ck))
    named = {"manifest.json"} | {chain.link_file(m["save_id"]) for m in saves[:-1]}
    for m in saves:
        named |= chain.manifest_files(m, str(ck))
    assert names == named, names ^ named


def test_a_delta_after_a_load_continues_the_chain(tmp_path):
    """A process that loaded the chain (and no other) adds deltas to it."""
    ck = tmp_path / "ck"
    a_chain(ck)
    kv = restored(ck, parts=1)
    train(kv, 9)
    kv.remove("h", kv.export("h")[0][:2])
    checkpoint.save(ck, kv, NAMES, {}, incremental=True)
    assert len(checkpoint.read_meta(ck)["links"]) == 3
    assert_same(exported(restored(ck)), exported(kv))


def test_a_missing_save_is_refused_naming_it_and_nothing_changes(tmp_path):
    ck = tmp_path / "ck"
    a_chain(ck)
    base, first = checkpoint.read_meta(ck)["links"]
    live = tables()
    train(live, 5)
    before = exported(live)
    os.remove(ck / chain.link_file(first))
    with pytest.raises(KVStoreError, match=f"delta 1 of the chain \\(save {first}\\) is missing: "
                                           f"no link-{first}.json"):
        checkpoint.restore(ck, live, NAMES)
    os.remove(ck / chain.link_file(base))
    with pytest.raises(KVStoreError, match=f"the full save of the chain \\(save {base}\\) is "
                                           "missing"):
        checkpoint.restore(ck, live, NAMES)
    with pytest.raises(KVStoreError, match="missing"):
        serving.load(ck, "w")
    assert_same(exported(live), before)


def test_saves_out_of_order_are_refused_naming_them(tmp_path):
    ck = tmp_path / "ck"
    a_chain(ck, deltas=3)
    head = checkpoint.read_meta(ck)
    base, d1, d2 = head["links"]
    good = dict(head)

    def refused(manifest, pattern, link=None):
        shutil.copytree(ck, tmp_path / "bad")
        if link is not None:
            shutil.copy(ck / chain.link_file(link[1]), tmp_path / "bad" / chain.link_file(link[0]))
        if manifest is not None:
            (tmp_path / "bad" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(KVStoreError, match=pattern):
            checkpoint.restore(tmp_path / "bad", tables(), NAMES)
        shutil.rmtree(tmp_path / "bad")

    refused(dict(good, links=[base, d2, d1]), f"delta 1 \\(link-{d2}.json, save {d2}\\) follows "
            f"save '{d1}', but the full save is save {base}: the saves are out of order")
    refused(dict(good, links=[d1, base, d2]), f"the full save \\(link-{d1}.json, save {d1}\\) "
            f"follows save '{base}', but it is the first")
    refused(dict(good, parent=d1), f"delta 3 \\(manifest.json, save {head['save_id']}\\) "
            f"follows save '{d1}', but delta 2 is save {d2}")
    refused(None, f"link-{d1}.json holds save '{d2}', the chain has save {d1} there",
            link=(d1, d2))


def test_an_incremental_save_needs_a_parent_this_process_made_or_loaded(tmp_path):
    kv = tables()
    train(kv, 0)
    with pytest.raises(DistEmbError, match="holds no checkpoint to add to .*make a full "
                                           "save there first"):
        checkpoint.save(tmp_path / "none", kv, NAMES, {}, incremental=True)
    checkpoint.save(tmp_path / "ck", kv, NAMES, {})
    base = checkpoint.read_meta(tmp_path / "ck")["save_id"]
    other = tables()  # it never saw that save
    with pytest.raises(KVStoreError, match=f"shard 0 of 'w' did not make or load save {base}"):
        checkpoint.save(tmp_path / "ck", other, NAMES, {}, incremental=True)
    for _ in range(2):  # two full saves elsewhere: the mark of the first is gone
        checkpoint.save(tmp_path / "elsewhere", kv, NAMES, {})
    with pytest.raises(KVStoreError, match=f"did not make or load save {base}"):
        checkpoint.save(tmp_path / "ck", kv, NAMES, {}, incremental=True)
    with pytest.raises(DistEmbError, match="holds {'h': \\['sum', 'weight'\\], 'w': \\['sum', "
                                           "'weight'\\]}, this save {'h': \\['weight'\\], 'w': "
                                           "\\['sum', 'weight'\\]}"):
        checkpoint.save(tmp_path / "elsewhere", kv, ["w", "w~opt~sum", "h"], {},
                        incremental=True)
    weights = tables()  # a load of the weights alone does not describe the state
    checkpoint.restore(tmp_path / "elsewhere", weights, ["w", "h"])
    with pytest.raises(KVStoreError, match="did not make or load save"):
        checkpoint.save(tmp_path / "elsewhere", weights, NAMES, {}, incremental=True)
    assert len(checkpoint.read_meta(tmp_path / "ck")["links"]) == 0


def test_a_delta_that_dies_before_its_manifest_leaves_the_chain_and_the_next_delta_works(
        tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    kv, _ = a_chain(ck, deltas=1)
    want = exported(kv)
    head = checkpoint.read_meta(ck)["save_id"]
    train(kv, 7)
    real = checkpoint.write_manifest

    def dies(directory, manifest, file="manifest.json"):
        if file == "manifest.json":
            raise OSError("the machine went down")
        real(directory, manifest, file)
    monkeypatch.setattr(checkpoint, "write_manifest", dies)
    with pytest.raises(OSError):
        checkpoint.save(ck, kv, NAMES, {}, incremental=True)
    monkeypatch.undo()
    assert checkpoint.read_meta(ck)["save_id"] == head
    assert_same(exported(restored(ck)), want)
    calls = []

    def breaks(*args, **kw):  # a shard's write fails halfway
        calls.append(1)
        if len(calls) == 3:
            raise KVStoreError("checkpoint: cannot write (disk full)")
        return real_segment(*args, **kw)
    real_segment = segments.write_segment
    monkeypatch.setattr("distemb.kvstore.checkpoint.snapshot.write_segment", breaks)
    with pytest.raises(KVStoreError, match="disk full"):
        checkpoint.save(ck, kv, NAMES, {}, incremental=True)
    monkeypatch.undo()
    assert_same(exported(restored(ck)), want)
    train(kv, 8)
    checkpoint.save(ck, kv, NAMES, {}, incremental=True)  # against the head: still marked
    assert_same(exported(restored(ck)), exported(kv))
    saves = chain.read_chain(str(ck))
    named = {"manifest.json"} | {chain.link_file(m["save_id"]) for m in saves[:-1]}
    for m in saves:
        named |= chain.manifest_files(m, str(ck))
    assert set(os.listdir(ck)) == named, "the dead saves' files were not removed"


def test_a_corrupt_delta_is_refused_before_anything_changes(tmp_path):
    ck = tmp_path / "ck"
    a_chain(ck)
    head = checkpoint.read_meta(ck)
    seg = head["tensors"]["h"]["shards"][0]["columns"]["weight"]["segment"]["file"]
    with open(ck / seg, "r+b") as f:
        f.seek(2)
        f.write(b"\x5a\x5a")
    live = tables()
    train(live, 4)
    before = exported(live)
    with pytest.raises(KVStoreError, match="is corrupt"):  # each table all or nothing
        checkpoint.restore(ck, live, ["h", "h~opt~sum"])
    assert_same(exported(live), before)


def test_a_version_2_checkpoint_takes_deltas_and_a_newer_version_is_refused(tmp_path):
    ck = tmp_path / "dense"
    shutil.copytree(os.path.join(V2, "dense"), ck)
    kv = LocalKVClient()
    kv.init_data("dense", (12, 3), "float32", range_policy(12, 2))
    kv.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 0.0})
    checkpoint.restore(ck, kv, ["dense", "dense~opt~sum"])
    kv.push("dense", np.array([5]), np.full((1, 3), 9.0, np.float32))
    checkpoint.save(ck, kv, ["dense", "dense~opt~sum"], {}, incremental=True)
    head = checkpoint.read_meta(ck)
    assert head["version"] == 4 and len(head["links"]) == 1
    assert [r["count"] for r in head["tensors"]["dense"]["shards"]] == [1, 0]
    back = LocalKVClient()
    back.init_data("dense", (12, 3), "float32", range_policy(12, 3))
    back.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 0.0})
    checkpoint.restore(ck, back, ["dense", "dense~opt~sum"])
    for name in ("dense", "dense~opt~sum"):
        np.testing.assert_array_equal(back.pull(name, np.arange(12)), kv.pull(name, np.arange(12)))
    (ck / "manifest.json").write_text(json.dumps(dict(head, version=5)))
    with pytest.raises(KVStoreError, match="manifest.json is of format version 5; this distemb "
                                           "reads versions up to 4"):
        checkpoint.restore(ck, back, ["dense"])


# -- the sink of evicted rows ---------------------------------------------------------


def test_a_callable_sink_gets_every_evicted_row_with_its_state_and_no_removed_one():
    """The sink's rows are those ``get`` read just before each eviction."""
    got = []
    kv = LocalKVClient()
    kv.create_table("s", HashTableSpec(D, init=key_normal(D), capacity=8, low_water=0.5,
                                       sink=lambda k, c: got.append((k.copy(), c))))
    kv.init_optimizer("s", "adagrad", {"initial_accumulator_value": 0.0})
    seen = {}
    for step in range(6):
        keys = np.arange(4, dtype=np.int64) + 10 * step
        held, cols = kv.export("s")
        seen.update({int(k): (w, s) for k, w, s in zip(held, cols["weight"], cols["sum"])})
        kv.pull("s", keys)
        kv.push_update("s", keys, np.full((4, D), step + 1.0, np.float32), "adagrad",
                       AdagradHyper(0.1, 1e-10))
    kv.remove("s", np.array([50, 51]))  # a removal: not sunk
    sunk = np.concatenate([k for k, _ in got])
    assert sorted(sunk.tolist()) == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32,
                                     33], sunk
    assert [len(k) for k, _ in got] == [8, 8], "one eviction for each lookup past capacity"
    assert (np.diff(sunk // 10) >= 0).all(), f"not least recent first: {sunk}"
    for keys, cols in got:
        assert sorted(cols) == ["sum", "weight"] and cols["weight"].dtype == np.float32
        for k, w, s in zip(keys, cols["weight"], cols["sum"]):
            np.testing.assert_array_equal(w, seen[int(k)][0])
            np.testing.assert_array_equal(s, seen[int(k)][1])


def test_a_sink_that_fails_keeps_the_rows_and_a_function_is_refused_for_servers(tmp_path):
    def full(keys, columns):
        raise OSError("no room for evicted rows")
    kv = LocalKVClient()
    kv.create_table("s", HashTableSpec(D, capacity=4, sink=full))
    kv.pull("s", np.arange(4))
    with pytest.raises(OSError, match="no room"):
        kv.pull("s", np.arange(4, 6))
    with pytest.raises(OSError, match="no room"):
        kv.evict("s", 0)
    assert kv.contains("s", np.arange(4)).all()
    with pytest.raises(TypeError, match="sink: .* a server cannot call it: give a directory"):
        HashTableSpec(D, sink=full).fields()
    with pytest.raises(TypeError, match="sink: expected None, a callable"):
        HashTableSpec(D, sink=3)


def test_a_sink_directory_reads_back_in_order_and_ignores_a_torn_last_line(tmp_path):
    kv = LocalKVClient()
    kv.create_table("s", HashTableSpec(D, dtype="bfloat16", init=key_normal(D), capacity=4,
                                       sink=str(tmp_path / "sink")))
    for step in range(5):
        kv.pull("s", np.arange(3, dtype=np.int64) + 10 * step)
    sunk = list(checkpoint.read_evicted(tmp_path / "sink", "s"))
    keys = np.concatenate([k for _, k, _ in sunk])
    # 3 keys a lookup, capacity 4: each lookup evicts down to 4, sparing its own keys
    assert (keys // 10).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], keys
    assert len(np.unique(keys)) == len(keys) and (keys % 10 < 3).all(), keys
    rows = np.concatenate([c["weight"] for _, _, c in sunk])
    assert rows.dtype == np.float32  # bfloat16 rows decoded, as lookups return them
    want = key_normal(D)(keys)
    np.testing.assert_allclose(rows, want, rtol=1e-2, atol=1e-2)
    log, = [f for f in os.listdir(tmp_path / "sink") if f.endswith(".jsonl")]
    with open(tmp_path / "sink" / log, "a", encoding="utf-8") as f:
        f.write('{"table": "s", "par')  # a process died while appending
    assert [k.tolist() for _, k, _ in checkpoint.read_evicted(tmp_path / "sink", "s")] == \
        [k.tolist() for _, k, _ in sunk]


# -- a server killed while it writes a delta -------------------------------------------


@pytest.mark.multiprocess
def test_a_server_killed_mid_delta_leaves_the_chain_loadable_bit_exact(tmp_path):
    rows, dim = 1 << 20, 64  # a delta of every row: 128 MiB per server, long enough to cut
    rng = np.random.default_rng(4)
    ck = tmp_path / "ck"
    with ProcessGroup() as group:
        raw = cluster_dict(2, shared_memory=False, timeout_s=20.0)
        servers = group.spawn_servers(write_json(tmp_path / "c.json", raw), 2)
        kv = RemoteKVClient(parse_cluster_config(raw), 0)
        kv.init_data("w", (rows, dim), "float32", range_policy(rows, 2))
        checkpoint.save(ck, kv, ["w"], {})
        touched = np.arange(0, rows, 997)
        kv.push("w", touched, rng.standard_normal((len(touched), dim)).astype(np.float32))
        checkpoint.save(ck, kv, ["w"], {}, incremental=True)
        head = checkpoint.read_meta(ck)["save_id"]
        want = np.concatenate([kv.pull("w", np.arange(s, min(rows, s + (1 << 18))))
                               for s in range(0, rows, 1 << 18)])
        for s in range(0, rows, 1 << 18):
            kv.push("w", np.arange(s, min(rows, s + (1 << 18))),
                    np.zeros((min(rows, s + (1 << 18)) - s, dim), np.float32))
        failure, known = [], set(os.listdir(ck))
        saver = threading.Thread(target=lambda: failure.append(
            _raises(lambda: checkpoint.save(ck, kv, ["w"], {}, incremental=True))))
        saver.start()
        victim, deadline = None, time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            for name in os.listdir(ck):
                if name.endswith(".tmp") and name not in known and "-p" in name:
                    victim = servers[int(name.split("-p")[1].split(".")[0]) % 2]
                    break
        assert victim is not None, "never saw the delta's segments being written"
        victim.send_signal(signal.SIGKILL)
        saver.join(60)
        for p in servers:
            p.expect = None  # killed by the test, or left without its peer
        assert failure and isinstance(failure[0], DistEmbError), failure
        assert checkpoint.read_meta(ck)["save_id"] == head
        kv.close(goodbye=False)
    back = LocalKVClient()
    back.init_data("w", (rows, dim), "float32", range_policy(rows, 3))
    checkpoint.restore(ck, back, ["w"])
    assert np.array_equal(back.pull("w", np.arange(rows)), want), "not bit-exact"


def _raises(fn):
    try:
        fn()
    except Exception as e:  # the test inspects it
        return e
    return None
