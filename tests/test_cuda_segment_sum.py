"""The chunked, deterministic segment sum of the CUDA dedup, and the deferred id check.

The CUDA kernel (csrc/cuda/dedup.cu) sums an id's rows in chunks of ``cuda.SUM_CHUNK``
rows, each chunk in batch order, then the chunks' sums in chunk order. Without a GPU:
the CPU twin (tests/cpu_cuda_twin.py) is proven to add in exactly that order (against a
plain loop that states it), to equal a float64 sum within float32 rounding on skewed
zipf(1.1) batches of 65,536 rows whose hot id has over 5,000 rows, and to drive the
optimizers to torch's results (SGD: to a float64 reference, see DESIGN.md). With a GPU
(marked ``gpu``): the kernel equals the twin bit for bit on the same batches, twice.
The deferred id check: a lookup with bad ids reads zeros, the next call that finds the
flags landed reports the table and the range and does nothing; bad ids never alias
valid ones in the sort and are never updated. The padded dedup (no wait for the device)
fills unused slots with an id outside the table.
"""
import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaTwin, chunked_dedup_sum
from distemb.embedding import DistEmbedding
from distemb.errors import PartitionError
from distemb.kernels import cuda
from distemb.kvstore import device as device_kv
from distemb.kvstore import views as views_kv
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD

C = cuda.SUM_CHUNK
BATCH, DIM = 65_536, 16


def zipf_batch(seed, rows=1_000_000, batch=BATCH, dim=DIM):
    """A zipf(1.1) batch: ids shuffled in batch order, a hot id of over 5,000 rows."""
    rng = np.random.default_rng(seed)
    ids = ((rng.zipf(1.1, size=batch) - 1) % rows).astype(np.int64)
    grads = rng.standard_normal((batch, dim)).astype(np.float32)
    return ids, grads


def declared_order(ids, grads, chunk=C):
    """The kernel's order, stated as plain loops: chunks of each id's rows, left to right."""
    out = {}
    for key in sorted(set(ids.tolist())):
        rows = grads[np.flatnonzero(ids == key)]  # batch order
        partials = []
        for start in range(0, rows.shape[0], chunk):
            acc = rows[start].copy()
            for row in rows[start + 1:start + chunk]:
                acc = acc + row  # float32 + float32, rounded once
            partials.append(acc)
        acc = partials[0]
        for p in partials[1:]:
            acc = acc + p
        out[key] = acc
    return np.array(sorted(out), np.int64), np.stack([out[k] for k in sorted(out)])


def float64_sum(ids, grads):
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((uniq.shape[0], grads.shape[1]), np.float64)
    np.add.at(summed, inverse, grads.astype(np.float64))
    return uniq, summed


def boundary_cases():
    """Runs of exactly one chunk, one row more, several chunks, and one id everywhere."""
    rng = np.random.default_rng(7)
    cases = {}
    for name, counts in {"chunk": [C, 1, C], "chunk+1": [C + 1, 2, C - 1],
                         "two-chunks": [2 * C, 2 * C + 1, 1], "ragged": [5 * C + 3, 7, C]}.items():
        ids = np.repeat(np.arange(len(counts)) * 3, counts)
        rng.shuffle(ids)
        cases[name] = (ids.astype(np.int64),
                       rng.standard_normal((ids.shape[0], 5)).astype(np.float32))
    cases["one-id"] = (np.full(10 * C + 9, 4, np.int64),
                       rng.standard_normal((10 * C + 9, 3)).astype(np.float32))
    cases["single-row"] = (np.array([9], np.int64), np.ones((1, 2), np.float32))
    return cases


# --- the twin: the declared order, float64, skew -------------------------------------------


@pytest.mark.parametrize("name", sorted(boundary_cases()))
def test_twin_adds_in_the_declared_order(name):
    ids, grads = boundary_cases()[name]
    uniq, summed = chunked_dedup_sum(ids, grads)
    want_uniq, want = declared_order(ids, grads)
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(summed.view(np.int32), want.view(np.int32))  # bit for bit


