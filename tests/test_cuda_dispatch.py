"""GPU dispatch: tables on a CUDA device, and GPU lookups of host tables.

Three groups. Without a GPU: every way of asking for one fails with CudaUnavailableError
(or DistEmbError where the context cannot hold a device table) naming the reason, before
any copy. On CPU, through the device path: a DeviceKVClient on device 'cpu' whose ``ops``
is tests/cpu_cuda_twin.py (the kernels.cuda functions on CPU tensors) runs every
optimizer against the torch oracle, so everything but the CUDA kernels is proven here.
With a GPU (marked ``gpu``, skipped without one): the same oracle runs on CUDA tables,
and host tables with rows looked up onto the GPU.
"""
import functools

import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaTwin
from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.errors import DistEmbError, PartitionError
from distemb.kernels import cuda
from distemb.kvstore import LocalKVClient
from distemb.kvstore import device as device_kv
from distemb.kvstore import views as views_kv
from distemb.optim import SparseAdagrad, SparseAdam
from distemb.tensor import DistTensor
from tests.test_optim_oracle import CASES, assert_within, run_both

NO_GPU = not cuda.cuda_available()
REASON = "not built|CPU-only build|no CUDA device|no usable GPU"
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="a usable GPU is present here, so the "
                                  "no-GPU errors cannot be provoked")


# --- without a GPU: clear errors ---------------------------------------------------------

def test_unavailable_error_is_a_distemb_error():
    assert issubclass(cuda.CudaUnavailableError, DistEmbError)


@needs_no_gpu
def test_gpu_table_without_gpu_says_why(ctx):
    with pytest.raises(cuda.CudaUnavailableError, match=REASON):
        DistEmbedding(10, 4, name="gpu-emb", context=ctx, device="cuda")
    with pytest.raises(cuda.CudaUnavailableError, match=REASON):
        DistTensor((4, 2), "float32", name="gpu-t", context=ctx, device="cuda:0")
    with pytest.raises(cuda.CudaUnavailableError, match=REASON):
        DistTensor((4, 2), "float32", context=ctx, device=torch.device("cuda"))
    assert ctx.client.names() == [] and ctx._device_clients == {}


def test_library_built_without_cuda_says_how_to_build(ctx, tmp_path, monkeypatch):
    missing = str(tmp_path / "missing.so")
    monkeypatch.setattr(cuda, "require_cuda", functools.partial(cuda.require_cuda, missing))
    with pytest.raises(cuda.CudaUnavailableError, match="not built.*nvcc"):
        DistEmbedding(10, 4, name="nolib", context=ctx, device="cuda")
    emb = DistEmbedding(10, 4, name="nolib-host", context=ctx)
    with pytest.raises(cuda.CudaUnavailableError, match="not built.*nvcc"):
        emb(torch.tensor([1]), device="cuda")


@needs_no_gpu
def test_gpu_lookup_of_host_table_fails_before_any_copy(ctx):
    emb = DistEmbedding(10, 4, name="host", context=ctx)
    with pytest.raises(cuda.CudaUnavailableError, match=REASON):
        emb(torch.tensor([1, 2]), device="cuda")
    assert emb.trace == []  # nothing looked up, nothing recorded
    assert emb(torch.tensor([1, 2]), device="cpu").device.type == "cpu"


def test_trainer_context_refuses_gpu_tables():
    ctx = DistContext(LocalKVClient(), backend="pytorch", role="trainer", num_threads=1)
    try:
        with pytest.raises(DistEmbError, match="device='cuda'.*embedded-only.*'trainer'"):
            DistEmbedding(10, 4, name="t", context=ctx, device="cuda")
        assert ctx.client_for(None) is ctx.client and ctx.client_for("cpu") is ctx.client
    finally:
        ctx.close()


def test_numpy_backend_refuses_gpu_tables():
    ctx = DistContext.embedded(backend="numpy", num_threads=1)
    try:
        with pytest.raises(DistEmbError, match="pytorch backend.*'numpy'"):
            DistTensor((4, 2), "float32", context=ctx, device="cuda")
    finally:
        ctx.close()


@pytest.mark.parametrize("device", ["mps", "tpu:0"])
def test_other_devices_are_named_in_the_error(ctx, device):
    with pytest.raises(ValueError, match=f"device: expected None, 'cpu' or a CUDA device.*"
                                         f"{device}"):
        DistTensor((4, 2), "float32", context=ctx, device=device)


def test_host_tables_keep_the_host_path(ctx):
    emb = DistEmbedding(10, 4, name="host", context=ctx, device="cpu")
    assert emb.device is None and emb.kvstore is ctx.client
    assert emb.kvstore.ops is __import__("distemb.kernels").kernels
    emb(torch.tensor([1, 1]))
    assert isinstance(emb.trace[0][0], np.ndarray)  # ids stay numpy on the host path


# --- the device path on CPU, through the CUDA twin ---------------------------------------

