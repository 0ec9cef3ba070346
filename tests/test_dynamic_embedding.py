"""DynamicEmbedding: the oracle is the dense DistEmbedding (itself tested against torch.optim).

A dynamic table gives each key the row the dense table gives the row of that key, with
the same initial rows: after 50 steps of zipf-distributed, duplicate-heavy ids the two
tables are bit-identical, for every optimizer, whether the keys are 0..N-1 or arbitrary
int64 keys standing for the rows.
"""
import os

import numpy as np
import pytest
import torch

from distemb.embedding import DistEmbedding
from distemb.dynamic import DynamicEmbedding
from distemb.errors import DistEmbError, MissingKeyError, StoreError
from distemb.optim import SparseAdagrad, SparseSGD
from distemb.stores import key_normal
from tests.conftest import zipf_ids
from tests.test_optim_oracle import CASES

STEPS, ROWS, BATCH, DIM = 50, 300, 256, 16


def key_map(kind):
    if kind == "0..N-1":
        return np.arange(ROWS, dtype=np.int64)
    rng = np.random.default_rng(7)
    return np.unique(rng.integers(-2 ** 62, 2 ** 62, ROWS * 2))[:ROWS][rng.permutation(ROWS)]


@pytest.mark.parametrize("keys_kind", ["0..N-1", "random int64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bit_identical_to_the_dense_table(ctx, case, keys_kind):
    make_opt = CASES[case][0]
    keys = key_map(keys_kind)
    init = key_normal(DIM, seed=11)
    dense = DistEmbedding(ROWS, DIM, name=f"dense-{case}", context=ctx)
    dense.weight[torch.arange(ROWS)] = torch.from_numpy(init(keys))
    dyn = DynamicEmbedding(DIM, name=f"dyn-{case}", init_func=init, context=ctx)
    opt_dense, opt_dyn = make_opt([dense]), make_opt([dyn])
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    half = BATCH // 2
    for _ in range(STEPS):
        ids = zipf_ids(rng, ROWS, BATCH)
        up = torch.randn(BATCH, DIM, generator=gen)
        for emb, opt, idx in ((dense, opt_dense, torch.from_numpy(ids)),
                              (dyn, opt_dyn, torch.from_numpy(keys[ids]))):
            a, b = emb(idx[:half]), emb(idx[half:])
            ((a * up[:half]).sum() + (b * up[half:]).sum()).backward()
            opt.step()
    held = dyn.export()
    rows_of = {int(k): i for i, k in enumerate(keys)}
    order = np.array([rows_of[int(k)] for k in held["keys"]])
    want = dense.weight[torch.from_numpy(order)]
    assert torch.equal(torch.from_numpy(held["weight"]), want), "not bit-identical"
    assert (want - torch.from_numpy(init(keys[order]))).abs().max() > 1e-2
    assert dyn.size() == len(order) > ROWS // 2


def test_initial_rows_are_a_function_of_the_key_only(ctx):
    init = key_normal(8, seed=3)
    a = DynamicEmbedding(8, name="a", init_func=init, context=ctx)
    b = DynamicEmbedding(8, name="b", init_func=init, context=ctx)
    keys = torch.tensor([5, 2 ** 50, -9, 77])
    a(keys)
    rows_b = b(keys.flip(0)).flip(0)
    assert torch.equal(a.get(keys), rows_b)
    assert torch.equal(a.get(keys), torch.from_numpy(init(keys.numpy())))


def test_export_import_resumes_training_exactly(ctx):
    init = key_normal(4, seed=1)
    rng = np.random.default_rng(3)
    batches = [rng.integers(-50, 50, 64) * 1000 for _ in range(10)]
    grads = [torch.from_numpy(rng.standard_normal((64, 4)).astype(np.float32))
             for _ in range(10)]

    def train(emb, opt, steps):
        for ids, g in steps:
            (emb(torch.from_numpy(ids)) * g).sum().backward()
            opt.step()

    ref = DynamicEmbedding(4, name="ref", init_func=init, context=ctx)
    ref_opt = SparseAdagrad([ref], lr=0.1)
    train(ref, ref_opt, zip(batches, grads))
    a = DynamicEmbedding(4, name="first", init_func=init, context=ctx)
    a_opt = SparseAdagrad([a], lr=0.1)
    train(a, a_opt, zip(batches[:5], grads[:5]))
    data = a.export()
    assert sorted(data) == ["keys", "sum", "weight"] and len(data["keys"]) == a.size()
    b = DynamicEmbedding(4, name="second", init_func=init, context=ctx)
    b_opt = SparseAdagrad([b], lr=0.1)
    b.import_(data)
    train(b, b_opt, zip(batches[5:], grads[5:]))
    got, want = b.export(), ref.export()
    for k in ("keys", "weight", "sum"):
        np.testing.assert_array_equal(got[k], want[k])


def test_save_load_round_trip(ctx, tmp_path):
    a = DynamicEmbedding(3, name="saved", init_func=key_normal(3), context=ctx)
    opt = SparseAdagrad([a], lr=0.1)
    a(torch.tensor([5, -2 ** 40, 9])).sum().backward()
    opt.step()
    assert a.export()["sum"].min() == 1.0
    a.save(tmp_path / "t.npz")
    b = DynamicEmbedding(3, name="loaded", context=ctx)
    SparseAdagrad([b], lr=0.1)
    b.load(tmp_path / "t.npz")
    for k, v in a.export().items():
        np.testing.assert_array_equal(b.export()[k], v)
    with pytest.raises(StoreError, match="dim 3, expected .* with dim 4"):
        DynamicEmbedding(4, context=ctx).load(tmp_path / "t.npz")
    (tmp_path / "junk.npz").write_text("no")
    with pytest.raises(StoreError, match="not a saved table"):
        b.load(tmp_path / "junk.npz")


#: Saves a table, then saves it grown under a file-size limit (the kernel refuses the
#: write past it, as a full disk does), and prints what the second save raised.
FULL_DISK = """
import os, resource, signal, sys, torch
from distemb.context import DistContext
from distemb.dynamic import DynamicEmbedding
emb = DynamicEmbedding(64, name="t", context=DistContext.embedded(backend="pytorch"))
emb(torch.arange(3))
emb.save(sys.argv[1])
emb(torch.arange(20000))  # 5 MiB of rows
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    emb.save(sys.argv[1])
except OSError as e:
    print("raised", type(e).__name__, e.errno, flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_save_that_runs_out_of_room_raises_its_oserror_and_nothing_else(tmp_path):
    """A save that cannot write (a full disk; here a file-size limit) raises the OSError
    and leaves the earlier file whole; the zip writer is closed before its file, so no
    ignored "seek of closed file" error is printed at the writer's collection."""
    import errno
    import sys

    from mp_helper import ProcessGroup
    path = tmp_path / "t.npz"
    with ProcessGroup() as group:
        group.spawn([sys.executable, "-c", FULL_DISK, str(path)])
        out = list(group.wait_all(60).values())[0]
    assert out.strip() == f"raised OSError {errno.EFBIG}", out
    assert sorted(os.listdir(tmp_path)) == ["t.npz"]  # no temporary file left
    with np.load(path) as z:
        assert z["c/keys"].tolist() == [0, 1, 2]  # the earlier save, whole


def test_upsert_remove_and_eviction_drop_rows_with_their_state(ctx):
    emb = DynamicEmbedding(2, name="ev", capacity=10, low_water=0.5, context=ctx)
    opt = SparseAdagrad([emb], lr=1.0)
    emb.upsert(torch.tensor([1, 2]), torch.ones(2, 2))
    assert emb.get(torch.tensor([2])).tolist() == [[1.0, 1.0]]
    for batch in (range(0, 6), range(6, 10)):
        emb(torch.tensor(list(batch))).sum().backward()
        opt.step()
    assert emb.size() == 10 and emb.export()["sum"].max() == 1.0
    emb(torch.tensor([100]))  # past capacity: down to 5, the oldest batch goes first
    assert emb.size() == 5 and set(emb.export()["keys"].tolist()) == {6, 7, 8, 9, 100}
    assert emb.remove(torch.tensor([6, 6, 55])) == 1
    with pytest.raises(MissingKeyError, match=r"\[6\]"):
        emb.get(torch.tensor([6]))
    assert emb.contains(torch.tensor([6, 7])).tolist() == [False, True]
    emb(torch.tensor([0])).sum().backward()  # a returning key: zero row, fresh state
    opt.step()
    data = emb.export()
    i = data["keys"].tolist().index(0)
    assert data["sum"][i].tolist() == [1.0, 1.0] and data["weight"][i].tolist() == [-1.0, -1.0]
    assert sorted(emb.evict(2, policy="lfu").tolist()) == [7, 8, 9] and emb.size() == 2


def test_bad_input(ctx):
    with pytest.raises(ValueError, match="capacity: expected a positive int, got 0"):
        DynamicEmbedding(2, capacity=0, context=ctx)
    with pytest.raises(ValueError, match="evict: must be one of"):
        DynamicEmbedding(2, evict="random", context=ctx)
    with pytest.raises(ValueError, match="dim"):
        DynamicEmbedding(0, context=ctx)
    emb = DynamicEmbedding(2, name="bad", context=ctx)
    with pytest.raises(TypeError, match="ids: expected an integer tensor"):
        emb(torch.tensor([1.0]))
    with pytest.raises(DistEmbError, match="not in the store"):
        emb.get(torch.tensor([3]))
    opt = SparseSGD([emb], lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    # state_dict covers store tables now (keyed state; tests/test_optim_store_state.py)
    assert SparseAdagrad([emb], lr=0.1).state_dict()["state"]["bad"]["keys"].tolist() == [1]


# --- defects of issue 21: each test failed before its fix -----------------------------

@pytest.mark.parametrize("kernels", ["twin", "gpu"])
def test_dynamic_table_looked_up_onto_a_device_trains_its_own_keys(ctx, monkeypatch,
                                                                  kernels):
    """Keys far past the live key count are summed apart, not lumped into one phantom
    key (the device view used the key count as a table size). On the CPU through the
    CUDA kernels' CPU stand-in (as tests/test_cuda_dispatch.py does for dense tables),
    and on a GPU where one is usable."""
    from cpu_cuda_twin import CpuCudaTwin
    from distemb.kernels import cuda
    from distemb.kvstore import device as device_kv
    from distemb.kvstore import views as views_kv

    if kernels == "twin":
        monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
        monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
        monkeypatch.setattr(views_kv.HostTableOnDevice, "ops", CpuCudaTwin())
    elif not cuda.cuda_available():
        pytest.skip("no usable GPU here: the CPU stand-in case covers the same path")
    emb = DynamicEmbedding(2, name="dyn-dev", context=ctx)
    opt = SparseSGD([emb], lr=1.0)
    keys = torch.tensor([2 ** 40, 2 ** 41, 1, -5])
    rows = emb(keys, device="cuda")
    (rows * torch.tensor([[1.0], [10.0], [100.0], [1000.0]]).to(rows.device)).sum().backward()
    opt.step()
    got = emb.export()
    assert got["keys"].tolist() == [-5, 1, 2 ** 40, 2 ** 41]
    assert got["weight"][:, 0].tolist() == [-1000.0, -100.0, -1.0, -10.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", ["twin", "gpu"])
def test_a_dynamic_table_on_a_gpu_trains_as_the_host_table_bit_for_bit(
        ctx, monkeypatch, tmp_path, kernels, dtype):
    """DynamicEmbedding(device="cuda"): rows and optimizer state on the device, the key
    index on the host. Against the same table on the host over 30 steps of Adam on
    duplicate-heavy int64 keys (two lookups a step; dyadic gradients, so sums are exact
    in any order): rows, state and the optimizer's state_dict bit for bit; a checkpoint
    of the GPU table loads into a host table and back. On the CPU through the CUDA
    kernels' stand-in, and on a GPU where one is usable."""
    from cpu_cuda_twin import CpuCudaHalfTwin, CpuCudaTwin
    from distemb import kernels as host_kernels
    from distemb.kernels import cuda
    from distemb.kvstore import device as device_kv
    from distemb.kvstore import views as views_kv
    from distemb.optim import SparseAdam

    if kernels == "twin":
        monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
        monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
        monkeypatch.setattr(device_kv.DeviceKVClient, "ops", CpuCudaTwin())
        monkeypatch.setattr(device_kv.DeviceKVClient, "half_ops", CpuCudaHalfTwin)
    elif not cuda.cuda_available():
        pytest.skip("no usable GPU here: the CPU stand-in case covers the same path")
    keys, init = key_map("random int64"), key_normal(DIM, std=0.5, seed=3)
    gpu = DynamicEmbedding(DIM, name="on-gpu", init_func=init, dtype=dtype, context=ctx,
                           device="cuda")
    host = DynamicEmbedding(DIM, name="on-host", init_func=init, dtype=dtype, context=ctx)
    assert host.device is None and gpu.device == device_kv.cuda_device("cuda")
    opts = [SparseAdam([gpu], lr=0.05), SparseAdam([host], lr=0.05)]
    rng, gen = np.random.default_rng(5), torch.Generator().manual_seed(5)
    for _ in range(30):
        ids = torch.from_numpy(keys[zipf_ids(rng, ROWS, BATCH)])
        up = torch.randint(-8, 9, (BATCH, DIM), generator=gen) / 8
        for emb, opt in zip((gpu, host), opts):
            a, b = emb(ids[:BATCH // 2]), emb(ids[BATCH // 2:])
            assert a.device == (emb.device or torch.device("cpu"))
            ((a * up[:BATCH // 2].to(a.device)).sum()
             + (b * up[BATCH // 2:].to(b.device)).sum()).backward()
            opt.step()
    got, want = gpu.export(), host.export()
    assert sorted(got) == sorted(want) == ["exp_avg", "exp_avg_sq", "keys", "weight"]
    exact = kernels == "twin" or host_kernels.HAS_EXT  # the reference kernels' maths differs
    for col, rows in want.items():
        if exact or col == "keys":
            np.testing.assert_array_equal(got[col], rows, err_msg=col)
        else:
            np.testing.assert_allclose(got[col], rows, rtol=1e-5, atol=1e-6, err_msg=col)
    assert np.abs(want["weight"] - init(want["keys"])).max() > 0.05  # it trained
    sd = [o.state_dict()["state"] for o in opts]
    assert sd[0]["on-gpu"]["step"] == sd[1]["on-host"]["step"] == 30
    # a checkpoint of the GPU table is the one format: a host table loads it, and back
    opts[0].save(str(tmp_path / "ckpt"))
    from distemb.context import DistContext
    other = DistContext.embedded(backend="pytorch", num_threads=1)
    try:
        back = DynamicEmbedding(DIM, name="on-gpu", dtype=dtype, context=other)
        SparseAdam([back], lr=0.05).load(str(tmp_path / "ckpt"))
        for col, rows in got.items():
            np.testing.assert_array_equal(back.export()[col], rows, err_msg=col)
    finally:
        other.close()
    gpu.remove(torch.from_numpy(got["keys"][:5]))
    opts[0].load(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(gpu.export()["weight"], got["weight"])


def test_a_gpu_client_refuses_a_store_object_and_a_file_table_by_name(tmp_path):
    """Its hash tables are made from a spec on the device; a store object (host memory)
    and a file table (files on the host) are refused naming both, and nothing is left."""
    from distemb.errors import KVStoreError
    from distemb.kvstore.device import DeviceKVClient
    from distemb.stores import HashStore
    from distemb.stores.spec import FileTableSpec

    kv = DeviceKVClient("cpu")  # a GPU in real use: nothing here runs a kernel
    with pytest.raises(KVStoreError, match=r"DeviceKVClient: cannot hold table 'obj' on a "
                                           r"HashStore: a store object lives in host memory"):
        kv.add_table("obj", HashStore(2))
    with pytest.raises(KVStoreError, match=r"DeviceKVClient: cannot hold table 'f' on a file "
                                           r"store \(FileTableSpec\)"):
        kv.create_table("f", FileTableSpec(str(tmp_path), 4, 2, preallocate=False))
    assert kv.names() == [] and not list(tmp_path.iterdir())
    kv.close()


def test_one_store_client_per_context_closed_with_it(ctx, tmp_path):
    """Two tables of one name in one context are one table; closing the context closes
    (flushes) its store tables."""
    a = DynamicEmbedding(2, name="same", context=ctx)
    b = DynamicEmbedding(2, name="same", context=ctx)
    a.upsert(torch.tensor([7]), torch.ones(1, 2))
    assert b.size() == 1 and b.get(torch.tensor([7])).tolist() == [[1.0, 1.0]]
    with pytest.raises(DistEmbError, match=r"'same' exists with dim 2.*got dim 3"):
        DynamicEmbedding(3, name="same", context=ctx)
    from distemb.stores import FileStore
    from distemb.dynamic import StoreEmbedding

    store = FileStore(tmp_path / "f", num_rows=10, dim=2)
    StoreEmbedding(store, name="file", context=ctx).weight[torch.tensor([3])] = \
        torch.full((1, 2), 5.0)
    ctx.close()
    assert store.closed  # closed (and flushed) with its context
    assert FileStore(tmp_path / "f").gather(np.array([3])).tolist() == [[5.0, 5.0]]


@pytest.mark.parametrize("make", ["dynamic", "dense"])
def test_initialiser_of_the_wrong_signature_is_refused_at_construction(ctx, make):
    if make == "dynamic":  # a DGL-style init_func(shape, dtype) given to a keyed table
        with pytest.raises(TypeError, match=r"init_func: expected init_func\(keys\) -> rows"
                                            r".*takes \(shape, dtype\)"):
            DynamicEmbedding(4, name="bad-init", context=ctx,
                             init_func=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    else:  # a keyed initialiser given to a dense table
        with pytest.raises(TypeError, match=r"init_func: expected init_func\(shape, dtype\) -> rows"
                                            r".*takes \(keys\)"):
            DistEmbedding(10, 4, name="bad-init", context=ctx, init_func=lambda keys: keys)


@pytest.mark.parametrize("kind", ["hash", "dense", "file"])
def test_a_store_refuses_an_initialiser_of_the_dense_signature_at_construction(kind, tmp_path):
    """As the table specs do: a DGL-style init(shape, dtype) given to a store object is
    refused naming ``init``, before anything is made (it used to fail at the first lookup
    with a raw TypeError, a hash store keeping the key with a zero row)."""
    from distemb.stores import DenseStore, FileStore, HashStore

    def dgl_init(shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    make = {"hash": lambda: HashStore(4, init=dgl_init),
            "dense": lambda: DenseStore(10, 4, init=dgl_init),
            "file": lambda: FileStore(tmp_path / "f", num_rows=10, dim=4, init=dgl_init)}[kind]
    with pytest.raises(TypeError, match=r"init: expected init\(keys\) -> rows, got a function "
                                        r"that takes \(shape, dtype\) \(that is the signature "
                                        r"of a dense table's initialiser\)"):
        make()
    assert not (tmp_path / "f").exists()
