"""The client suite, part two: what only keyed tables have (any int64 key, key management,
whole-table moves; fixed keys on files), on every placement that holds them.

Same fixtures as tests/test_kvclient_suite.py (``placement``/``client``, ``table_kind``
pairs a placement holds); tests of one store kind take only that kind's tables. Oracles:
the key initialiser itself, the table's own export before a round trip, the reference
rules. A cluster's routing checks run against its servers directly.
"""
import os
import uuid

import numpy as np
import pytest
import torch

from suite_tables import Table

from distemb import checkpoint
from distemb.context import DistContext
from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.errors import DistEmbError, KVStoreError, MissingKeyError, StoreError
from distemb.kernels import half
from distemb.optim import SparseAdagrad, SparseSGD
from distemb.partition import key_partition
from distemb.rules import AdagradHyper
from distemb.stores import HashStore, key_normal
from distemb.stores.spec import HashTableSpec
from distemb.transport.messages import Pull, Push

#: every test runs on the placements that hold the keyed tables it makes: hash tables
#: (every placement but the GPU's holds them), and file tables where a test says so (the
#: others refuse them by name:
#: tests/test_kvclient_suite.py::test_every_table_kind_is_held_or_refused_by_name)
pytestmark = [pytest.mark.timeout(120), pytest.mark.holding("hash-key")]
WITH_FILES = pytest.mark.holding("hash-key", "file-range")
N, D = 24, 3


def hash_table(client, tmp_path, **spec):
    t = Table("hash-key", N, D, str(tmp_path))
    t.spec = HashTableSpec(D, init=t.init, **spec)
    return t.make(client)


def test_a_lookup_inserts_the_initialiser_rows_wherever_the_key_lives(client, tmp_path):
    t = hash_table(client, tmp_path)
    keys = t.key_of(np.arange(6))
    rows = client.pull(t.name, np.concatenate([keys, keys[:2]]))
    np.testing.assert_array_equal(rows[:6], key_normal(D, seed=4)(keys))
    np.testing.assert_array_equal(rows[6:], rows[:2])
    assert client.size(t.name) == 6
    assert client.contains(t.name, t.key_of([5, 6])).tolist() == [True, False]
    assert sorted(client.export(t.name)[0].tolist()) == sorted(keys.tolist())


def test_upsert_get_remove_and_a_removed_key_read_back(client, tmp_path):
    t = hash_table(client, tmp_path)
    keys = t.key_of(np.arange(3))
    client.push(t.name, keys, np.arange(9, dtype=np.float32).reshape(3, 3))
    np.testing.assert_array_equal(client.get(t.name, keys[1:2]), [[3.0, 4.0, 5.0]])
    assert client.remove(t.name, np.array([keys[1], t.key_of([9])[0]])) == 1
    assert client.size(t.name) == 2
    with pytest.raises(MissingKeyError, match="not in the store"):
        client.get(t.name, keys[1:2])
    assert client.contains(t.name, keys).tolist() == [True, False, True]
    # a key that comes back starts again from its initial row
    np.testing.assert_array_equal(client.pull(t.name, keys[1:2]), t.initial([1]))


def test_bad_specs_and_policies_are_refused_with_their_names(client, tmp_path):
    t = hash_table(client, tmp_path)
    with pytest.raises(ValueError, match="capacity"):
        HashTableSpec(3, capacity=0)
    with pytest.raises(ValueError, match="evict"):
        HashTableSpec(3, evict="fifo")
    with pytest.raises(ValueError, match="policy"):
        client.evict(t.name, 0, policy="mru")


