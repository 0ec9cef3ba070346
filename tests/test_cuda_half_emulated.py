"""The CUDA kernels of half-precision rows, run on the CPU thread by thread.

tests/cuda_host/emulate_half.cpp compiles csrc/cuda/half_kernels.cuh (the checked gather
to float32 and the fused SGD, Adagrad, row-wise Adagrad and Adam updates on bfloat16 /
float16 rows, nearest-even or stochastic rounding) as plain C++ and runs every thread of
every launch in turn. Without a GPU this is the test of the kernels' indexing, maths and
rounding: rows, state and flags must equal the CPU half kernels (distemb.kernels.half,
compiled and numpy twin) bit for bit, including every float16 bit pattern on load and
float32 values of every magnitude on store (subnormals, overflow to infinity). It does
not test nvcc or the hardware: tests/test_cuda_half.py does that, on a GPU.
"""
import subprocess

import numpy as np
import pytest

from distemb.kernels import cuda, half
from test_cuda_emulated import build

OPS = {"gather": 0, "sgd": 1, "adagrad": 2, "rowwise_adagrad": 3, "adam": 4, "adam-per-row": 4,
       "ftrl": 5}
KINDS = {"bfloat16": 0, "float16": 1, "bfloat16-stochastic": 2}
LR, EPS, BETA1, BETA2, STEP, SEED = 0.05, 1e-3, 0.9, 0.99, 3, 12345


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "emulate_half")


def emulate(exe, tmp_path, op, kind, bits, ids, grads, a, b, row_steps, lr=LR, ftrl=None):
    """Run one launch of the emulated kernel; returns (bits, flags, out, a, b, row_steps).

    ``ftrl``: for op 'ftrl', (lr_power, l1, l2, l2_shrinkage, beta)."""
    num_rows, d = bits.shape
    n = ids.shape[0]
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        np.array([OPS[op], KINDS[kind], num_rows, d, n, SEED, STEP, row_steps is not None],
                 np.int64).tofile(f)
        np.array([lr, *(ftrl[:3] if ftrl else (EPS, BETA1, BETA2))], np.float64).tofile(f)
        bits.astype(np.uint16).tofile(f)
        np.array(cuda.CLEAN_ID_FLAGS, np.int64).tofile(f)
        ids.astype(np.int64).tofile(f)
        grads.astype(np.float32).tofile(f)
        a.astype(np.float32).tofile(f)
        b.astype(np.float32).tofile(f)
        (row_steps if row_steps is not None else np.zeros(num_rows, np.int64)).tofile(f)
        if ftrl:
            np.array(ftrl[3:], np.float64).tofile(f)
    subprocess.run([str(exe), str(src), str(dst)], check=True, timeout=300)
    raw = np.frombuffer(dst.read_bytes(), np.uint8)
    cells = num_rows * d
    sizes = [("bits", np.uint16, cells), ("flags", np.int64, 3), ("out", np.float32, n * d),
             ("a", np.float32, cells), ("b", np.float32, cells),
             ("row_steps", np.int64, num_rows)]
    got, at = {}, 0
    for name, dt, count in sizes:
        nbytes = np.dtype(dt).itemsize * count
        got[name] = raw[at:at + nbytes].view(dt)
        at += nbytes
    assert at == raw.shape[0]
    return got


def storage(kind):
    return "float16" if kind == "float16" else "bfloat16"


def cpu_update(op, kind, weight, ids, grads, a, b, row_steps, lr=LR):
    """The CPU half kernel of ``op`` in place on ``weight`` (a half array) and states."""
    seed = SEED if kind == "bfloat16-stochastic" else None
    if op == "sgd":
        half.seeded_sgd_update(weight, ids, grads, lr, rounding_seed=seed)
    elif op == "adagrad":
        half.seeded_adagrad_update(weight, a, ids, grads, lr, EPS, rounding_seed=seed)
    elif op == "rowwise_adagrad":
        state = np.ascontiguousarray(a.reshape(-1)[:weight.shape[0]])
        half.seeded_rowwise_adagrad_update(weight, state, ids, grads, lr, EPS,
                                           rounding_seed=seed)
        a.reshape(-1)[:weight.shape[0]] = state
    else:
        half.seeded_adam_update(weight, a, b, ids, grads, lr, BETA1, BETA2, EPS, STEP,
                                row_steps=row_steps, rounding_seed=seed)


