"""Half-precision tables on the device path (DeviceKVClient with half_ops).

On the CPU (always run): a DeviceKVClient on device 'cpu' whose kernels are the tests'
twins (tests/cpu_cuda_twin.py: CpuCudaTwin for the gradient sums, CpuCudaHalfTwin for
the half rows) runs every line of the GPU dispatch for bfloat16/float16 tables: it must
track the float32 torch oracle within tests/test_half_embedding.py's tolerances, and, on
batches of unique ids (so that gradient sums cannot differ in order), equal the embedded
host table bit for bit, stochastic rounding included.

On a GPU (skipped here, with the reason): the CUDA kernels (distemb.kernels.cuda_half)
equal the CPU half kernels bit for bit, and a table on the GPU equals the host table.
"""
import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaHalfTwin, CpuCudaTwin
from distemb import SparseAdagrad, SparseSGD
from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.kernels import cuda, half
from distemb.kernels.cuda_half import CudaHalfOps
from distemb.kvstore import LocalKVClient
from distemb.kvstore.device import DeviceKVClient
from tests.test_half_embedding import HALF_TOL, _train

needs_gpu = pytest.mark.skipif(not cuda.cuda_available(),
                               reason="no usable CUDA GPU here (the CPU twin and the "
                                      "emulated kernels cover the logic)")


def _device_ctx(device="cpu"):
    if device == "cpu":
        client = DeviceKVClient("cpu", ops=CpuCudaTwin(), half_ops=CpuCudaHalfTwin)
    else:
        client = DeviceKVClient(torch.device(device))
    return DistContext(client, backend="pytorch", role="trainer", num_threads=1)


@pytest.mark.parametrize("dtype", sorted(HALF_TOL))
@pytest.mark.parametrize("case", ["sgd", "adagrad", "rowwise_adagrad", "adam", "adam-per-row"])
def test_device_half_table_tracks_the_float32_oracle(case, dtype):
    ctx = _device_ctx()
    try:
        ours, want, w0 = _train(ctx, case, dtype)
        store = ctx.client.store(f"half-{case}-{dtype}")
        assert isinstance(store.ops, CpuCudaHalfTwin)
        assert store.ops.calls["half_gather_rows_checked"] >= 50
        assert store.column("weight").dtype == getattr(torch, dtype)
    finally:
        ctx.close()
    err = float((ours - want).abs().max() / want.abs().max())
    assert (want - w0).abs().max() > 1e-2
    assert 1e-5 < err < HALF_TOL[dtype], f"{case} {dtype}: max error {err:.2e} of max|w|"


