"""The GPU cache of hot rows and optimizer state (distemb.kvstore.caches.device).

Oracles: torch.optim on nn.Embedding(sparse=True), and the same job without the cache
(host table, rows looked up onto the device, sums made there, updates on the host). On
the CPU the cache runs on device 'cpu' with tests/cpu_cuda_twin.py as its kernels (as
test_cuda_dispatch.py does), so every line but the CUDA kernels runs here; under the
reference kernels both jobs run the same per-row maths, so they must agree bit for bit.
Tests marked ``gpu`` run the cache on a real GPU and skip, saying why, without one.
"""
import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaTwin
from distemb import checkpoint, kernels
from distemb.config import parse_cache_config, parse_cluster_config
from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.errors import ConfigError, DistEmbError, KVStoreError
from distemb.kernels import cuda
from distemb.kvstore import LocalKVClient
from distemb.kvstore import device as device_kv
from distemb.kvstore import views as views_kv
from distemb.kvstore.caches.device import CacheOnDevice, DeviceCachedKVClient
from distemb.optim import SparseAdagrad, SparseAdam
from distemb.partition import range_policy
from distemb.rules import state_name
from mp_helper import cluster_dict
from tests.test_optim_oracle import CASES, ROWS, assert_within, run_both

pytestmark = pytest.mark.timeout(120)

CONFIGS = {"lru_16rows": {"policy": "lru", "rows": 16},      # smaller than a batch: passes
           "lfu_20pct": {"policy": "lfu", "fraction": 0.2},  # rows through, admission
           "lru_4kb": {"policy": "lru", "bytes": 4096},       # 48 to 146 rows of 300
           "lru_all": {"policy": "lru", "fraction": 1.0}}     # nothing evicted


@pytest.fixture
def twin(monkeypatch):
    """device='cuda' means the CPU, running CpuCudaTwin (for the cache and the view)."""
    ops = CpuCudaTwin()
    monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(views_kv.HostTableOnDevice, "ops", ops)
    monkeypatch.setattr(DeviceCachedKVClient, "device_ops", ops)
    return ops


@pytest.fixture
def make_ctx():
    made = []

    def make(cache=None):
        c = DistContext.embedded(backend="pytorch", num_threads=1, device_cache=cache)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _job(ctx, case, steps, dim=7):
    with kernels.implementation("reference"):
        return run_both(ctx, case, dim, lookup_device="cuda", steps=steps)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_job_equals_uncached_job_and_torch(twin, make_ctx, case, config):
    cached_ctx = make_ctx(CONFIGS[config])
    ours, expected, w0 = _job(cached_ctx, case, steps=30)
    plain, _, _ = _job(make_ctx(), case, steps=30)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert torch.equal(ours, plain), "the cache changed the result"
    assert_within(ours, expected)
    st = cached_ctx.client.stats()
    # the cache did the work: hits, device updates, write-backs at eviction
    assert st["hit_rows"] > 0 and st["device_updated_rows"] > 0
    if config == "lru_all":  # every row stays: every update on the device
        assert st["host_updated_rows"] == 0 and st["written_back_rows"] == 0
    else:
        assert st["written_back_rows"] > 0
    if config == "lru_16rows":  # more unique rows per lookup than slots: some pass
        assert st["host_updated_rows"] > 0
    assert sum(twin.calls[k] for k in twin.calls if k.endswith("_update")) > 0


@pytest.mark.parametrize("policy_kind", ["range-3", "hash-2"])
def test_sharded_host_tables(twin, make_ctx, policy_kind):
    runs = []
    for cache in (CONFIGS["lfu_20pct"], None):
        with kernels.implementation("reference"):
            runs.append(run_both(make_ctx(cache), "adam", 7, policy_kind=policy_kind,
                                 lookup_device="cuda", steps=15))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_within(runs[0][0], runs[0][1])


def test_compiled_host_kernels_match_torch(twin, make_ctx, model_impl):
    """Rows updated on the host (misses) by the compiled kernels, cached ones by the twin."""
    ours, expected, _ = run_both(make_ctx(CONFIGS["lru_16rows"]), "adagrad", 16,
                                 lookup_device="cuda", steps=20)
    assert_within(ours, expected)


