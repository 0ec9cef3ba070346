"""DistEmbedding(dtype=bfloat16/float16): dense tables with half-precision rows.

Oracle: torch.optim on nn.Embedding(sparse=True) in float32, 50 zipf steps with duplicate
ids, every optimizer (tests/test_optim_oracle.py's CASES), from the same (half-rounded)
initial rows. Stated tolerance, the largest entry's error relative to the table's largest
entry (each update rounds once, to nearest-even): bfloat16 5e-2 (8 significant bits;
measured 1.2e-2..3.7e-2, Adam's small steps round away most), float16 5e-3 (11 bits).
A float32 table under the same check stays within 1e-5, and a half table cannot match
it exactly: both bounds are asserted, so rows really are stored in 16 bits.

In a cluster (1 and 2 server processes, TCP, and shared memory) the table equals the
embedded half table bit for bit (same kernels, same rounding; stochastic rounding too,
for the same partitioning), and rows cross the wire in 2 bytes.
"""
import io

import numpy as np
import pytest
import torch

from distemb import SparseAdagrad, SparseSGD
from distemb.stores.dense import DenseSpec
from distemb.checkpoint import read_meta, restore, save
from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.tensor import DistTensor
from distemb.errors import KVStoreError, TransportError
from distemb.kernels import half
from distemb.kvstore import LocalKVClient
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.server.service import KVService
from distemb.partition import range_policy
from distemb.transport.base import HEADER, encode_head, parse_descriptors, parse_header
from distemb.transport.messages import Create, Pull, Push
from distemb.kvstore.caches.trainer import CachedKVClient
from tests.conftest import CACHES, Cluster, zipf_ids
from tests.test_optim_oracle import CASES

HALF_TOL = {"bfloat16": 5e-2, "float16": 5e-3}
STEPS, ROWS, BATCH, DIM = 50, 300, 256, 16


def _train(ctx, case, dtype, steps=STEPS, policy=None, rounding="nearest", oracle=True,
           name=None):
    """Train ``DistEmbedding(dtype=...)`` (and, if ``oracle``, the torch oracle in float32)
    on the same zipf ids and upstream gradients; returns (ours, oracle's, w0), float32."""
    make_ours, make_torch = CASES[case]
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(ROWS, DIM, generator=gen).to(getattr(torch, dtype)).float()
    emb = DistEmbedding(ROWS, DIM, name=name or f"half-{case}-{dtype}", context=ctx,
                        dtype=getattr(torch, dtype), part_policy=policy, rounding=rounding,
                        rounding_seed=7)
    emb.weight[torch.arange(ROWS)] = w0
    opt = make_ours([emb])
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)
    ref.weight.data.copy_(w0)
    ref_opt = make_torch([ref.weight])
    for _ in range(steps):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, BATCH))
        up = torch.randn(BATCH, DIM, generator=gen)
        if oracle:
            ref_opt.zero_grad()
            (ref(ids) * up).sum().backward()
            ref_opt.step()
        rows = emb(ids)
        assert rows.dtype == torch.float32
        (rows * up).sum().backward()
        opt.step()
    return emb.weight[torch.arange(ROWS)], ref.weight.detach(), w0


@pytest.mark.parametrize("dtype", sorted(HALF_TOL))
@pytest.mark.parametrize("case", sorted(CASES))
def test_half_table_tracks_the_float32_oracle(ctx, model_impl, case, dtype):
    ours, want, w0 = _train(ctx, case, dtype)
    assert ours.dtype == torch.float32
    assert (want - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    err = float((ours - want).abs().max() / want.abs().max())
    assert err < HALF_TOL[dtype], f"{case} {dtype}: max error {err:.2e} of max|w|"
    assert err > 1e-5, "as close as a float32 table: rows are not stored in 16 bits"
    # every row is a value of the storage dtype
    assert torch.equal(ours, ours.to(getattr(torch, dtype)).float())


def test_rows_round_to_nearest_even_and_read_back_exactly(ctx):
    emb = DistEmbedding(4, 4, name="h-round", context=ctx, dtype=torch.bfloat16)
    ulp = 2.0 ** -7  # of bfloat16 at 1.0
    emb.weight[torch.tensor([1])] = torch.tensor([[1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 4,
                                                   -(1 + 3 * ulp / 4)]])
    assert emb.weight[torch.tensor([1])].tolist() == [[1.0, 1 + 2 * ulp, 1.0, -(1 + ulp)]]
    emb.weight[torch.tensor([2])] = torch.tensor([[0.5, 2, 3, 4]], dtype=torch.bfloat16)
    assert emb(torch.tensor([2])).tolist() == [[0.5, 2, 3, 4]]
    assert emb.dtype == torch.bfloat16 and emb.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="expected dtype bfloat16 \\(or float32\\)"):
        emb.weight[torch.tensor([0])] = torch.zeros(1, 4, dtype=torch.int64)