@pytest.fixture
def twin(monkeypatch):
    """Make device='cuda' give a DeviceKVClient on the CPU running CpuCudaTwin."""
    ops = CpuCudaTwin()
    monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(device_kv.DeviceKVClient, "ops", ops)
    monkeypatch.setattr(views_kv.HostTableOnDevice, "ops", ops)
    return ops


@pytest.mark.parametrize("dim", [1, 7, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_path_matches_torch_oracle(ctx, twin, case, dim):
    ours, expected, w0 = run_both(ctx, case, dim, table_device="cuda")
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)
    rule_kernel = {"sgd": "sgd_update", "rowwise_adagrad": "rowwise_adagrad_update"}.get(
        case, "adam_update" if case.startswith("adam-") or case == "adam" else "adagrad_update")
    # every step summed and updated through the device client's kernels, not the host's
    assert twin.calls["dedup_sum_padded"] == 50 and twin.calls[rule_kernel] == 50
    assert twin.calls["gather_rows_checked"] >= 100  # lookups validate ids on the device


@pytest.mark.parametrize("case", ["sgd", "adagrad", "adam-per-row"])
def test_host_table_looked_up_on_device_matches_torch_oracle(ctx, twin, case):
    """A host table, rows looked up 'onto the GPU' (the twin on the CPU): the view sums
    there and only the sums come back to the host table."""
    ours, expected, w0 = run_both(ctx, case, 7, lookup_device="cuda", steps=20)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)
    assert twin.calls["dedup_sum"] == 20 and twin.calls["gather_rows"] == 0
    assert sum(twin.calls[k] for k in twin.calls if k.endswith("_update")) == 0


def test_host_table_view_keeps_storage_with_the_host_client(ctx, twin):
    emb = DistEmbedding(5, 2, name="viewed", context=ctx)
    view = emb.kvstore.view_on("cuda")
    assert isinstance(view, views_kv.HostTableOnDevice) and view.inner is ctx.client
    assert emb.kvstore.view_on(None) is emb.kvstore and emb.kvstore.view_on("cpu") is emb.kvstore
    emb(torch.tensor([4, 4]), device="cuda").sum().backward()
    lookup = emb.trace[0]
    assert isinstance(lookup.client, views_kv.HostTableOnDevice)
    assert isinstance(lookup.ids, np.ndarray)  # ids stay host ids: the host client pushes
    client, uniq, summed = emb.coalesced_gradients()
    assert client is lookup.client and uniq.tolist() == [4] and summed.tolist() == [[2.0, 2.0]]
    assert emb.trace == []


def test_device_table_lives_in_one_tensor_of_its_client(ctx, twin):
    emb = DistEmbedding(6, 3, name="dev", context=ctx, device="cuda",
                        init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
    kv = emb.kvstore
    assert isinstance(kv, device_kv.DeviceKVClient) and kv is ctx.client_for("cuda")
    assert emb.device == torch.device("cpu") and kv.ops is twin
    assert ctx.client.names() == [] and kv.names() == ["dev"]
    rows = emb(torch.tensor([[5, 0], [5, 5]]))
    assert rows.shape == (2, 2, 3) and rows.requires_grad
    assert isinstance(emb.trace[0][0], torch.Tensor) and emb.trace[0][0].dtype == torch.int64
    # Ids are validated on the device and reported by a later call, never by a wait.
    emb(torch.tensor([1, 6, -2]))
    with pytest.raises(PartitionError, match=r"ids of 'dev' .*: 2 out of range, from -2 to 6 "
                                             r"\(expected 0 <= id < 6\)"):
        emb(torch.tensor([1]))  # the twin's flags land at once, so the next lookup reports
    emb.reset_trace()
    with pytest.raises(PartitionError, match="id 6 is out of range.*0 <= id < 6"):
        emb.weight[torch.tensor([1, 6])] = torch.ones(2, 3)  # writes check at once
    with pytest.raises(TypeError, match="ids: expected an integer tensor"):
        emb(torch.tensor([1.0]))
    ctx.close()
    assert kv.names() == []


def test_device_table_never_aliases_what_init_func_returned(ctx, twin):
    """init_func may return a tensor the caller keeps (pretrained rows, one tensor for two
    tables): the table is a copy, so training it leaves the caller's tensor as it was."""
    pretrained = torch.ones(4, 3)
    emb = DistEmbedding(4, 3, name="pre", context=ctx, device="cuda",
                        init_func=lambda shape, dtype: pretrained)
    opt = SparseAdagrad([emb], lr=0.5)
    emb(torch.tensor([0, 2])).sum().backward()
    opt.step()
    assert torch.equal(pretrained, torch.ones(4, 3))
    assert emb.weight[torch.tensor([0])].tolist() == [[0.5, 0.5, 0.5]]


def test_device_tensor_push_pull_last_write_wins(ctx, twin):
    t = DistTensor((5, 2), torch.float32, name="dt", context=ctx, device="cuda")
    t[torch.tensor([3, 1, 3])] = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    assert t[torch.tensor([1, 3, 0])].tolist() == [[2, 2], [3, 3], [0, 0]]
    with pytest.raises(TypeError, match="values: expected dtype float32"):
        t[torch.tensor([0])] = torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"values: expected shape \(1, 2\)"):
        t[torch.tensor([0])] = torch.ones(3)
    same = DistTensor((5, 2), torch.float32, name="dt", context=ctx, device="cuda")
    assert same[torch.tensor([3])].tolist() == [[3, 3]]  # attached, not created