def _train(ctx, steps, name="w", opt_cls=SparseAdam, seed=0, **kw):
    emb = DistEmbedding(ROWS, 4, name=name, context=ctx,
                        init_func=lambda s, d: torch.ones(s, dtype=d))
    opt = opt_cls([emb], lr=0.05, **kw)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = (torch.rand(200, generator=gen) ** 4 * ROWS).long()  # skewed, duplicates
        (emb(ids, device="cuda") ** 2).sum().backward()
        opt.step()
    return emb, opt


def test_owner_is_stale_until_written_back_and_reads_see_the_cache(twin, make_ctx):
    ctx = make_ctx({"fraction": 1.0})
    emb, opt = _train(ctx, 5)
    all_ids = np.arange(ROWS)
    owner = ctx.client.inner  # the LocalKVClient behind the cache
    current = emb.weight[torch.arange(ROWS)].numpy()
    assert not np.array_equal(owner.pull("w", all_ids), current), "nothing was cached dirty"
    assert ctx.client.stats()["written_back_rows"] == 0  # nothing evicted at 100%
    state = opt.state_dict()["state"]["w"]
    ctx.client.flush()
    np.testing.assert_array_equal(owner.pull("w", all_ids), current)
    np.testing.assert_array_equal(owner.pull(state_name("w", "exp_avg"), all_ids),
                                  state["exp_avg"].numpy())
    # the same job uncached: rows and state equal
    plain_emb, plain_opt = _train(make_ctx(), 5)
    np.testing.assert_array_equal(plain_emb.weight[torch.arange(ROWS)].numpy(), current)
    np.testing.assert_array_equal(plain_opt.state_dict()["state"]["w"]["exp_avg_sq"],
                                  state["exp_avg_sq"])


def test_checkpoint_of_cached_job_loads_into_uncached_job(twin, make_ctx, tmp_path):
    ctx = make_ctx({"policy": "lfu", "fraction": 0.5})
    emb, opt = _train(ctx, 6, opt_cls=SparseAdagrad)
    opt.save(tmp_path / "ck")
    saved_rows = emb.weight[torch.arange(ROWS)].clone()
    saved_sum = opt.state_dict()["state"]["w"]["sum"].clone()
    fresh = make_ctx()
    emb2 = DistEmbedding(ROWS, 4, name="w", context=fresh)
    opt2 = SparseAdagrad([emb2], lr=0.05)
    opt2.load(tmp_path / "ck")
    assert torch.equal(emb2.weight[torch.arange(ROWS)], saved_rows)
    assert torch.equal(opt2.state_dict()["state"]["w"]["sum"], saved_sum)
    # a save straight through the client (no barrier first) sees the dirty rows too
    (emb(torch.tensor([1, 2, 2]), device="cuda") ** 2).sum().backward()
    opt.step()
    names = ["w", state_name("w", "sum")]
    checkpoint.save(tmp_path / "direct", ctx.client, names, {})
    checkpoint.restore(tmp_path / "direct", fresh.client, names)
    assert torch.equal(emb2.weight[torch.arange(ROWS)], emb.weight[torch.arange(ROWS)])
    # loading back into the cached job replaces the cached rows too
    emb(torch.tensor([1, 2]), device="cuda").sum().backward()
    opt.step()
    opt.load(tmp_path / "ck")
    assert torch.equal(emb.weight[torch.arange(ROWS)], saved_rows)
    assert torch.equal(emb(torch.arange(ROWS), device="cuda").detach(), saved_rows)