def test_capacity_evicts_with_the_state_and_spares_the_last_lookup(placement, tmp_path):
    """A hash table with a capacity evicts on its own; a cache that owns the rows it holds
    (the device cache) refuses such a table, naming both (it could lose a row only it
    holds)."""
    client = placement.client
    if placement.refuser == "DeviceCachedKVClient":
        with pytest.raises(KVStoreError, match="DeviceCachedKVClient: cannot hold table .* on "
                                               "a hash store with a capacity"):
            hash_table(client, tmp_path, capacity=4, evict="lru")
        assert not client.names()
        return
    t = hash_table(client, tmp_path, capacity=4, evict="lru")
    client.init_optimizer(t.name, "adagrad", {})
    first = t.key_of([0, 1])
    client.push_update(t.name, first, np.ones((2, D), np.float32), "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))
    for k in range(100, 130):
        client.pull(t.name, np.array([k]))
    assert client.size(t.name) <= 4 and client.contains(t.name, np.array([129])).all()
    assert not client.contains(t.name, first).any()
    _, cols = client.export(t.name, ["sum"])
    assert (cols["sum"] == 0).all(), "the evicted rows' state was left behind"
    evicted = client.evict(t.name, 0)
    assert client.size(t.name) == 0 and 129 in evicted.tolist()


def test_a_step_never_puts_back_a_key_gone_since_its_lookup(placement):
    """A key removed, or evicted past the capacity, between the lookup a gradient came
    from and the step is not inserted again by the step: its gradient is dropped, and the
    removal and the capacity hold. (A cache that owns its rows refuses a capacity: the
    test above.)"""
    tag = uuid.uuid4().hex[:8]
    keys = torch.from_numpy(Table("hash-key", N, D, "").key_of(np.arange(24)))
    bounded = placement.refuser != "DeviceCachedKVClient"

    def job(ctx, rank, num_trainers):
        a = DynamicEmbedding(D, name=f"r-{tag}", init_func=key_normal(D, seed=4), context=ctx)
        opt = SparseAdagrad([a], lr=0.5)
        a(keys[:8][rank::num_trainers], device=placement.device).sum().backward()
        ctx.client.barrier()
        a.remove(keys[:2] if rank == 0 else keys[:0])
        ctx.client.barrier()
        opt.step()
        ctx.client.barrier()
        out = {"removed": a.contains(keys[:8]).tolist()}
        if bounded:
            b = DynamicEmbedding(D, name=f"c-{tag}", capacity=4, context=ctx)
            opt = SparseAdagrad([b], lr=0.5)
            first, then = keys[8:16][rank::num_trainers], keys[16:][rank::num_trainers]
            (b(first, device=placement.device).sum() +
             b(then, device=placement.device).sum()).backward()
            ctx.client.barrier()
            out["before"] = (b.contains(keys[8:]).tolist(), b.size())
            opt.step()
            ctx.client.barrier()
            out["after"] = (b.contains(keys[8:]).tolist(), b.size())
        return out

    got = placement.run(job)[0]
    assert got["removed"] == [False] * 2 + [True] * 6
    if bounded:
        (held, size), (held_after, size_after) = got["before"], got["after"]
        assert not all(held[:8]), "nothing was evicted: the test proves nothing"
        assert held_after == held and size_after == size


def test_eviction_behind_any_placement_equals_the_embedded_store(placement):
    """Capacity eviction sees every lookup, cache hits too: a job whose keys all live on
    one shard (of capacity 4) keeps the keys and rows the embedded store keeps. Keys 1 and
    2 are hot (cache hits in the last batch, which must spare them); 3 is the least recent
    when 5 arrives. With bounded staleness the owner sees only the lookups that reach it,
    so only the capacity is checked there."""
    tag = uuid.uuid4().hex[:8]
    num_servers = placement.client.num_servers
    cands = np.arange(1, 10_000, dtype=np.int64)
    k = cands[key_partition(cands, num_servers) == 0][:5]
    batches = [k[[0, 1]], k[[0, 1]], k[[2, 3]], k[[0, 1, 4]]]

    def job(ctx, rank, num_trainers, repeat=1):
        t = DynamicEmbedding(2, name=f"ev-{tag}", capacity=4 * ctx.client.num_servers,
                             context=ctx)
        opt = SparseSGD([t], lr=1.0)
        for ids in batches:
            opt.zero_grad()
            t(torch.from_numpy(np.tile(ids, repeat)), device=placement.device).sum().backward()
            opt.step()
            ctx.client.barrier()
        got = t.export()
        return got["keys"].tolist(), got["weight"].tolist()

    if placement.refuser == "DeviceCachedKVClient":
        with pytest.raises(KVStoreError, match="a hash store with a capacity"):
            placement.run(job)
        return
    keys, rows = placement.run(job)[0]
    embedded = DistContext.embedded(num_threads=1)
    try:
        want = job(embedded, 0, 1, repeat=len(placement.trainers))
    finally:
        embedded.close()
    if placement.name.endswith("cache_stale"):
        assert len(keys) <= 4
    else:
        assert (keys, rows) == want


def test_keys_are_spread_by_their_hash(client, tmp_path):
    """Each server holds the keys key_partition gives it (one shard embedded)."""
    t = hash_table(client, tmp_path)
    keys = np.arange(-500, 500, dtype=np.int64) * 7919
    client.pull(t.name, keys)
    per_server = np.bincount(key_partition(keys, client.num_servers),
                             minlength=client.num_servers)
    assert per_server.min() > 0.4 * len(keys) / client.num_servers
    assert client.size(t.name) == len(keys)


@WITH_FILES
def test_export_import_round_trip_with_state(client, tmp_path):
    """Every keyed table (hash and file) moves whole with its state; an unknown column is
    refused before any row is written."""
    for kind in ("hash-key", "file-range"):
        t = Table(kind, N, D, str(tmp_path)).make(client)
        keys = t.all_keys()
        client.pull(t.name, keys)
        client.init_optimizer(t.name, "adagrad", {})
        client.push_update(t.name, keys[:5], np.ones((5, D), np.float32), "adagrad",
                           AdagradHyper(clr=0.1, eps=1e-10))
        got_keys, cols = client.export(t.name)
        assert list(got_keys) == sorted(keys.tolist()) and sorted(cols) == ["sum", "weight"]
        client.push_update(t.name, keys[:5], np.ones((5, D), np.float32), "adagrad",
                           AdagradHyper(clr=0.1, eps=1e-10))
        client.import_(t.name, got_keys, cols)
        again = client.export(t.name)
        np.testing.assert_array_equal(again[0], got_keys)
        for c in cols:
            np.testing.assert_array_equal(again[1][c], cols[c])
        np.testing.assert_array_equal(client.pull(t.name, got_keys), cols["weight"])
        with pytest.raises(StoreError, match="nope"):
            client.import_(t.name, got_keys, {"nope": cols["sum"]})


def test_a_checkpoint_load_replaces_the_keys(client, tmp_path):
    t = hash_table(client, tmp_path)
    keys = t.key_of(np.arange(6))
    client.init_optimizer(t.name, "adagrad", {})
    client.push_update(t.name, keys, np.ones((6, D), np.float32), "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))
    before = client.export(t.name)
    path = str(tmp_path / "ck")
    names = [t.name, f"{t.name}~opt~sum"]  # the table and its optimizer state
    checkpoint.save_items(path, [(client, n) for n in names], {"note": "suite"})
    client.remove(t.name, keys[:3])
    client.pull(t.name, np.array([42]))  # a key the checkpoint does not have: gone after
    checkpoint.restore(path, client, names)
    after = client.export(t.name)
    np.testing.assert_array_equal(after[0], before[0])
    for c in before[1]:
        np.testing.assert_array_equal(after[1][c], before[1][c])


def test_a_checkpoint_past_the_capacity_is_refused_before_anything_changes(placement,
                                                                          tmp_path):
    """A load of more saved keys than a shard holds at most is refused in its checking
    pass, naming the capacity; the table keeps its keys and rows. (A cache that owns its
    rows refuses a capacity: test_capacity_evicts_with_the_state_and_spares_the_last_lookup.)"""
    client = placement.client
    if placement.refuser == "DeviceCachedKVClient":
        with pytest.raises(KVStoreError, match="a hash store with a capacity"):
            hash_table(client, tmp_path, capacity=4)
        return
    big = hash_table(client, tmp_path)
    keys = big.key_of(np.arange(N))
    client.pull(big.name, keys)
    path = str(tmp_path / "ck")
    checkpoint.save_items(path, [(client, big.name)], {"note": "suite"})
    client.delete_data(big.name)
    small = Table("hash-key", N, D, str(tmp_path))
    small.name = big.name  # the same table, made again with a capacity
    small.spec = HashTableSpec(D, init=small.init, capacity=4)
    small.make(client)
    client.pull(small.name, keys[:2])
    before = client.export(small.name)
    with pytest.raises(KVStoreError, match="capacity"):
        checkpoint.restore(path, client, [small.name])
    after = client.export(small.name)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1]["weight"], before[1]["weight"])