def test_device_optimizer_state_dict_and_checkpoint_round_trip(ctx, twin, tmp_path):
    emb = DistEmbedding(8, 3, name="ck", context=ctx, device="cuda",
                        init_func=lambda shape, dtype: torch.randn(shape, dtype=dtype))
    opt = SparseAdam([emb], lr=0.1)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["state"]["ck"]["step"] == 1 and sd["state"]["ck"]["exp_avg"].abs().sum() > 0
    opt.save(tmp_path / "ck.npz")
    saved = emb.weight[torch.arange(8)].clone()
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert not torch.equal(emb.weight[torch.arange(8)], saved)
    opt.load(tmp_path / "ck.npz")
    assert torch.equal(emb.weight[torch.arange(8)], saved)
    again = SparseAdam([emb], lr=0.1)
    again.load_state_dict(sd)
    assert torch.equal(again.state_dict()["state"]["ck"]["exp_avg"], sd["state"]["ck"]["exp_avg"])


def test_lookup_on_another_device_sums_on_the_table_device(ctx, twin):
    emb = DistEmbedding(4, 2, name="move", context=ctx, device="cuda")
    opt = SparseAdagrad([emb], lr=1.0)
    rows = emb(torch.tensor([1, 1, 3]), device="cpu")
    assert rows.device.type == "cpu"
    rows.sum().backward()
    opt.step()
    assert twin.calls["dedup_sum_padded"] == 1 and twin.calls["adagrad_update"] == 1
    assert emb.weight[torch.tensor([0, 1, 3])][:, 0].tolist() == pytest.approx([0, -1, -1])


# --- with a GPU ----------------------------------------------------------------------------

@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda})")
    return device_kv.cuda_device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 7, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_table_matches_torch_oracle_on_gpu(ctx, gpu, case, dim):
    ours, expected, w0 = run_both(ctx, case, dim, table_device=gpu, oracle_device=gpu)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 7, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_lookups_of_host_table_match_cpu_oracle(ctx, gpu, case, dim):
    ours, expected, w0 = run_both(ctx, case, dim, lookup_device=gpu)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)


@pytest.mark.gpu
def test_gpu_table_rows_and_trace_stay_on_the_gpu(ctx, gpu):
    emb = DistEmbedding(10, 4, name="stay", context=ctx, device="cuda")
    rows = emb(torch.tensor([1, 2, 2]))
    assert rows.device == gpu and emb.trace[0][0].device == gpu
    assert emb.kvstore.ops is cuda


@pytest.mark.multiprocess
def test_a_remote_hash_table_looked_up_onto_a_device_never_asks_for_its_size(
        clusters, twin, monkeypatch):
    """A step of a hash table on servers looked up onto a GPU sums its gradients there
    with the table's key space (any int64 key), never its key count: HostTableOnDevice
    took it from data_meta, which asked every server for the table's size on every step."""
    from distemb import DynamicEmbedding
    from distemb.stores import key_normal
    kv = clusters("tcp").client()
    asked = []
    monkeypatch.setattr(kv, "size", lambda name: asked.append(name) or 0)
    try:
        ctx = DistContext(kv, backend="pytorch", role="trainer", num_threads=1)
        emb = DynamicEmbedding(4, name="on-device", init_func=key_normal(4), context=ctx)
        opt = SparseAdagrad([emb], lr=0.5)
        for _ in range(3):
            emb(torch.tensor([2 ** 40, -3, 2 ** 40]), device="cuda").sum().backward()
            opt.step()
        assert twin.calls["dedup_sum"] == 3, "the gradients were not summed on the device"
        assert asked == [], f"a step asked the servers for the table's size {len(asked)} times"
        emb.close()
    finally:
        kv.close(goodbye=False)


def test_a_device_table_checks_its_keys_by_its_own_router(twin):
    """ids_in of a GPU-resident hash table refuses the keys its index reserves, naming the
    table (its keyed half ignored the table it was asked for)."""
    from cpu_cuda_twin import CpuCudaHalfTwin
    from distemb.backend import load_backend
    from distemb.stores.hash import HashTableSpec
    kv = device_kv.DeviceKVClient("cpu", ops=twin, half_ops=CpuCudaHalfTwin)
    kv.create_table("h", HashTableSpec(2))
    F = load_backend("pytorch")
    with pytest.raises(ValueError, match="ids of 'h': .* reserved"):
        kv.ids_in("h", torch.tensor([5, -2 ** 63]), F)
    assert kv.ids_in("h", torch.tensor([[5, -2 ** 63 + 2]]), F)[1] == (1, 2)
    kv.close()
