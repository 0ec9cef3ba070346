"""The store-client suite: every test runs on the embedded LocalKVClient and on the
RemoteKVClient of two server processes (keys sharded by key hash).

The fixture hands out the *placement* client (LocalKVClient or RemoteKVClient); tests
get the store client from it (``store_client()``) or build a DynamicEmbedding in a
context around it, and use only the keyed-table interface (distemb.kvstore.keyed), so any difference between
embedded and sharded dynamic tables is a bug. Oracles: the key initialiser itself,
numpy reference kernels on a dense copy, and the table's own export before a round trip.
"""
import uuid

import numpy as np
import pytest
import torch

from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb import checkpoint
from distemb.config import parse_cache_config, parse_cluster_config
from distemb.context import DistContext
from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.embedding import DistEmbedding
from distemb.errors import DistEmbError, KVStoreError, MissingKeyError, StoreError
from distemb.kernels import reference
from distemb.kvstore import LocalKVClient, RemoteKVClient
from distemb.kvstore.cache import CachedKVClient
from distemb.optim import SparseAdagrad
from distemb.partition import key_partition
from distemb.rules import AdagradHyper, SGDHyper
from distemb.stores import HashStore, key_normal, key_uniform
from distemb.stores.spec import FileTableSpec, HashTableSpec
from distemb.transport.messages import Pull