def _unique_steps(ctx, rounding, case="adagrad", steps=20, rows=200, dim=24):
    """A bfloat16 table after ``steps`` steps of unique ids (no duplicate sums)."""
    emb = DistEmbedding(rows, dim, name="u", context=ctx, dtype=torch.bfloat16,
                        rounding=rounding, rounding_seed=5,
                        init_func=lambda s, d: torch.linspace(-1, 1, s[0] * s[1]).reshape(s))
    opt = SparseAdagrad([emb], lr=0.05) if case == "adagrad" else SparseSGD([emb], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randperm(rows, generator=gen)[:rows // 2]
        looked_up = emb(ids)  # on the table's device; the upstream gradient goes there
        (looked_up * torch.randn(rows // 2, dim, generator=gen).to(looked_up.device)
         ).sum().backward()
        opt.step()
    return emb.weight[torch.arange(rows)].cpu()


@pytest.mark.parametrize("rounding,case", [("nearest", "adagrad"), ("stochastic", "sgd"),
                                           ("stochastic", "adagrad")])
def test_device_half_table_equals_the_host_table(rounding, case):
    host = DistContext(LocalKVClient(), backend="pytorch", role="trainer", num_threads=1)
    device = _device_ctx()
    try:
        got = [_unique_steps(c, rounding, case) for c in (device, host)]
    finally:
        host.close()
        device.close()
    assert torch.equal(got[0], got[1])


def test_stochastic_rounding_of_a_float16_device_table_is_refused():
    ctx = _device_ctx()
    try:
        with pytest.raises(ValueError, match="'stochastic' is for bfloat16"):
            DistEmbedding(4, 2, name="x", context=ctx, dtype=torch.float16,
                          rounding="stochastic")
        with pytest.raises(ValueError, match="stochastic rounding is for bfloat16"):
            ctx.client.init_data("y", (4, 2), "float16", None, rounding_seed=1)
    finally:
        ctx.close()


# --- on a GPU ---------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("kind", ["bfloat16", "float16", "bfloat16-stochastic"])
@pytest.mark.parametrize("op", ["gather", "sgd", "adagrad", "rowwise_adagrad", "adam",
                                "adam-per-row"])
def test_cuda_half_kernels_equal_the_cpu_half_kernels(op, kind):
    rng = np.random.default_rng(0)
    rows, d = 500, 96
    dtype = "float16" if kind == "float16" else "bfloat16"
    seed = 11 if kind.endswith("stochastic") else None
    weight = half.encode(rng.standard_normal((rows, d)).astype(np.float32), dtype)
    ids = rng.permutation(rows)[:200].astype(np.int64)
    grads = rng.standard_normal((200, d)).astype(np.float32)
    a = rng.random((rows, d)).astype(np.float32)
    b = rng.random((rows, d)).astype(np.float32)
    steps = rng.integers(0, 4, rows).astype(np.int64)
    tdtype = getattr(torch, dtype)
    gw = torch.from_numpy(weight.view(np.int16).copy()).view(tdtype).cuda()
    ga, gb, gs = (torch.from_numpy(x.copy()).cuda() for x in (a, b, steps))
    gi, gg = torch.from_numpy(ids).cuda(), torch.from_numpy(grads).cuda()
    ops, cpu = CudaHalfOps(seed), half.StochasticRounding(seed) if seed is not None else half
    if op == "gather":
        got = ops.gather_rows(gw, gi).cpu().numpy()
        assert np.array_equal(got.view(np.int32), half.gather_rows(weight, ids).view(np.int32))
        return
    if op == "sgd":
        ops.sgd_update(gw, gi, gg, 0.05)
        cpu.sgd_update(weight, ids, grads, 0.05)
    elif op == "adagrad":
        ops.adagrad_update(gw, ga, gi, gg, 0.05, 1e-3)
        cpu.adagrad_update(weight, a, ids, grads, 0.05, 1e-3)
    elif op == "rowwise_adagrad":
        ga1 = ga[:, 0].contiguous()
        a1 = a[:, 0].copy()
        ops.rowwise_adagrad_update(gw, ga1, gi, gg, 0.05, 1e-3)
        cpu.rowwise_adagrad_update(weight, a1, ids, grads, 0.05, 1e-3)
        assert np.array_equal(ga1.cpu().numpy().view(np.int32), a1.view(np.int32))
    else:
        per_row = op == "adam-per-row"
        ops.adam_update(gw, ga, gb, gi, gg, 0.01, 0.9, 0.99, 1e-8, 3,
                        row_steps=gs if per_row else None)
        cpu.adam_update(weight, a, b, ids, grads, 0.01, 0.9, 0.99, 1e-8, 3,
                        row_steps=steps if per_row else None)
        assert np.array_equal(gs.cpu().numpy(), steps)
        assert np.array_equal(gb.cpu().numpy().view(np.int32), b.view(np.int32))
    assert np.array_equal(ga.cpu().numpy().view(np.int32), a.view(np.int32))
    assert np.array_equal(gw.view(torch.int16).cpu().numpy(), weight.view(np.int16))


@needs_gpu
@pytest.mark.parametrize("kind", ["bfloat16", "float16", "bfloat16-stochastic"])
def test_cuda_half_ftrl_equals_the_cpu_half_kernel(kind):
    """lr_power -0.5 (a sqrtf, exact everywhere): the GPU's bits are the CPU's."""
    rng = np.random.default_rng(1)
    rows, d = 500, 96
    dtype = "float16" if kind == "float16" else "bfloat16"
    seed = 11 if kind.endswith("stochastic") else None
    weight = half.encode(rng.standard_normal((rows, d)).astype(np.float32), dtype)
    ids = rng.permutation(rows)[:200].astype(np.int64)
    grads = rng.standard_normal((200, d)).astype(np.float32)
    n = rng.random((rows, d)).astype(np.float32)
    z = rng.standard_normal((rows, d)).astype(np.float32)
    gw = torch.from_numpy(weight.view(np.int16).copy()).view(getattr(torch, dtype)).cuda()
    gn, gz = torch.from_numpy(n.copy()).cuda(), torch.from_numpy(z.copy()).cuda()
    ops, cpu = CudaHalfOps(seed), half.StochasticRounding(seed) if seed is not None else half
    hyper = (0.05, -0.5, 0.3, 0.01, 0.02, 0.1)
    ops.ftrl_update(gw, gn, gz, torch.from_numpy(ids).cuda(), torch.from_numpy(grads).cuda(),
                    *hyper)
    cpu.ftrl_update(weight, n, z, ids, grads, *hyper)
    assert np.array_equal(gn.cpu().numpy().view(np.int32), n.view(np.int32))
    assert np.array_equal(gz.cpu().numpy().view(np.int32), z.view(np.int32))
    assert np.array_equal(gw.view(torch.int16).cpu().numpy(), weight.view(np.int16))


@needs_gpu
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gpu_half_table_equals_the_host_table(rounding):
    host = DistContext(LocalKVClient(), backend="pytorch", role="trainer", num_threads=1)
    device = _device_ctx("cuda")
    try:
        got = [_unique_steps(c, rounding) for c in (device, host)]
    finally:
        host.close()
        device.close()
    assert torch.equal(got[0], got[1])