def test_chunk_order_is_not_batch_order():
    """The test above can fail: a plain left-to-right sum differs in the last bits."""
    ids, grads = boundary_cases()["one-id"]
    sequential = grads[0].copy()
    for row in grads[1:]:
        sequential = sequential + row
    assert not np.array_equal(chunked_dedup_sum(ids, grads)[1][0], sequential)


def test_twin_on_a_small_zipf_batch_follows_the_declared_order():
    ids, grads = zipf_batch(1, rows=300, batch=3_000, dim=4)
    uniq, summed = chunked_dedup_sum(ids, grads)
    want_uniq, want = declared_order(ids, grads)
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(summed, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_twin_on_zipf_65536_matches_float64(seed):
    ids, grads = zipf_batch(seed)
    hot = np.bincount(ids).max()
    assert hot > 5_000, f"the hottest id has {hot} rows: not the skew this test is about"
    uniq, summed = chunked_dedup_sum(ids, grads)
    want_uniq, want = float64_sum(ids, grads)
    np.testing.assert_array_equal(uniq, want_uniq)
    # float32 rounding of a sum of k normal rows: |error| <~ k * 2^-24 * sum |g|
    bound = np.bincount(ids, minlength=uniq.max() + 1)[uniq][:, None] * 2.0**-23 * \
        np.maximum(1.0, np.abs(want))
    assert (np.abs(summed - want) <= bound).all()
    again = chunked_dedup_sum(ids.copy(), grads.copy())[1]
    assert np.array_equal(summed.view(np.int32), again.view(np.int32))  # deterministic


def test_bad_ids_are_summed_apart_as_the_table_size():
    ids = np.array([3, -1, 1023, 2048, 1023, -7], np.int64)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    uniq, summed = chunked_dedup_sum(ids, grads, num_rows=1024)
    assert uniq.tolist() == [3, 1023, 1024]
    assert summed.tolist() == [[0, 1], [12, 14], [2 + 6 + 10, 3 + 7 + 11]]


def test_twin_padded_dedup_fills_unused_slots_outside_the_table():
    twin = CpuCudaTwin()
    ids = torch.tensor([5, 1, 5, 9])
    uniq, summed = twin.dedup_sum_padded(ids, torch.ones(4, 2), num_rows=8)
    assert uniq.tolist() == [1, 5, 8, 8] and summed[:3].tolist() == [[1, 1], [2, 2], [1, 1]]
    with pytest.raises(ValueError, match="num_rows: expected the table size"):
        twin.dedup_sum_padded(ids, torch.ones(4, 2), num_rows=None)


# --- the optimizers through the twin on skewed 65,536-row batches ---------------------------

@pytest.fixture
def twin(monkeypatch):
    """Make device='cuda' give a DeviceKVClient on the CPU running CpuCudaTwin."""
    ops = CpuCudaTwin()
    monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(device_kv.DeviceKVClient, "ops", ops)
    return ops


ROWS, STEPS = 20_000, 3
OPTIMIZERS = {
    "adagrad": (lambda e: SparseAdagrad(e, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adam": (lambda e: SparseAdam(e, lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
}


def skewed_steps(seed):
    for step in range(STEPS):
        ids, grads = zipf_batch(100 * seed + step, rows=ROWS)
        yield torch.from_numpy(ids), torch.from_numpy(grads)


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_skewed_batches_match_torch_through_the_twin(ctx, twin, case):
    make_ours, make_torch = OPTIMIZERS[case]
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)
    ref.weight.data.copy_(w0)
    ref_opt = make_torch([ref.weight])
    emb = DistEmbedding(ROWS, DIM, name=f"skew-{case}", context=ctx, device="cuda")
    emb.weight[torch.arange(ROWS)] = w0
    opt = make_ours([emb])
    for ids, up in skewed_steps(1):
        ref_opt.zero_grad()
        (ref(ids) * up).sum().backward()
        ref_opt.step()
        (emb(ids) * up).sum().backward()
        opt.step()
    assert twin.calls["dedup_sum_padded"] == STEPS
    expected = ref.weight.detach()
    assert (expected - w0).abs().max() > 1e-2
    torch.testing.assert_close(emb.weight[torch.arange(ROWS)], expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("case", ["sgd", "rowwise_adagrad"])
def test_skewed_batches_match_float64_through_the_twin(ctx, twin, case):
    """SGD (torch's CUDA SGD sums with atomics) and row-wise Adagrad against float64 maths."""
    lr, eps = 0.05, 1e-10
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    w = w0.double().numpy().copy()
    state = np.zeros(ROWS)
    emb = DistEmbedding(ROWS, DIM, name=f"skew64-{case}", context=ctx, device="cuda")
    emb.weight[torch.arange(ROWS)] = w0
    opt = (SparseSGD([emb], lr=lr) if case == "sgd"
           else SparseRowWiseAdagrad([emb], lr=lr, eps=eps))
    for ids, up in skewed_steps(2):
        uniq, g = float64_sum(ids.numpy(), up.numpy())
        if case == "sgd":
            w[uniq] -= lr * g
        else:
            state[uniq] += (g * g).mean(axis=1)
            w[uniq] -= lr * g / (np.sqrt(state[uniq]) + eps)[:, None]
        (emb(ids) * up).sum().backward()
        opt.step()
    ours = emb.weight[torch.arange(ROWS)].double().numpy()
    assert np.abs(w - w0.double().numpy()).max() > 1e-2
    np.testing.assert_allclose(ours, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


# --- the deferred id check, through the twin -----------------------------------------------

def test_bad_ids_are_reported_by_step_and_nothing_is_applied(ctx, twin):
    emb = DistEmbedding(8, 2, name="badids", context=ctx, device="cuda",
                        init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
    opt = SparseAdagrad([emb], lr=1.0)
    before = emb.weight[torch.arange(8)].clone()  # (a read is a lookup too: it would report)
    rows = emb(torch.tensor([3, 8, 3, -5, 12]))
    assert rows[[1, 3, 4]].abs().sum() == 0 and rows[[0, 2]].tolist() == [[1, 1], [1, 1]]
    rows.sum().backward()
    with pytest.raises(PartitionError, match=r"ids of 'badids' \(.*\): 3 out of range, from -5 "
                                             r"to 12 \(expected 0 <= id < 8\).*did nothing"):
        opt.step()
    assert torch.equal(emb.weight[torch.arange(8)], before)
    emb(torch.tensor([3])).sum().backward()  # reported once: the table works again
    opt.step()
    assert emb.weight[torch.tensor([3])][0, 0] < 1


def test_updates_never_write_outside_the_table(ctx, twin):
    """Bad ids already reported at a lookup still reach step(): they are skipped."""
    emb = DistEmbedding(4, 2, name="skip", context=ctx, device="cuda",
                        init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
    opt = SparseSGD([emb], lr=1.0)
    emb(torch.tensor([1, 4])).sum().backward()
    with pytest.raises(PartitionError, match="1 out of range, from 4 to 4"):
        emb(torch.tensor([2]))
    opt.step()
    assert emb.weight[torch.arange(4)][:, 0].tolist() == [1, 0, 1, 1]


# --- with a GPU: the kernel equals the twin, bit for bit ------------------------------------

@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda})")
    cuda.require_cuda()
    return torch.device("cuda", torch.cuda.current_device())


def _assert_bitwise(gpu_sum, want):
    got = gpu_sum.cpu().numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), \
        f"{np.count_nonzero(got != want)} of {got.size} sums differ from the twin's"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(boundary_cases()))
def test_gpu_sum_equals_twin_at_chunk_boundaries(gpu, name):
    ids, grads = boundary_cases()[name]
    uniq, summed = cuda.dedup_sum(torch.from_numpy(ids).to(gpu), torch.from_numpy(grads).to(gpu))
    want_uniq, want = chunked_dedup_sum(ids, grads)
    np.testing.assert_array_equal(uniq.cpu().numpy(), want_uniq)
    _assert_bitwise(summed, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 7, 128])
@pytest.mark.parametrize("num_rows", [None, 1_000_000], ids=["all_bits", "table_bits"])
def test_gpu_sum_of_zipf_65536_equals_twin_and_is_deterministic(gpu, dim, num_rows):
    ids, grads = zipf_batch(dim, dim=dim)
    assert np.bincount(ids).max() > 5_000
    ids_gpu, grads_gpu = torch.from_numpy(ids).to(gpu), torch.from_numpy(grads).to(gpu)
    uniq, summed = cuda.dedup_sum(ids_gpu, grads_gpu, num_rows=num_rows)
    want_uniq, want = chunked_dedup_sum(ids, grads)
    np.testing.assert_array_equal(uniq.cpu().numpy(), want_uniq)
    _assert_bitwise(summed, want)
    out = torch.full((BATCH + 5, dim), float("nan"), device=gpu)
    again = cuda.dedup_sum(ids_gpu, grads_gpu, num_rows=num_rows, out=out)[1]
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, summed)