@WITH_FILES
def test_bfloat16_rows_round_to_nearest_even(client, tmp_path):
    for kind in ("hash_bf16-key", "file_bf16-range"):
        t = Table(kind, N, D, str(tmp_path)).make(client)
        vals = np.array([[1.0, 1.00390625, 1.01171875]], np.float32)  # 1, 1+2**-8, 1+3*2**-8
        client.push(t.name, t.key_of([0]), vals)
        # bfloat16 keeps 7 fraction bits: 1 + 2**-8 is a tie (to even: 1), 1 + 3 * 2**-8 up
        np.testing.assert_array_equal(client.get(t.name, t.key_of([0])), [[1.0, 1.0, 1.015625]])
        assert client.export(t.name)[1]["weight"].dtype == np.float32


def test_dynamic_embedding_keys_train_and_are_managed(placement):
    """DynamicEmbedding's own API on this placement: each key's summed gradient is its
    count, so Adagrad moves every looked-up key by lr; size, contains, get, remove."""
    keys = Table("hash-key", N, D, "").key_of(np.arange(6))
    name = f"e-{uuid.uuid4().hex[:8]}"

    def job(ctx, rank, num_trainers):
        emb = DynamicEmbedding(D, name=name, init_func=key_normal(D, seed=4), context=ctx)
        opt = SparseAdagrad([emb], lr=0.5)
        ids = torch.from_numpy(np.concatenate([keys, keys[:3]]))
        emb(ids[rank::num_trainers], device=placement.device).sum().backward()
        opt.step()
        ctx.client.barrier()
        return emb

    emb = placement.run(job)[0]
    assert emb.size() == len(keys)
    assert emb.contains(torch.tensor([int(keys[0]), 7])).tolist() == [True, False]
    np.testing.assert_allclose(emb.get(torch.from_numpy(keys)).numpy(),
                               key_normal(D, seed=4)(keys) - 0.5, rtol=0, atol=1e-6)
    assert emb.remove(torch.from_numpy(keys[:1])) == 1 and emb.size() == len(keys) - 1


