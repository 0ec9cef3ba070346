"""CUDA kernels: the build, the C API and its error paths here; results against the
numpy reference where a GPU is present (tests marked ``gpu``)."""
import ctypes
import glob
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpu_cuda_twin import chunked_dedup_sum
from distemb import kernels
from distemb.kernels import cuda, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
NVCC = os.environ.get("NVCC") or shutil.which("nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue


def _built_library():
    """The installed library, skipping only where the build was legitimately skipped."""
    if not os.path.exists(cuda.CUDA_LIB_PATH):
        if NVCC is None:
            pytest.skip("nvcc not found, so setup.py did not build the CUDA kernels")
        if os.environ.get("DISTEMB_NO_CUDA", "") not in ("", "0"):
            pytest.skip("DISTEMB_NO_CUDA set, so setup.py did not build the CUDA kernels")
    return cuda.load_library()


def _exported_symbols(path):
    out = subprocess.run(["nm", "-D", "--defined-only", path], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def _cuda_archs(path):
    """The SM versions of the CUDA ELF images (cubins) a library embeds, read from the
    images' headers (no cuobjdump here): e_machine EM_CUDA (190); the version in e_flags,
    bits 8-15 from ELF ABI version 8 on (CUDA 12.8+), bits 0-7 before."""
    with open(path, "rb") as f:
        data = f.read()
    archs, at = set(), data.find(b"\x7fELF", 1)
    while at >= 0:
        if data[at + 4] == 2 and struct.unpack_from("<H", data, at + 18)[0] == 190:
            flags = struct.unpack_from("<I", data, at + 48)[0]
            archs.add((flags >> 8) & 0xFF if data[at + 8] >= 8 else flags & 0xFF)
        at = data.find(b"\x7fELF", at + 4)
    return archs


def test_sources_compile_for_sm80(tmp_path):
    """The CUDA sources compile for sm_80 (A100s; H100s run the sm_90 build). Where
    setup.py built the library, that build is the proof, and compiling the sources again
    would repeat it (~40 s of CPU): its flags name sm_80, the library is newer than every
    source and holds sm_80 code. Where it did not (DISTEMB_NO_CUDA), they compile here."""
    if NVCC is None:
        pytest.skip("nvcc not found on PATH (set NVCC to test the CUDA sources)")
    if os.path.exists(cuda.CUDA_LIB_PATH) and \
            os.environ.get("DISTEMB_NO_CUDA", "") in ("", "0"):
        with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
            assert '"arch=compute_80,code=sm_80"' in f.read()
        sources = glob.glob(os.path.join(ROOT, "csrc", "cuda", "*"))
        assert os.path.getmtime(cuda.CUDA_LIB_PATH) >= max(map(os.path.getmtime, sources)), \
            f"{cuda.CUDA_LIB_PATH} is older than the CUDA sources: rebuild (make)"
        assert {80, 90} <= _cuda_archs(cuda.CUDA_LIB_PATH), _cuda_archs(cuda.CUDA_LIB_PATH)
        return
    lib = tmp_path / "lib.so"
    subprocess.run([NVCC, "-O3", "-std=c++17", "-shared", "-cudart", "static", "-fmad=false",
                    "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                    "-Xlinker", "--exclude-libs=ALL", "-gencode", "arch=compute_80,code=sm_80",
                    "-o", str(lib), *CUDA_SOURCES], check=True, timeout=300)
    assert cuda.load_library(str(lib)).distemb_cuda_abi_version() == cuda.ABI_VERSION
    assert _cuda_archs(lib) == {80}


def test_built_library_exports_exactly_the_api():
    _built_library()
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not found")
    # Nothing else leaks: the static CUDA runtime must not clash with torch's.
    assert _exported_symbols(cuda.CUDA_LIB_PATH) == set(cuda.SYMBOLS)


def test_error_codes_reach_python():
    lib = _built_library()
    # Sizes are checked before any device is touched, so this runs without a GPU.
    code = lib.distemb_cuda_sgd_update(None, 10, 0, None, None, 1, 0.1, 0, None)
    assert code == CUDA_INVALID_VALUE
    assert lib.distemb_cuda_sgd_update(None, -1, 4, None, None, 1, 0.1, 0,
                                       None) == CUDA_INVALID_VALUE
    assert lib.distemb_cuda_gather_rows_checked(None, 10, 0, None, 1, None, None, 0,
                                                None) == CUDA_INVALID_VALUE
    nbytes = ctypes.c_size_t(0)
    for end_bit in (0, 65):
        assert lib.distemb_cuda_dedup_workspace_bytes(10, 4, end_bit, ctypes.byref(nbytes),
                                                      0) == CUDA_INVALID_VALUE
    assert lib.distemb_cuda_dedup_workspace_bytes(10, -1, 64, ctypes.byref(nbytes),
                                                  0) == CUDA_INVALID_VALUE
    # ids outside a 1024-row table sort as the key 1024, which 10 bits cannot hold
    assert lib.distemb_cuda_dedup_sort(None, 10, 4, 1024, 10, None, 0, None, None, 0,
                                       None) == CUDA_INVALID_VALUE
    with pytest.raises(cuda.CudaKernelError, match="distemb_cuda_sgd_update.*invalid argument"):
        cuda.check_status(lib, "distemb_cuda_sgd_update", code)


def test_device_count_agrees_with_torch():
    lib = _built_library()
    count = ctypes.c_int(-1)
    code = lib.distemb_cuda_device_count(ctypes.byref(count))
    if torch.cuda.is_available():
        assert (code, count.value) == (0, torch.cuda.device_count())
    else:
        assert code != 0
        assert lib.distemb_cuda_error_string(code)


def test_missing_library_says_how_to_build(tmp_path):
    missing = str(tmp_path / "missing.so")
    with pytest.raises(cuda.CudaUnavailableError, match="not built.*nvcc.*DISTEMB_NO_CUDA=1"):
        cuda.require_cuda(missing)
    assert not cuda.cuda_available(missing)


def test_no_gpu_raises_clear_error(monkeypatch):
    _built_library()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cuda.CudaUnavailableError, match="CPU-only build|no CUDA device"):
        cuda.require_cuda()
    assert not cuda.cuda_available()


def test_driver_too_old_for_library_is_explained(monkeypatch):
    """Where torch sees a GPU the library cannot use, the library's CUDA error is named."""
    lib = _built_library()
    count = ctypes.c_int(0)
    if lib.distemb_cuda_device_count(ctypes.byref(count)) == 0:
        pytest.skip("the library can use a GPU here, so this failure cannot be provoked")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cuda.CudaUnavailableError, match="no usable GPU although torch does"):
        cuda.require_cuda()