def test_init_func_gets_the_table_dtype_and_is_rounded(ctx):
    seen = []

    def init(shape, dtype):
        seen.append(dtype)
        return torch.full(shape, 1 + 2 ** -11, dtype=torch.float32)  # a tie: rounds to 1
    emb = DistEmbedding(6, 3, name="h-init", context=ctx, dtype=torch.float16,
                        init_func=init)
    assert seen == [torch.float16]
    assert emb(torch.arange(6)).eq(1.0).all()


def test_bad_dtype_and_rounding_are_refused(ctx):
    with pytest.raises(ValueError, match="dtype: expected one of"):
        DistEmbedding(4, 2, name="h-bad", context=ctx, dtype=torch.int8)
    with pytest.raises(ValueError, match="'stochastic' is for bfloat16"):
        DistEmbedding(4, 2, name="h-bad", context=ctx, dtype=torch.float16,
                      rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        DistEmbedding(4, 2, name="h-bad", context=ctx, dtype=torch.bfloat16, rounding="up")
    with pytest.raises(ValueError, match="rounding_seed: expected an int"):
        DistEmbedding(4, 2, name="h-bad", context=ctx, dtype=torch.bfloat16,
                      rounding="stochastic", rounding_seed=-3)


def test_stochastic_rounding_keeps_small_updates_and_is_reproducible(ctx):
    def run(rounding, seed=7, name="a"):
        emb = DistEmbedding(64, 8, name=f"h-sr-{rounding}-{seed}-{name}", context=ctx,
                            dtype=torch.bfloat16, rounding=rounding, rounding_seed=seed,
                            init_func=lambda s, d: torch.ones(s, dtype=d))
        opt = SparseSGD([emb], lr=1e-3)  # an eighth of an ulp at 1.0 per step
        for _ in range(100):
            emb(torch.arange(64)).sum().backward()
            opt.step()
        return emb.weight[torch.arange(64)]
    assert run("nearest").eq(1.0).all()  # every update rounds away
    sr = run("stochastic")
    assert abs(float(sr.mean()) - 0.9) < 0.01  # unbiased: the float32 result on average
    assert torch.equal(sr, run("stochastic", name="b"))  # same seed, same rows
    assert not torch.equal(sr, run("stochastic", seed=8))


def test_optimizer_state_is_float32_and_has_a_state_dict(ctx):
    emb = DistEmbedding(10, 4, name="h-state", context=ctx, dtype=torch.bfloat16)
    opt = SparseAdagrad([emb], lr=0.1)
    emb(torch.tensor([1, 1, 3])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    opt2 = SparseAdagrad([emb], lr=0.1)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["state"].keys() == sd["state"].keys()
    sums = [v for st in sd["state"].values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() == 2]
    assert sums and all(s.dtype == torch.float32 for s in sums)
    assert float(sums[0][1, 0]) == 4.0  # duplicate ids summed: (1 + 1) ** 2


def test_checkpoint_keeps_the_dtype_and_converts_on_load(tmp_path):
    ctx = DistContext.embedded(backend="pytorch", num_threads=1)
    try:
        w = torch.randn(50, 8)
        a = DistEmbedding(50, 8, name="ck", context=ctx, dtype=torch.bfloat16)
        a.weight[torch.arange(50)] = w
        opt = SparseAdagrad([a], lr=0.1)
        a(torch.tensor([1, 2, 2])).sum().backward()
        opt.step()
        opt.save(str(tmp_path / "c"))
        assert read_meta(str(tmp_path / "c"))["tensors"]["ck"]["dtype"] == "bfloat16"
        saved, state = a.weight[torch.arange(50)], opt.state_dict()
        a(torch.tensor([1, 3])).sum().backward()
        opt.step()
        opt.load(str(tmp_path / "c"))
        assert torch.equal(a.weight[torch.arange(50)], saved)
        assert all(torch.equal(x, y) for x, y in zip(_tensors(opt.state_dict()),
                                                     _tensors(state)))
        # into a float32 table: exact; float32 rows into a float16 table: rounded
        ctx.client.delete_data("ck")
        b = DistEmbedding(50, 8, name="ck", context=ctx)
        restore(str(tmp_path / "c"), ctx.client, ["ck"])
        assert torch.equal(b.weight[torch.arange(50)], saved)
        b.weight[torch.arange(50)] = w
        save(str(tmp_path / "f"), ctx.client, ["ck"], {})
        ctx.client.delete_data("ck")
        c = DistEmbedding(50, 8, name="ck", context=ctx, dtype=torch.float16)
        restore(str(tmp_path / "f"), ctx.client, ["ck"])
        assert torch.equal(c.weight[torch.arange(50)], w.half().float())
        ctx.client.delete_data("ck")
        live = DistTensor((50, 8), torch.int32, name="ck", context=ctx)  # noqa: F841
        with pytest.raises(KVStoreError, match="was saved as .* bfloat16, the live one "
                                               "has rows \\(8,\\) int32"):
            restore(str(tmp_path / "c"), ctx.client, ["ck"])
    finally:
        ctx.close()


def _tensors(state_dict):
    return [v for st in state_dict["state"].values() for v in st.values()
            if isinstance(v, torch.Tensor)]


def test_the_wire_carries_two_byte_rows_and_checks_them():
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)
    assert svc.handle(Create.of_spec("w", DenseSpec((10, 8), "bfloat16")).encode()).service != 101
    rows = half.encode(np.full((2, 8), 1.5, np.float32), "bfloat16")
    push = Push(name="w", parts=[0], counts=[2], ids=np.array([3, 4]), values=rows)
    assert svc.handle(push.encode()).service != 101
    reply = svc.handle(Pull(name="w", parts=[0], counts=[2], ids=np.array([4, 0])).encode())
    (got,) = reply.arrays
    assert got.dtype == half.BFLOAT16 and got.nbytes == 2 * 8 * 2
    assert half.decode(got).tolist() == [[1.5] * 8, [0.0] * 8]
    # float32 values for a bfloat16 table are refused (the client rounds them first)
    bad = Push(name="w", parts=[0], counts=[1], ids=np.array([1]),
               values=np.ones((1, 8), np.float32))
    err = svc.handle(bad.encode())
    assert err.service == 101 and "expected bfloat16 rows" in err.fields["message"]
    # a frame's bfloat16 array survives the byte encoding, with its dtype
    head = encode_head(push.encode())
    header = parse_header(head[:HEADER.size], 1 << 30)
    specs = parse_descriptors(io.BytesIO(head[HEADER.size:]).read, header)
    assert specs[1] == (half.BFLOAT16, (2, 8)) and header.payload_len == 2 * 8 + 2 * 8 * 2
    with pytest.raises(ValueError, match="rounding_seed"):  # a seed of bfloat16 rows only
        DenseSpec.from_fields(dict(DenseSpec((10, 8), "float16").fields(), seed=5))


@pytest.mark.multiprocess
@pytest.mark.parametrize("servers,shm", [(1, False), (2, False), (2, True)])
def test_cluster_equals_embedded_bit_for_bit(tmp_path, servers, shm):
    cluster = Cluster(tmp_path, servers, shared_memory=shm, timeout_s=20.0)
    try:
        remote = DistContext(cluster.client(), backend="pytorch", role="trainer",
                             num_threads=1)
        local = DistContext(LocalKVClient(), backend="pytorch", role="trainer",
                            num_threads=1)
        policy = range_policy(ROWS, servers)
        for case, dtype, rounding in [("adagrad", "bfloat16", "nearest"),
                                      ("adam", "float16", "nearest"),
                                      ("sgd", "bfloat16", "stochastic")]:
            got = [_train(c, case, dtype, steps=10, policy=policy, rounding=rounding,
                          oracle=False)[0] for c in (remote, local)]
            assert torch.equal(got[0], got[1]), (case, dtype, rounding)
        wire = remote.client.pull("half-sgd-bfloat16", np.arange(4))
        assert wire.dtype == np.float32
        if servers == 1:  # a trainer cache passes half tables through, uncached
            cached = DistContext(CachedKVClient(cluster.client(), CACHES["cache_exact"]),
                                 backend="pytorch", role="trainer", num_threads=1)
            got = _train(cached, "adagrad", "bfloat16", steps=10, policy=policy,
                         oracle=False, name="cached")[0]
            want = _train(local, "adagrad", "bfloat16", steps=10, policy=policy,
                          oracle=False, name="cached")[0]
            assert torch.equal(got, want)
            assert cached.client.stats()["pulls"] == 0  # nothing went through the cache
        remote.client.close(goodbye=False)
        local.close()
    finally:
        cluster.stop()


def test_dgl_namespace_passes_dtype_through(ctx):
    import distemb.dgl as dist
    emb = dist.DistEmbedding(8, 4, name="h-dgl", context=ctx, dtype=torch.bfloat16)
    assert emb.dtype == torch.bfloat16
    assert emb.kvstore.data_meta("h-dgl").dtype == "bfloat16"