def test_optimizer_state_dict_round_trip(placement):
    tag = uuid.uuid4().hex[:8]
    keys = torch.from_numpy(Table("hash-key", N, D, "").key_of(np.arange(6)))

    def job(ctx, rank, num_trainers):
        a = DynamicEmbedding(D, name=f"a-{tag}", init_func=key_normal(D, seed=4), context=ctx)
        opt_a = SparseAdagrad([a], lr=0.5)
        a(keys[rank::num_trainers], device=placement.device).sum().backward()
        opt_a.step()
        ctx.client.barrier()
        sd, rows = opt_a.state_dict(), a.export()
        b = DynamicEmbedding(D, name=f"b-{tag}", init_func=key_normal(D, seed=4), context=ctx)
        opt_b = SparseAdagrad([b], lr=0.5)
        if rank == 0:
            b.import_({"keys": rows["keys"], "weight": rows["weight"]})
            sd["state"][b.name] = sd["state"].pop(a.name)
            opt_b.load_state_dict(sd)
        ctx.client.barrier()
        return rows, b.export()

    rows, got = placement.run(job)[0]
    for col in rows:
        np.testing.assert_array_equal(got[col], rows[col])
    assert (got["sum"] > 0).all()


# --- file tables: keys 0..N-1 on memory-mapped files, one FileStore per shard -----------

@WITH_FILES
def test_a_file_table_holds_every_key_of_its_range_wherever_it_lives(client, tmp_path):
    t = Table("file-range", N, D, str(tmp_path)).make(client)
    keys = np.array([0, 11, 12, N - 1, 7, 7], np.int64)
    np.testing.assert_array_equal(client.pull(t.name, keys), t.initial(keys))
    assert client.size(t.name) == N and client.capacity(t.name) in (None, N)
    # a key outside the range is not held, wherever the table lives (asked of no one)
    assert client.contains(t.name, np.array([0, N - 1, N, -1, 2**40])).tolist() == \
        [True, True, False, False, False]
    exported = client.export(t.name)
    assert exported[0].tolist() == list(range(N))
    np.testing.assert_array_equal(exported[1]["weight"], t.initial())
    with pytest.raises(DistEmbError, match="fixed keys"):
        client.remove(t.name, np.array([3]))
    with pytest.raises(DistEmbError, match="fixed keys"):
        client.evict(t.name, 10)
    # each shard made its files under its own range
    assert sorted(os.listdir(t.spec.path)) == [f"part-{p}-of-{client.num_servers}"
                                               for p in range(client.num_servers)]