def test_import_loads_nothing():
    code = ("import sys, distemb, distemb.kernels\n"
            "assert 'distemb.kernels.cuda' not in sys.modules\n"
            "from distemb.kernels import cuda\n"
            "assert cuda.load_library.cache_info().currsize == 0\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def _cpu_calls():
    w, rows, g = torch.zeros(4, 2), torch.tensor([0, 2]), torch.ones(2, 2)
    return {
        "dedup_sum": lambda: cuda.dedup_sum(rows, g),
        "dedup_sum_padded": lambda: cuda.dedup_sum_padded(rows, g, num_rows=4),
        "gather_rows": lambda: cuda.gather_rows(w, rows),
        "gather_rows_checked": lambda: cuda.gather_rows_checked(
            w, rows, torch.tensor(cuda.CLEAN_ID_FLAGS)),
        "sgd_update": lambda: cuda.sgd_update(w, rows, g, 0.1),
        "adagrad_update": lambda: cuda.adagrad_update(w, torch.zeros(4, 2), rows, g, 0.1, 1e-10),
        "rowwise_adagrad_update":
            lambda: cuda.rowwise_adagrad_update(w, torch.zeros(4), rows, g, 0.1, 1e-10),
        "adam_update": lambda: cuda.adam_update(w, torch.zeros(4, 2), torch.zeros(4, 2), rows,
                                                g, 0.1, 0.9, 0.999, 1e-8, 1),
    }


@pytest.mark.parametrize("name", sorted(_cpu_calls()))
def test_cpu_tensors_are_rejected(name):
    with pytest.raises(TypeError, match="expected a CUDA tensor, got device cpu"):
        _cpu_calls()[name]()


@pytest.mark.parametrize("call, error, message", [
    (lambda: cuda.dedup_sum(torch.tensor([1, 2], dtype=torch.int32), torch.ones(2, 3)),
     TypeError, "ids: expected dtype torch.int64, got torch.int32"),
    (lambda: cuda.dedup_sum(torch.tensor([1, 2]), torch.ones(3, 3)),
     ValueError, r"grads: expected shape \(2, 3\), got \(3, 3\)"),
    (lambda: cuda.dedup_sum(torch.tensor([1, 2]), torch.ones(2, 3), num_rows=0),
     ValueError, "num_rows: expected >= 1"),
    (lambda: cuda.gather_rows(torch.ones(4, 3).t(), torch.tensor([0])),
     ValueError, "table: expected a contiguous tensor"),
    (lambda: cuda.gather_rows_checked(torch.ones(4, 3), torch.tensor([0]),
                                      torch.zeros(2, dtype=torch.int64)),
     ValueError, r"flags: expected shape \(3,\), got \(2,\)"),
    (lambda: cuda.dedup_sum_padded(torch.tensor([1, 2]), torch.ones(2, 3), None),
     ValueError, "num_rows: expected the table size"),
    (lambda: cuda.dedup_sum(torch.tensor([1, 2]), torch.ones(2, 3), out=torch.ones(1, 3)),
     ValueError, r"out: expected a \(>= 2, 3\) tensor, got \(1, 3\)"),
    (lambda: cuda.sgd_update([[0.0]], torch.tensor([0]), torch.ones(1, 1), 0.1),
     TypeError, "weight: expected a torch.Tensor, got list"),
    (lambda: cuda.rowwise_adagrad_update(torch.ones(4, 2), torch.ones(4, 2), torch.tensor([0]),
                                         torch.ones(1, 2), 0.1, 1e-10),
     ValueError, r"state_sum: expected 1 dims, got shape \(4, 2\)"),
    (lambda: cuda.adam_update(*[torch.ones(4, 2)] * 3, torch.tensor([0]), torch.ones(1, 2),
                              0.1, 0.9, 0.999, 1e-8, step=0),
     ValueError, "step: expected >= 1"),
    (lambda: cuda.adam_update(*[torch.ones(4, 2)] * 3, torch.tensor([0]), torch.ones(1, 2),
                              0.1, 0.9, 0.999, 1e-8, 1, row_steps=torch.zeros(3, dtype=torch.int64)),
     ValueError, r"row_steps: expected shape \(4,\), got \(3,\)"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- with a GPU: every kernel against distemb.kernels.reference -------------------------

NUM_ROWS = 50_000
BATCH = 200_000
DIMS = (1, 7, 128)


@pytest.fixture(scope="module")
def device():
    """The CUDA device, or a skip saying why there is none."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    cuda.require_cuda()
    return torch.device("cuda", torch.cuda.current_device())


def _zipf_ids(rng, n=BATCH):
    """Duplicate-heavy ids: a few rows appear thousands of times."""
    return ((rng.zipf(1.2, size=n) - 1) % NUM_ROWS).astype(np.int64)


def _case(rng, d):
    """Unique rows of a zipf batch, their gradients and a random table."""
    rows = np.unique(_zipf_ids(rng))
    rng.shuffle(rows)  # the updates take unique rows in any order
    grads = rng.standard_normal((rows.shape[0], d)).astype(np.float32)
    table = rng.standard_normal((NUM_ROWS, d)).astype(np.float32)
    return rows, grads, table


def _gpu(a, device):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _assert_close(gpu_tensor, expected):
    np.testing.assert_allclose(gpu_tensor.cpu().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("num_rows", [None, NUM_ROWS], ids=["all_bits", "table_bits"])
def test_dedup_sum_matches_reference(device, d, num_rows):
    """The unique ids of the reference, and sums in the kernel's declared order, bit for
    bit (chunks of SUM_CHUNK rows, each left to right, then the chunks' sums left to
    right: tests/cpu_cuda_twin.py); that order is a float32 sum, within float32 rounding
    of the float64 sum (the reference adds rows one by one, another rounding order)."""
    rng = np.random.default_rng(d)
    ids = _zipf_ids(rng)
    grads = rng.standard_normal((ids.shape[0], d)).astype(np.float32)
    want_uniq, _ = reference.dedup_sum(ids, grads)
    uniq, summed = cuda.dedup_sum(_gpu(ids, device), _gpu(grads, device), num_rows=num_rows)
    np.testing.assert_array_equal(uniq.cpu().numpy(), want_uniq)
    _, declared = chunked_dedup_sum(ids, grads, num_rows=num_rows)
    np.testing.assert_array_equal(summed.cpu().numpy().view(np.int32), declared.view(np.int32))
    exact = np.zeros((want_uniq.shape[0], d))
    np.add.at(exact, np.searchsorted(want_uniq, ids), grads.astype(np.float64))
    magnitude = np.zeros_like(exact)  # sum of |rows|: float32 rounding is relative to it
    np.add.at(magnitude, np.searchsorted(want_uniq, ids), np.abs(grads.astype(np.float64)))
    count = np.bincount(np.searchsorted(want_uniq, ids))[:, None]
    bound = (count + cuda.SUM_CHUNK) * np.finfo(np.float32).eps * magnitude
    assert np.all(np.abs(summed.cpu().numpy() - exact) <= bound + 1e-30)
    # Sums run in batch order: a second run gives the same bits.
    again = cuda.dedup_sum(_gpu(ids, device), _gpu(grads, device), num_rows=num_rows)[1]
    assert torch.equal(summed, again)


@pytest.mark.gpu
def test_dedup_sum_of_empty_and_single_batches(device):
    uniq, summed = cuda.dedup_sum(torch.empty(0, dtype=torch.int64, device=device),
                                  torch.empty(0, 3, device=device))
    assert uniq.shape == (0,) and summed.shape == (0, 3)
    uniq, summed = cuda.dedup_sum(torch.tensor([7, 7, 7], device=device),
                                  torch.ones(3, 2, device=device))
    assert uniq.tolist() == [7] and summed.tolist() == [[3.0, 3.0]]
    # A one-row table sorts on a single bit.
    uniq, summed = cuda.dedup_sum(torch.zeros(4, dtype=torch.int64, device=device),
                                  torch.ones(4, 1, device=device), num_rows=1)
    assert uniq.tolist() == [0] and summed.tolist() == [[4.0]]


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
def test_gather_rows_matches_reference(device, d):
    rng = np.random.default_rng(10 + d)
    ids = _zipf_ids(rng)
    table = rng.standard_normal((NUM_ROWS, d)).astype(np.float32)
    want = reference.gather_rows(table, ids, np.empty((ids.shape[0], d), np.float32))
    got = cuda.gather_rows(_gpu(table, device), _gpu(ids, device))
    np.testing.assert_array_equal(got.cpu().numpy(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
def test_sgd_update_matches_reference(device, d):
    rows, grads, table = _case(np.random.default_rng(20 + d), d)
    weight = _gpu(table, device)
    reference.sgd_update(table, rows, grads, 0.05)
    cuda.sgd_update(weight, _gpu(rows, device), _gpu(grads, device), 0.05)
    _assert_close(weight, table)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("rowwise", [False, True], ids=["adagrad", "rowwise"])
def test_adagrad_updates_match_reference(device, d, rowwise):
    rng = np.random.default_rng(30 + d)
    rows, grads, table = _case(rng, d)
    state = np.zeros(NUM_ROWS if rowwise else (NUM_ROWS, d), np.float32)
    weight, state_gpu = _gpu(table, device), _gpu(state, device)
    ref_fn = reference.rowwise_adagrad_update if rowwise else reference.adagrad_update
    gpu_fn = cuda.rowwise_adagrad_update if rowwise else cuda.adagrad_update
    for _ in range(3):  # later steps read the state earlier steps wrote
        ref_fn(table, state, rows, grads, 0.1, 1e-10)
        gpu_fn(weight, state_gpu, _gpu(rows, device), _gpu(grads, device), 0.1, 1e-10)
    _assert_close(state_gpu, state)
    _assert_close(weight, table)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("per_row", [False, True], ids=["global_step", "row_steps"])
def test_adam_update_matches_reference(device, d, per_row):
    rng = np.random.default_rng(40 + d)
    _, _, table = _case(rng, d)
    m, v = np.zeros_like(table), np.zeros_like(table)
    steps = np.zeros(NUM_ROWS, np.int64) if per_row else None
    weight, m_gpu, v_gpu = _gpu(table, device), _gpu(m, device), _gpu(v, device)
    steps_gpu = _gpu(steps, device) if per_row else None
    for step in range(1, 4):  # different rows each step, so per-row counts diverge
        rows = np.unique(_zipf_ids(rng, 50_000))
        grads = rng.standard_normal((rows.shape[0], d)).astype(np.float32)
        reference.adam_update(table, m, v, rows, grads, 0.01, 0.9, 0.999, 1e-8, step,
                              row_steps=steps)
        cuda.adam_update(weight, m_gpu, v_gpu, _gpu(rows, device), _gpu(grads, device), 0.01,
                         0.9, 0.999, 1e-8, step, row_steps=steps_gpu)
    if per_row:
        np.testing.assert_array_equal(steps_gpu.cpu().numpy(), steps)
    _assert_close(m_gpu, m)
    _assert_close(v_gpu, v)
    _assert_close(weight, table)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("lr_power", [-0.5, 0.0, -0.3])
def test_ftrl_update_matches_the_cpu_kernel(device, d, lr_power):
    """csrc/rules.h on the GPU and on the CPU: bit for bit where the power is a sqrtf or 1
    (lr_power -0.5, 0). Otherwise CUDA's powf is within 2 ulp of the exact power (libm's
    within 1), and z subtracts (n_new^-p - n^-p) / lr * w, a difference of two near
    powers: their rounding, amplified by that cancellation, bounds z (first run on an
    H100: up to 7e-6 apart on z of 0.3, inside the bound) and through the quadratic, w."""
    rng = np.random.default_rng(60 + d)
    _, _, table = _case(rng, d)
    w0 = table.copy()
    accum, linear = np.full_like(table, 0.1), np.zeros_like(table)
    weight, n_gpu, z_gpu = _gpu(table, device), _gpu(accum, device), _gpu(linear, device)
    hyper = (0.05, lr_power, 0.05, 0.01, 0.02, 0.1)
    for _ in range(3):
        rows = np.unique(_zipf_ids(rng, 50_000))
        grads = rng.standard_normal((rows.shape[0], d)).astype(np.float32)
        with kernels.implementation("compiled" if kernels.HAS_EXT else "reference"):
            kernels.ftrl_update(table, accum, linear, rows, grads, *hyper)
        cuda.ftrl_update(weight, n_gpu, z_gpu, _gpu(rows, device), _gpu(grads, device), *hyper)
    if lr_power in (-0.5, 0.0) and kernels.HAS_EXT:
        for got, want in ((weight, table), (n_gpu, accum), (z_gpu, linear)):
            assert np.array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32))
    _assert_close(n_gpu, accum)
    lr, power = hyper[0], -lr_power
    # 3 steps x (2 + 1 ulp per power, 2 powers, the subtraction): 24 ulp of n^-p / lr * |w|
    z_bound = 24 * np.finfo(np.float32).eps * accum ** power / lr * \
        np.maximum(np.abs(w0), np.abs(table))
    quadratic = accum ** power / lr + 2 * (hyper[3] + hyper[5] / (2 * lr))
    for got, want, bound in ((z_gpu, linear, z_bound), (weight, table, z_bound / quadratic)):
        got = got.cpu().numpy()
        assert np.all(np.abs(got - want) <= 1e-5 * np.abs(want) + 1e-6 + bound), \
            f"max excess {np.max(np.abs(got - want) - 1e-5 * np.abs(want) - bound):.3g}"


@pytest.mark.gpu
def test_dedup_then_adagrad_matches_torch(device):
    """The fused pipeline equals torch.nn.Embedding(sparse=True) + torch.optim.Adagrad."""
    rng = np.random.default_rng(50)
    ids = _gpu(_zipf_ids(rng, 20_000), device)
    grads = torch.randn(ids.shape[0], 16, device=device)
    emb = torch.nn.Embedding(NUM_ROWS, 16, sparse=True).to(device)
    weight = emb.weight.detach().clone()
    state = torch.zeros_like(weight)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    emb(ids).backward(grads)
    opt.step()
    uniq, summed = cuda.dedup_sum(ids, grads)
    cuda.adagrad_update(weight, state, uniq, summed, 0.1, 1e-10)
    torch.testing.assert_close(weight, emb.weight.detach(), rtol=1e-5, atol=1e-6)