def test_writes_and_state_loads_go_through_the_cache(twin, make_ctx):
    """weight[ids] = v and load_state_dict on cached dirty rows, vs the same uncached."""
    results = []
    for cache in ({"rows": 64}, None):
        ctx = make_ctx(cache)
        emb, opt = _train(ctx, 4, name="x", opt_cls=SparseAdagrad)
        emb.weight[torch.tensor([0, 1, 2])] = torch.full((3, 4), 7.0)
        sd = opt.state_dict()
        sd["state"]["x"]["sum"][:10] = 0.5
        opt.load_state_dict(sd)
        for _ in range(2):
            (emb(torch.tensor([0, 1, 2, 3, 3]), device="cuda") ** 2).sum().backward()
            opt.step()
        results.append((emb.weight[torch.arange(ROWS)].clone(),
                        opt.state_dict()["state"]["x"]["sum"].clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_only_misses_cross_to_the_device(twin, make_ctx):
    ctx = make_ctx({"fraction": 1.0})
    emb = DistEmbedding(100, 8, name="m", context=ctx)
    SparseAdagrad([emb], lr=0.1)
    ids = torch.tensor([5, 6, 7, 5])
    with torch.no_grad():
        emb(ids, device="cuda")
        first = ctx.client.stats()
        emb(ids, device="cuda")
    second = ctx.client.stats()
    assert first["miss_rows"] == 3 and first["admitted_rows"] == 3
    # rows (3 x 32 B) and their Adagrad state (3 x 32 B), and 4 slot indices (8 B each)
    assert first["h2d_bytes"] == 3 * 32 * 2 + 4 * 8
    assert second["hit_rows"] == 3 and second["miss_rows"] == 3
    assert second["h2d_bytes"] - first["h2d_bytes"] == 4 * 8  # only the slot indices


def test_lookup_view_and_placement(twin, make_ctx):
    ctx = make_ctx({"rows": 8})
    emb = DistEmbedding(10, 2, name="v", context=ctx)
    view = emb.kvstore.view_on("cuda")
    assert isinstance(view, CacheOnDevice) and view.inner is ctx.client
    assert emb.kvstore.view_on(None) is emb.kvstore and emb.device is None
    emb(torch.tensor([4, 4]), device="cuda").sum().backward()
    assert isinstance(emb.trace[0].ids, np.ndarray)  # host ids: the bookkeeping is there
    client, uniq, summed = emb.coalesced_gradients()
    assert client is view and uniq.tolist() == [4] and summed.tolist() == [[2.0, 2.0]]
    with pytest.raises(ValueError, match="device cache is on cpu, got 'meta'"):
        emb.kvstore.view_on("meta")
    # tensors it does not cache pass through (int64 rows, copied to the device)
    ctx.client.init_data("n", (5,), "int64", range_policy(5))
    assert view.pull("n", np.array([1, 2])).tolist() == [0, 0]


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"device_cache.staleness: .*exact only.*got 3"):
        DistContext.embedded(device_cache={"fraction": 0.1, "staleness": 3})
    with pytest.raises(ConfigError, match=r"device_cache.fraction: must be in \(0, 1\]"):
        DistContext.embedded(device_cache={"fraction": 1.5})
    raw = cluster_dict(1, num_trainers=2, device_cache={"fraction": 0.1})
    with pytest.raises(ConfigError, match="device_cache: .*one writer.*2 trainers"):
        parse_cluster_config(raw)
    one = parse_cluster_config(cluster_dict(1, device_cache={"rows": 10}))
    assert one.device_cache.rows == 10


@pytest.mark.skipif(cuda.cuda_available(), reason="a usable GPU is present here, so the "
                    "no-GPU error cannot be provoked")
def test_without_gpu_the_cache_says_why():
    with pytest.raises(cuda.CudaUnavailableError,
                       match="not built|CPU-only build|no CUDA device|no usable GPU"):
        DistContext.embedded(device_cache={"fraction": 0.1})


def test_remote_table_one_trainer(twin, clusters):
    """In front of two server processes: equal to the uncached remote job."""
    cluster = clusters("tcp")
    out = []
    for cache in ({"policy": "lru", "rows": 40}, None):
        client = cluster.client()
        if cache is not None:
            client = DeviceCachedKVClient(client, parse_cache_config(cache), "cuda")
        ctx = DistContext(client, backend="pytorch", num_threads=1)
        try:
            with kernels.implementation("reference"):
                emb, _ = _train(ctx, 6, name=f"r{len(out)}", opt_cls=SparseAdagrad)
                out.append(emb.weight[torch.arange(ROWS)].clone())
            if cache is not None:
                assert client.stats()["written_back_rows"] > 0
        finally:
            for name in ctx.client.names():
                ctx.client.delete_data(name)
            ctx.client.close(goodbye=False)
    assert torch.equal(out[0], out[1])


# --- with a GPU ---------------------------------------------------------------------------

@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda})")
    return device_kv.cuda_device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_cache_equals_gpu_table_and_torch(make_ctx, gpu, case, config):
    """On a GPU: the CUDA kernels update cached rows as they update a GPU-resident table
    (the same sums, the same kernels), so the two jobs agree bit for bit."""
    cached_ctx = make_ctx(CONFIGS[config])
    ours, expected, w0 = run_both(cached_ctx, case, 7, lookup_device=gpu, steps=30)
    on_gpu, _, _ = run_both(make_ctx(), case, 7, table_device=gpu, steps=30)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)
    st = cached_ctx.client.stats()
    assert st["device_updated_rows"] > 0
    if st["host_updated_rows"] == 0:  # rows the cache did not keep update on the CPU
        assert torch.equal(ours, on_gpu)
    elif config == "lru_all":
        pytest.fail(f"the whole table fits {config}, yet rows were updated on the host: {st}")