@WITH_FILES
def test_a_file_table_reopens_with_its_rows(client, tmp_path):
    """Dropping a file table flushes and unlocks its shards' files; made again from the
    same spec, it has its rows back."""
    t = Table("file-range", N, D, str(tmp_path)).make(client)
    client.push(t.name, np.array([1, N - 1]), np.full((2, D), 7.0, np.float32))
    client.delete_data(t.name)
    t.make(client)
    np.testing.assert_array_equal(client.get(t.name, np.array([1, N - 1, 2])),
                                  [[7.0] * D, [7.0] * D, t.initial([2])[0]])


# --- a cluster's servers: what they refuse ------------------------------------------------

@pytest.mark.multiprocess
def test_a_cluster_refuses_a_plain_init_function_and_a_store_object(clusters):
    kv = clusters("tcp").client()
    try:
        ctx = DistContext(kv, backend="pytorch", role="trainer")
        with pytest.raises(TypeError, match=r"key_normal\(dim, std, seed\)"):
            DynamicEmbedding(3, name="plain", init_func=lambda keys: np.zeros((len(keys), 3)),
                             context=ctx)
        with pytest.raises(KVStoreError, match="store object lives in one process.*sharded "
                                               "over its servers; pass a table spec"):
            StoreEmbedding(HashStore(3), name="object", context=ctx)
        assert "plain" not in kv.names()
    finally:
        kv.close(goodbye=False)


@pytest.mark.multiprocess
def test_a_server_refuses_keys_another_server_owns(clusters):
    """A trainer routing with another server count would scatter a key's rows: refused."""
    kv = clusters("tcp").client()
    try:
        kv.create_table("routed", HashTableSpec(2))
        keys = np.arange(50, dtype=np.int64)
        theirs = keys[key_partition(keys, 2) == 1][:1]
        with pytest.raises(KVStoreError, match=f"key {int(theirs[0])} .* belongs to shard 1, "
                                               "not shard 0"):
            kv._call({0: Pull(name="routed", parts=[0], counts=[1], ids=theirs)})
        assert kv.size("routed") == 0
        kv.delete_data("routed")
    finally:
        kv.close(goodbye=False)


@pytest.mark.multiprocess
def test_half_rows_of_a_keyed_table_cross_the_wire_in_two_bytes(clusters, tmp_path):
    """A 16-bit hash or file table's rows travel as stored, as a dense half table's do:
    pull replies and pushes carry 2-byte rows (the trainer decodes and rounds them), and
    float32 rows pushed to the server are refused as for a dense half table."""
    kv = clusters("tcp").client()
    try:
        for kind, stored in [("hash_bf16-key", half.BFLOAT16),
                             ("file_fp16-range", np.dtype(np.float16))]:
            t = Table(kind, N, D, str(tmp_path)).make(kv)
            keys = t.key_of(np.arange(4))
            vals = np.array([[1.0, 1.00390625, 1.01171875]] * 4, np.float32)
            kv.push(t.name, keys, vals)  # rounded here, 2 bytes a value on the wire
            sid, k = next((s, k) for s, (_, k) in kv.table(t.name).router.split(keys).items())
            reply = kv._call({sid: Pull(name=t.name, parts=[sid], counts=[len(k)],
                                        ids=k)})[sid]
            (got,) = reply.arrays
            assert got.dtype == stored and got.nbytes == 2 * D * len(k)
            want = half.decode(half.encode(vals[:1], half.dtype_name(got)))
            np.testing.assert_array_equal(half.decode(got), np.repeat(want, len(k), 0))
            rows = kv.pull(t.name, keys)
            assert rows.dtype == np.float32
            np.testing.assert_array_equal(rows, np.repeat(want, 4, 0))
            bad = Push(name=t.name, parts=[sid], counts=[1], ids=k[:1],
                       values=np.ones((1, D), np.float32))
            with pytest.raises(KVStoreError, match=f"expected {half.dtype_name(got)} rows"):
                kv._call({sid: bad})
            kv.delete_data(t.name)
    finally:
        kv.close(goodbye=False)