def same_bits(x, y):
    return np.array_equal(np.ascontiguousarray(x).view(np.uint8),
                          np.ascontiguousarray(y).view(np.uint8))


@pytest.mark.parametrize("d", [1, 7, 128, 200])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("op", ["sgd", "adagrad", "rowwise_adagrad", "adam", "adam-per-row"])
def test_updates_equal_the_cpu_half_kernels(emulator, tmp_path, kernel_impl, op, kind, d):
    rng = np.random.default_rng(d)
    num_rows = 300
    weight = half.encode(rng.standard_normal((num_rows, d)).astype(np.float32) * 2,
                         storage(kind))
    ids = rng.permutation(num_rows)[:97].astype(np.int64)  # unique, in no order
    grads = rng.standard_normal((97, d)).astype(np.float32)
    a = rng.random((num_rows, d)).astype(np.float32)
    b = rng.random((num_rows, d)).astype(np.float32) if op.startswith("adam") else \
        np.zeros((num_rows, d), np.float32)
    if op.startswith("adam"):
        a = (a - 0.5).astype(np.float32)
    steps = rng.integers(0, 5, num_rows).astype(np.int64) if op == "adam-per-row" else None
    bits = weight.view(np.uint16).copy()
    got = emulate(emulator, tmp_path, op, kind, bits, ids, grads, a, b,
                  None if steps is None else steps.copy())
    cpu_update(op, kind, weight, ids, grads, a, b, steps)
    assert not same_bits(got["bits"], bits), "nothing was updated: the test would be void"
    if op == "rowwise_adagrad" and kernel_impl == "reference":
        # numpy's mean adds a row's squares pairwise, the kernels left to right: the
        # accumulators differ in the last bit, and a weight by one half ulp at most
        np.testing.assert_allclose(got["a"].reshape(-1)[:num_rows],
                                   a.reshape(-1)[:num_rows], rtol=1e-6)
        np.testing.assert_allclose(half.decode(got["bits"].reshape(num_rows, d).view(
            weight.dtype)), half.decode(weight), rtol=2 ** -7)
        return
    assert same_bits(got["bits"].reshape(num_rows, d), weight.view(np.uint16)), \
        f"{np.count_nonzero(got['bits'] != weight.view(np.uint16).reshape(-1))} weights differ"
    assert same_bits(got["a"].reshape(num_rows, d), a)
    assert same_bits(got["b"].reshape(num_rows, d), b)
    if steps is not None:
        np.testing.assert_array_equal(got["row_steps"], steps)