def test_update_with_another_rule_goes_to_the_owner(twin):
    """A push_update whose rule is not the cached state's writes the rows back first."""
    from distemb.rules import AdagradHyper, SGDHyper

    out = []
    for cached in (True, False):
        inner = LocalKVClient()
        kv = DeviceCachedKVClient(inner, parse_cache_config({"rows": 8}), "cuda") \
            if cached else inner
        kv.init_data("w", (10, 2), "float32", range_policy(10))
        kv.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
        if cached:
            kv.view_on("cuda").pull("w", np.array([1, 2, 3]))
        ids, g = np.array([1, 2]), np.ones((2, 2), np.float32)
        kv.push_update("w", ids, g, "adagrad", AdagradHyper(clr=0.5, eps=1e-10))
        kv.push_update("w", np.array([2, 5]), g * 3, "sgd", SGDHyper(lr=0.25))
        kv.push_update("w", ids, g, "adagrad", AdagradHyper(clr=0.5, eps=1e-10))
        out.append(kv.pull("w", np.arange(10)))
        if cached:
            assert kv.stats()["written_back_rows"] == 1 and kv.stats()["device_updated_rows"] == 3
        kv.close()
    np.testing.assert_array_equal(out[0], out[1])


def test_initialize_and_cluster_config_give_the_cache(twin, clusters, tmp_path, monkeypatch):
    import json

    from distemb import context as context_mod

    monkeypatch.delenv("DISTEMB_CONFIG", raising=False)
    context_mod.shutdown()  # an earlier test's implicit context, if any
    ctx = context_mod.initialize(device_cache={"policy": "lfu", "rows": 5})
    try:
        assert isinstance(ctx.client, DeviceCachedKVClient)
        assert ctx.client.config.rows == 5
    finally:
        context_mod.shutdown()
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(dict(clusters("tcp").raw, device_cache={"rows": 40})))
    monkeypatch.setenv("DISTEMB_CONFIG", str(path))
    with pytest.raises(DistEmbError, match="device_cache: a trainer of a cluster takes"):
        context_mod.initialize(device_cache={"rows": 5})
    trainer = DistContext.trainer(str(path), 0, backend="pytorch", num_threads=1)
    try:
        assert isinstance(trainer.client, DeviceCachedKVClient)
        emb, _ = _train(trainer, 3, name="via-config", opt_cls=SparseAdagrad)
        assert trainer.client.stats()["device_updated_rows"] > 0
        for name in trainer.client.names():
            trainer.client.delete_data(name)
    finally:
        trainer.client.close(goodbye=False)