@pytest.mark.gpu
def test_gpu_padded_dedup_equals_twin_without_a_wait(gpu):
    ids, grads = zipf_batch(3, rows=50_000, dim=8)
    ids[::1000] = -3  # bad ids too: summed apart, as the id num_rows
    ids[1::1000] = 50_000
    uniq, summed = cuda.dedup_sum_padded(torch.from_numpy(ids).to(gpu),
                                         torch.from_numpy(grads).to(gpu), num_rows=50_000)
    want_uniq, want = chunked_dedup_sum(ids, grads, num_rows=50_000)
    u = want_uniq.shape[0]
    assert uniq.shape == (BATCH,) and want_uniq[-1] == 50_000
    np.testing.assert_array_equal(uniq[:u].cpu().numpy(), want_uniq)
    assert (uniq[u:] == 50_000).all()
    _assert_bitwise(summed[:u], want)


@pytest.mark.gpu
def test_gpu_bad_ids_never_alias_valid_ones(gpu):
    ids = torch.tensor([3, -1, 1023, 2048, 1023, -7], device=gpu)
    grads = torch.arange(12, dtype=torch.float32, device=gpu).reshape(6, 2)
    uniq, summed = cuda.dedup_sum(ids, grads, num_rows=1024)  # 11-bit sort keys
    assert uniq.tolist() == [3, 1023, 1024]
    assert summed.tolist() == [[0, 1], [12, 14], [18, 21]]