pytestmark = pytest.mark.timeout(60)
KEYS = np.array([5, -3, 2 ** 62, 0, -(2 ** 40), 123456789], np.int64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = cluster_dict(2, timeout_s=20.0, shared_memory=False)
    path = write_json(tmp_path_factory.mktemp("dyn") / "c.json", raw)
    group = ProcessGroup()
    group.spawn_servers(path, 2)
    cfg = parse_cluster_config(raw)
    yield cfg
    try:
        RemoteKVClient(cfg, 0).close(goodbye=True)
        group.wait_all(20)
    finally:
        group.__exit__(None, None, None)


#: Trainer caches in front of the two servers: exact (LRU of 4 rows: it evicts a lot) and
#: bounded staleness (LFU with admission); both must keep every test's results.
CACHES = {"remote+lru": {"policy": "lru", "rows": 4},
          "remote+lfu_stale": {"policy": "lfu", "rows": 4, "staleness": 3}}


@pytest.fixture(params=["embedded", "remote", *CACHES])
def base(request):
    """The placement client: tables in this process, on two servers, or on two servers
    behind a trainer cache."""
    if request.param == "embedded":
        kv = LocalKVClient()
    else:
        request.node.add_marker(pytest.mark.multiprocess)
        kv = RemoteKVClient(request.getfixturevalue("cluster"), 0)
        if request.param in CACHES:
            kv = CachedKVClient(kv, parse_cache_config(CACHES[request.param]))
    yield kv
    kv.close() if request.param == "embedded" else kv.close(goodbye=False)


def table(base, **spec):
    kv = base.store_client()
    name = f"t-{uuid.uuid4().hex[:8]}"
    kv.create_table(name, HashTableSpec(**{"dim": 3, "init": key_normal(3, seed=4), **spec}))
    return kv, name


def test_lookup_inserts_the_initialiser_rows_wherever_the_key_lives(base):
    kv, name = table(base)
    rows = kv.pull(name, np.concatenate([KEYS, KEYS[:2]]))
    np.testing.assert_array_equal(rows[:len(KEYS)], key_normal(3, seed=4)(KEYS))
    np.testing.assert_array_equal(rows[len(KEYS):], rows[:2])
    assert kv.size(name) == len(KEYS)
    assert kv.contains(name, np.array([5, 6])).tolist() == [True, False]
    assert sorted(kv.export(name)[0].tolist()) == sorted(KEYS.tolist())
    kv.delete_data(name)


def test_upsert_get_remove_and_a_removed_key_read_back(base):
    kv, name = table(base)
    kv.push(name, KEYS[:3], np.arange(9, dtype=np.float32).reshape(3, 3))
    np.testing.assert_array_equal(kv.get(name, KEYS[1:2]), [[3.0, 4.0, 5.0]])
    assert kv.remove(name, np.array([KEYS[1], 999])) == 1
    assert kv.size(name) == 2
    with pytest.raises(MissingKeyError, match="not in the store"):
        kv.get(name, KEYS[1:2])
    assert kv.contains(name, KEYS[:3]).tolist() == [True, False, True]
    # a key that comes back starts again from its initial row
    np.testing.assert_array_equal(kv.pull(name, KEYS[1:2]), key_normal(3, seed=4)(KEYS[1:2]))
    kv.delete_data(name)


def test_bad_keys_and_specs_are_refused_with_their_names(base):
    kv, name = table(base)
    with pytest.raises(TypeError, match="integer"):
        kv.pull(name, np.array([1.5]))
    with pytest.raises(ValueError, match="reserved"):
        kv.pull(name, np.array([-2 ** 63], np.int64))
    with pytest.raises(ValueError, match="capacity"):
        HashTableSpec(3, capacity=0)
    with pytest.raises(ValueError, match="evict"):
        HashTableSpec(3, evict="fifo")
    with pytest.raises(ValueError, match="policy"):
        kv.evict(name, 0, policy="mru")
    kv.delete_data(name)


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_updates_match_the_reference_kernels_on_a_dense_copy(base, rule):
    kv, name = table(base)
    kv.init_optimizer(name, rule, {})
    dense = key_normal(3, seed=4)(KEYS)
    state = np.zeros_like(dense)
    rng = np.random.default_rng(1)
    for _ in range(4):
        pick = rng.choice(len(KEYS), 4, replace=False)
        grads = rng.standard_normal((4, 3)).astype(np.float32)
        if rule == "sgd":
            kv.push_update(name, KEYS[pick], grads, rule, SGDHyper(lr=0.1))
            reference.sgd_update(dense, pick, grads, 0.1)
        else:
            kv.push_update(name, KEYS[pick], grads, rule, AdagradHyper(clr=0.1, eps=1e-10))
            reference.adagrad_update(dense, state, pick, grads, 0.1, 1e-10)
    touched = kv.export(name)[0]
    want = {int(k): dense[i] for i, k in enumerate(KEYS)}
    got = kv.get(name, touched)
    np.testing.assert_array_equal(got, np.stack([want[int(k)] for k in touched]))
    kv.delete_data(name)


def test_export_import_round_trip_with_state(base):
    kv, name = table(base)
    kv.init_optimizer(name, "adagrad", {})
    kv.push_update(name, KEYS, np.ones((len(KEYS), 3), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))
    keys, cols = kv.export(name)
    assert list(keys) == sorted(keys) and sorted(cols) == ["sum", "weight"]
    kv2, name2 = table(base)
    kv2.init_optimizer(name2, "adagrad", {})
    kv2.import_(name2, keys, cols)
    keys2, cols2 = kv2.export(name2)
    np.testing.assert_array_equal(keys2, keys)
    for c in cols:
        np.testing.assert_array_equal(cols2[c], cols[c])
    with pytest.raises(StoreError, match="nope"):
        kv2.import_(name2, keys, {"nope": cols["sum"]})
    kv.delete_data(name)
    kv2.delete_data(name2)


def test_capacity_evicts_with_the_state_and_spares_the_last_lookup(base):
    kv, name = table(base, capacity=4, evict="lru")
    kv.init_optimizer(name, "adagrad", {})
    kv.push_update(name, KEYS[:2], np.ones((2, 3), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))
    for k in range(100, 130):
        kv.pull(name, np.array([k]))
    assert kv.size(name) <= 4 and kv.contains(name, np.array([129])).all()
    assert not kv.contains(name, KEYS[:2]).any()
    _, cols = kv.export(name, ["sum"])
    assert (cols["sum"] == 0).all(), "the evicted rows' state was left behind"
    evicted = kv.evict(name, 0)
    assert kv.size(name) == 0 and 129 in evicted.tolist()
    kv.delete_data(name)


def test_checkpoint_round_trip_replaces_the_keys(base, tmp_path):
    kv, name = table(base, init=key_uniform(3, seed=8))
    kv.init_optimizer(name, "adagrad", {})
    kv.push_update(name, KEYS, np.ones((len(KEYS), 3), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))
    before = kv.export(name)
    path = str(tmp_path / "ck")
    names = [name, f"{name}~opt~sum"]  # the table and its optimizer state
    checkpoint.save_items(path, [(kv, n) for n in names], {"note": "suite"})
    kv.remove(name, KEYS[:3])
    kv.pull(name, np.array([42]))  # a key the checkpoint does not have: gone after load
    checkpoint.restore(path, kv, names)
    after = kv.export(name)
    np.testing.assert_array_equal(after[0], before[0])
    for c in before[1]:
        np.testing.assert_array_equal(after[1][c], before[1][c])
    kv.delete_data(name)


def test_dynamic_embedding_trains_in_either_placement(base):
    ctx = DistContext(base, backend="pytorch")
    emb = DynamicEmbedding(3, name=f"e-{uuid.uuid4().hex[:8]}",
                           init_func=key_normal(3, seed=4), context=ctx)
    opt = SparseAdagrad([emb], lr=0.5)
    ids = torch.from_numpy(np.concatenate([KEYS, KEYS[:3]]))
    emb(ids).sum().backward()
    opt.step()
    assert emb.size() == len(KEYS) and emb.contains(torch.tensor([5, 6])).tolist() == [
        True, False]
    # each key's summed gradient is its count: Adagrad moves it by lr * sign = 0.5
    np.testing.assert_allclose(emb.get(torch.from_numpy(KEYS)).numpy(),
                               key_normal(3, seed=4)(KEYS) - 0.5, rtol=0, atol=1e-6)
    assert emb.remove(torch.tensor([5])) == 1 and emb.size() == len(KEYS) - 1
    emb.kvstore.delete_data(emb.name)


def test_keys_are_spread_by_their_hash(base):
    """Each server holds the keys key_partition gives it (one server embedded)."""
    kv, name = table(base)
    keys = np.arange(-500, 500, dtype=np.int64) * 7919
    kv.pull(name, keys)
    per_server = np.bincount(key_partition(keys, base.num_servers), minlength=base.num_servers)
    assert per_server.min() > 0.4 * len(keys) / base.num_servers
    assert kv.size(name) == len(keys)
    kv.delete_data(name)


@pytest.mark.multiprocess
def test_a_cluster_refuses_a_plain_init_function_and_a_store_object(cluster):
    kv = RemoteKVClient(cluster, 0)
    try:
        ctx = DistContext(kv, backend="pytorch", role="trainer")
        with pytest.raises(TypeError, match=r"key_normal\(dim, std, seed\)"):
            DynamicEmbedding(3, name="plain", init_func=lambda keys: np.zeros((len(keys), 3)),
                             context=ctx)
        with pytest.raises(KVStoreError, match="store object lives in this process.*pass a "
                                               "table spec"):
            StoreEmbedding(HashStore(3), name="object", context=ctx)
        assert "plain" not in kv.store_client().names()
    finally:
        kv.close(goodbye=False)


def test_bfloat16_rows_round_to_nearest_even_in_either_placement(base):
    kv, name = table(base, dtype="bfloat16")
    vals = np.array([[1.0, 1.00390625, 1.01171875]], np.float32)  # 1, 1 + 2**-8, 1 + 3 * 2**-8
    kv.push(name, KEYS[:1], vals)
    # bfloat16 keeps 7 fraction bits: 1 + 2**-8 is a tie (to even: 1), 1 + 3 * 2**-8 rounds up
    np.testing.assert_array_equal(kv.get(name, KEYS[:1]), [[1.0, 1.0, 1.015625]])
    assert kv.export(name)[1]["weight"].dtype == np.float32
    kv.delete_data(name)


def test_optimizer_state_dict_round_trip_in_either_placement(base):
    ctx = DistContext(base, backend="pytorch")
    tag = uuid.uuid4().hex[:8]
    a = DynamicEmbedding(3, name=f"a-{tag}", init_func=key_normal(3, seed=4), context=ctx)
    opt_a = SparseAdagrad([a], lr=0.5)
    a(torch.from_numpy(KEYS)).sum().backward()
    opt_a.step()
    sd, rows = opt_a.state_dict(), a.export()
    b = DynamicEmbedding(3, name=f"b-{tag}", init_func=key_normal(3, seed=4), context=ctx)
    opt_b = SparseAdagrad([b], lr=0.5)
    b.import_({"keys": rows["keys"], "weight": rows["weight"]})
    sd["state"][b.name] = sd["state"].pop(a.name)
    opt_b.load_state_dict(sd)
    got = b.export()
    for col in rows:
        np.testing.assert_array_equal(got[col], rows[col])
    assert (got["sum"] > 0).all()
    a.kvstore.delete_data(a.name)
    b.kvstore.delete_data(b.name)


@pytest.mark.multiprocess
def test_a_server_refuses_keys_another_server_owns(cluster):
    """A trainer routing with another server count would scatter a key's rows: refused."""
    kv = RemoteKVClient(cluster, 0)
    try:
        dyn = kv.store_client()
        dyn.create_table("routed", HashTableSpec(2))
        keys = np.arange(50, dtype=np.int64)
        theirs = keys[key_partition(keys, 2) == 1][:1]
        with pytest.raises(KVStoreError, match=f"key {int(theirs[0])} .* belongs to server 1"):
            kv._call({0: Pull(name="routed", parts=[0], counts=[1], ids=theirs)})
        assert dyn.size("routed") == 0
        dyn.delete_data("routed")
    finally:
        kv.close(goodbye=False)


# --- file-backed tables: FileTableSpec, one FileStore per shard, keys routed by range ----

FILE_ROWS = 50


def file_table(base, tmp_path, name=None, **spec):
    kv = base.store_client()
    name = name or f"f-{uuid.uuid4().hex[:8]}"
    kv.create_table(name, FileTableSpec(str(tmp_path / "files" / name), num_rows=FILE_ROWS,
                                        dim=3, init=key_normal(3, seed=4),
                                        preallocate=False, **spec))
    return kv, name


def test_a_file_table_holds_every_key_of_its_range_wherever_it_lives(base, tmp_path):
    kv, name = file_table(base, tmp_path)
    keys = np.array([0, 24, 25, 49, 7, 7], np.int64)
    np.testing.assert_array_equal(kv.pull(name, keys), key_normal(3, seed=4)(keys))
    assert kv.size(name) == FILE_ROWS and kv.capacity(name) in (None, FILE_ROWS)
    assert kv.contains(name, np.array([0, 49])).tolist() == [True, True]
    exported = kv.export(name)
    assert exported[0].tolist() == list(range(FILE_ROWS))
    np.testing.assert_array_equal(exported[1]["weight"],
                                  key_normal(3, seed=4)(np.arange(FILE_ROWS)))
    with pytest.raises(DistEmbError, match="out of range"):
        kv.pull(name, np.array([FILE_ROWS]))
    with pytest.raises(DistEmbError, match="fixed keys"):
        kv.remove(name, np.array([3]))
    with pytest.raises(DistEmbError, match="fixed keys"):
        kv.evict(name, 10)
    kv.delete_data(name)


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_file_table_updates_match_the_reference_kernels(base, tmp_path, rule):
    kv, name = file_table(base, tmp_path)
    kv.init_optimizer(name, rule, {})
    dense = key_normal(3, seed=4)(np.arange(FILE_ROWS))
    state = np.zeros_like(dense)
    rng = np.random.default_rng(2)
    for _ in range(5):
        pick = rng.choice(FILE_ROWS, 12, replace=False).astype(np.int64)
        grads = rng.standard_normal((12, 3)).astype(np.float32)
        if rule == "sgd":
            kv.push_update(name, pick, grads, "sgd", SGDHyper(lr=0.1))
            reference.sgd_update(dense, pick, grads, 0.1)
        else:
            kv.push_update(name, pick, grads, "adagrad", AdagradHyper(clr=0.1, eps=1e-10))
            reference.adagrad_update(dense, state, pick, grads, 0.1, 1e-10)
    keys, cols = kv.export(name)
    np.testing.assert_array_equal(cols["weight"], dense)
    if rule == "adagrad":
        np.testing.assert_array_equal(cols["sum"], state)
    kv.delete_data(name)


def test_a_file_table_reopens_with_its_rows_and_locks_its_files(base, tmp_path):
    """Closing (here: dropping) a file table flushes and unlocks its shards' files; made
    again from the same spec, it has its rows back."""
    kv, name = file_table(base, tmp_path)
    kv.push(name, np.array([1, 40]), np.full((2, 3), 7.0, np.float32))
    kv.delete_data(name)
    kv, _ = file_table(base, tmp_path, name=name)
    np.testing.assert_array_equal(kv.get(name, np.array([1, 40, 2])),
                                  [[7.0] * 3, [7.0] * 3, key_normal(3, seed=4)([2])[0]])
    kv.delete_data(name)


def test_a_file_table_checkpoint_loads_under_another_shard_count(cluster, tmp_path):
    """Saved by two servers (each its range, keys saved as the table's keys), loaded into
    one embedded shard, and back: the rows and state are the same everywhere."""
    remote = RemoteKVClient(cluster, 0)
    local = LocalKVClient()
    try:
        kv, name = file_table(remote, tmp_path)
        kv.init_optimizer(name, "adagrad", {})
        ids = np.array([0, 3, 24, 25, 26, 49], np.int64)
        kv.push_update(name, ids, np.ones((len(ids), 3), np.float32), "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))
        want = kv.export(name)
        path = str(tmp_path / "ck")
        names = [name, f"{name}~opt~sum"]  # the table and its optimizer state
        checkpoint.save_items(path, [(kv, n) for n in names], {"note": "file"})
        emb_kv, _ = file_table(local, tmp_path / "embedded", name=name)
        emb_kv.init_optimizer(name, "adagrad", {})
        checkpoint.restore(path, emb_kv, names)
        got = emb_kv.export(name)
        np.testing.assert_array_equal(got[0], want[0])
        for c in want[1]:
            np.testing.assert_array_equal(got[1][c], want[1][c])
        assert (got[1]["sum"][ids] == 1).all() and (got[1]["sum"].sum() == 3 * len(ids))
        kv.delete_data(name)
    finally:
        local.close()
        remote.close(goodbye=False)


def test_store_embedding_of_a_file_spec_trains_as_a_dense_table(base, tmp_path):
    """StoreEmbedding(FileTableSpec) in either placement equals DistEmbedding (itself
    tested against torch.optim) bit for bit, on duplicate-heavy ids."""
    ctx = DistContext(base, backend="pytorch")
    spec = FileTableSpec(str(tmp_path / "se" / uuid.uuid4().hex[:8]), num_rows=FILE_ROWS,
                         dim=3, init=key_normal(3, seed=4), preallocate=False)
    emb = StoreEmbedding(spec, name=f"se-{uuid.uuid4().hex[:8]}", context=ctx)
    oracle_ctx = DistContext.embedded(backend="pytorch")
    dense = DistEmbedding(FILE_ROWS, 3, name="oracle", context=oracle_ctx,
                          init_func=lambda shape, dtype: torch.from_numpy(
                              key_normal(3, seed=4)(np.arange(FILE_ROWS))))
    opts = [SparseAdagrad([emb], lr=0.3), SparseAdagrad([dense], lr=0.3)]
    rng = np.random.default_rng(5)
    try:
        for _ in range(6):
            ids = torch.from_numpy((rng.zipf(1.3, 64) - 1) % FILE_ROWS)
            for table, opt in zip((emb, dense), opts):
                (table(ids) * torch.arange(3.0)).sum().backward()
                opt.step()
        all_ids = torch.arange(FILE_ROWS)
        assert torch.equal(emb.weight[all_ids], dense.weight[all_ids])
        assert not torch.equal(dense.weight[all_ids], torch.from_numpy(
            key_normal(3, seed=4)(np.arange(FILE_ROWS)))), "the oracle did not move"
    finally:
        emb.kvstore.delete_data(emb.name)
        oracle_ctx.close()