def test_dynamic_tables_are_cached_and_evicting_ones_refused(twin, make_ctx):
    """A dynamic table behind the device cache trains there (its rows owned by the cache,
    hashed slot map) and equals the table without the cache, keys far past the key count
    included; one with a capacity, whose store evicts on its own, is refused naming both
    (it used to be passed through uncached, silently, then refused whole)."""
    from distemb import DynamicEmbedding

    keys = torch.tensor([10 ** 12, 7, 7, -(2 ** 40), 2 ** 63 - 1, 7])
    out = []
    for cache in ({"rows": 2}, None):
        ctx = make_ctx(cache)
        emb = DynamicEmbedding(3, name="dyn", context=ctx)
        opt = SparseAdagrad([emb], lr=0.1)
        for step in range(3):
            (emb(keys, device="cuda") * (step + torch.arange(6.0)[:, None])).sum().backward()
            opt.step()
        out.append(emb.export())
        if cache is not None:
            assert ctx.client.stats()["device_updated_rows"] > 0
            with pytest.raises(KVStoreError, match=r"DeviceCachedKVClient: cannot hold table "
                                                   r"'capped' on a hash store with a capacity"):
                DynamicEmbedding(3, name="capped", capacity=10, context=ctx)
    assert out[0]["keys"].tolist() == [-(2 ** 40), 7, 10 ** 12, 2 ** 63 - 1]
    for col in out[1]:
        np.testing.assert_array_equal(out[0][col], out[1][col])


def test_half_tables_pass_through(twin, make_ctx):
    """bfloat16 rows are rounded by their owner at every update: not cached, unchanged."""
    out = []
    for cache in ({"rows": 64}, None):
        ctx = make_ctx(cache)
        emb = DistEmbedding(ROWS, 4, name="h", context=ctx, dtype=torch.bfloat16,
                            init_func=lambda s, d: torch.ones(s, dtype=d))
        opt = SparseAdagrad([emb], lr=0.05)
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            ids = (torch.rand(100, generator=gen) ** 4 * ROWS).long()
            (emb(ids, device="cuda") ** 2).sum().backward()
            opt.step()
        out.append(emb.weight[torch.arange(ROWS)].clone())
        if cache is not None:
            assert ctx.client.stats()["device_updated_rows"] == 0
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], torch.ones(ROWS, 4))


@pytest.mark.multiprocess
def test_the_cache_refuses_a_client_whose_tables_other_trainers_write(clusters):
    """It writes rows back only at eviction, so it must be their one writer: a client of
    a two-trainer job is refused by name, whoever makes the cache (the config's check
    covers only what initialize() makes)."""
    kv = clusters("tcp2x2").client(0)
    try:
        with pytest.raises(ConfigError, match="device_cache: .*one writer.*2 trainers"):
            DeviceCachedKVClient(kv, parse_cache_config({"rows": 8}), "cpu", ops=CpuCudaTwin())
    finally:
        kv.close(goodbye=False)  # the suite's other tests still use the cluster


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_evict_behind_the_cache_sees_the_lookups_it_served(policy):
    """evict() of a hash table behind the device cache removes the keys the uncached
    table removes: the hot keys the cache served (1 and 2, every other batch) are spared."""
    from distemb.dynamic import DynamicEmbedding
    from distemb.optim import SparseSGD

    def run(kv):
        ctx = DistContext(kv, backend="pytorch", num_threads=1)
        t = DynamicEmbedding(2, name="t", context=ctx, evict=policy)
        opt = SparseSGD([t], lr=1.0)
        for ids in ([1, 2], [3, 4], [1, 2], [5], [1, 2]):
            opt.zero_grad()
            t(torch.tensor(ids), device="cpu").sum().backward()
            opt.step()
        evicted = sorted(t.evict(3).tolist())
        return evicted, t.export()["keys"].tolist()

    want = run(LocalKVClient())
    assert want == ([3, 4], [1, 2, 5])
    cached = DeviceCachedKVClient(LocalKVClient(), parse_cache_config({"rows": 4, "policy": policy}),
                                  "cpu", ops=CpuCudaTwin())
    assert run(cached) == want