@pytest.mark.parametrize("lr_power", [-0.5, 0.0, -0.3])
@pytest.mark.parametrize("d", [1, 7, 200])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ftrl_equals_the_cpu_half_kernel(emulator, tmp_path, kernel_impl, kind, d, lr_power):
    """FTRL (csrc/rules.h through half_kernels.cuh) as the CPU half kernel, bit for bit;
    ``lr_power`` -0.5 and 0 take sqrtf and 1, others powf."""
    rng = np.random.default_rng(d)
    num_rows = 300
    weight = half.encode(rng.standard_normal((num_rows, d)).astype(np.float32), storage(kind))
    ids = rng.permutation(num_rows)[:97].astype(np.int64)
    grads = rng.standard_normal((97, d)).astype(np.float32)
    accum = rng.random((num_rows, d)).astype(np.float32)
    linear = rng.standard_normal((num_rows, d)).astype(np.float32)
    ftrl = (lr_power, 0.4, 0.01, 0.02, 0.1)
    bits = weight.view(np.uint16).copy()
    got = emulate(emulator, tmp_path, "ftrl", kind, bits, ids, grads, accum, linear, None,
                  ftrl=ftrl)
    seed = SEED if kind == "bfloat16-stochastic" else None
    half.seeded_ftrl_update(weight, accum, linear, ids, grads, LR, *ftrl, rounding_seed=seed)
    assert not same_bits(got["bits"], bits), "nothing was updated: the test would be void"
    if lr_power == -0.3 and kernel_impl == "reference":
        # numpy's float32 power (SIMD on some CPUs) may round differently from libm's
        # powf by an ulp; the compiled run checks the bits
        np.testing.assert_allclose(got["a"].reshape(num_rows, d), accum, rtol=1e-6)
        np.testing.assert_allclose(got["b"].reshape(num_rows, d), linear, rtol=1e-4, atol=1e-5)
        return
    assert same_bits(got["bits"].reshape(num_rows, d), weight.view(np.uint16))
    assert same_bits(got["a"].reshape(num_rows, d), accum)
    assert same_bits(got["b"].reshape(num_rows, d), linear)


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_checked_gather_decodes_every_bit_pattern_and_flags_bad_ids(emulator, tmp_path,
                                                                    kernel_impl, kind):
    d = 256
    patterns = np.arange(1 << 16, dtype=np.uint16)
    # every pattern but NaNs (whose payload bits the CPU's converters treat in their own
    # ways; the kernels keep them NaN)
    exp, mant = (0x7C00, 0x3FF) if kind == "float16" else (0x7F80, 0x7F)
    patterns = patterns[~(((patterns & exp) == exp) & ((patterns & mant) != 0))]
    cells = -(-patterns.shape[0] // d) * d
    bits = np.zeros(cells, np.uint16)
    bits[:patterns.shape[0]] = patterns
    bits = bits.reshape(-1, d)
    ids = np.concatenate([np.arange(bits.shape[0]), [-3, bits.shape[0] + 5, 1]]).astype(np.int64)
    got = emulate(emulator, tmp_path, "gather", kind, bits, ids,
                  np.zeros((ids.shape[0], d), np.float32), np.zeros(bits.size, np.float32),
                  np.zeros(bits.size, np.float32), None)
    table = bits.view(half.HALF_DTYPES[kind])
    want = np.zeros((ids.shape[0], d), np.float32)
    good = (ids >= 0) & (ids < bits.shape[0])
    want[good] = half.gather_rows(table, ids[good])
    assert same_bits(got["out"].reshape(-1, d), want)
    assert got["flags"].tolist() == [2, -3, bits.shape[0] + 5]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stores_round_every_magnitude_as_the_cpu(emulator, tmp_path, kernel_impl, kind):
    """SGD with lr 1 from zero rows stores -g exactly rounded: float32 values from 1e-9
    (float16 subnormals and underflow) to 1e6 (float16 overflow), ties included."""
    rng = np.random.default_rng(1)
    d = 64
    mags = np.exp(rng.uniform(np.log(1e-9), np.log(1e6), 64 * d)).astype(np.float32)
    ties = (np.float32(1) + np.float32(2.0 ** -11) * np.arange(64 * d)).astype(np.float32)
    vals = np.concatenate([mags * rng.choice([-1, 1], mags.shape), ties,
                           np.float32([65504, 65519.99, 65520, 2.0 ** -25, 2.0 ** -24 * 1.5,
                                       np.inf, -np.inf, 0.0, -0.0] + [1.0] * (d - 9))])
    vals = vals.astype(np.float32).reshape(-1, d)
    num_rows = vals.shape[0]
    weight = np.zeros((num_rows, d), half.HALF_DTYPES[storage(kind)])
    ids = np.arange(num_rows, dtype=np.int64)
    zeros = np.zeros((num_rows, d), np.float32)
    got = emulate(emulator, tmp_path, "sgd", kind, weight.view(np.uint16), ids, -vals, zeros,
                  zeros, None, lr=1.0)
    cpu_update("sgd", kind, weight, ids, -vals, zeros, zeros, None, lr=1.0)
    assert same_bits(got["bits"].reshape(num_rows, d), weight.view(np.uint16))