@pytest.mark.gpu
def test_gpu_gather_checked_flags_bad_ids(gpu):
    table = torch.arange(12, dtype=torch.float32, device=gpu).reshape(6, 2)
    flags = torch.tensor(cuda.CLEAN_ID_FLAGS, dtype=torch.int64, device=gpu)
    rows = cuda.gather_rows_checked(table, torch.tensor([5, 6, -1, 0], device=gpu), flags)
    assert rows.tolist() == [[10, 11], [0, 0], [0, 0], [0, 1]]
    assert flags.tolist() == [2, -1, 6]
    cuda.gather_rows_checked(table, torch.tensor([99], device=gpu), flags)
    assert flags.tolist() == [3, -1, 99]


@pytest.mark.gpu
def test_gpu_updates_skip_rows_outside_the_table(gpu):
    weight = torch.ones(4, 3, device=gpu)
    cuda.sgd_update(weight, torch.tensor([-1, 2, 4], device=gpu), torch.ones(3, 3, device=gpu),
                    1.0)
    assert weight[:, 0].tolist() == [1, 1, 0, 1]


@pytest.mark.gpu
def test_gpu_bad_lookup_is_reported_by_step(ctx, gpu):
    emb = DistEmbedding(8, 2, name="gpu-bad", context=ctx, device=gpu,
                        init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
    opt = SparseAdagrad([emb], lr=1.0)
    before = emb.weight[torch.arange(8)].clone()
    rows = emb(torch.tensor([3, 8, -5], device=gpu))
    rows.sum().backward()
    torch.cuda.synchronize()  # the flags have landed: step() must see them (it never waits)
    with pytest.raises(PartitionError, match=r"'gpu-bad'.*2 out of range, from -5 to 8"):
        opt.step()
    assert torch.equal(emb.weight[torch.arange(8)], before)
