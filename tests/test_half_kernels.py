"""Half-precision row kernels, compiled and twin, against torch's rounding and the fp32 kernels.

Oracles: torch's float32 -> bfloat16/float16 conversions (round to nearest-even) for
encode/decode; for every update kernel, "decode the rows, run distemb's float32 kernel
(itself tested against torch.optim), encode": the half kernel must equal it bit for bit.
"""
import numpy as np
import pytest
import torch

from distemb import kernels
from distemb.kernels import half, reference_half

HALF = ["bfloat16", "float16"]
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture
def impl(kernel_impl, monkeypatch):
    """Both implementations (tests/conftest.py's kernel_impl), threads even on small inputs."""
    monkeypatch.setattr(kernels, "MIN_FLOATS_PER_THREAD", 1)
    return kernel_impl


def torch_bits(values, name):
    return torch.from_numpy(values).to(TORCH[name]).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("name", HALF)
def test_encode_rounds_to_nearest_even_as_torch(impl, name):
    rng = np.random.default_rng(0)
    vals = np.concatenate([
        rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-6, 5, 5000),
        np.array([0.0, -0.0, np.inf, -np.inf, 1e-8, 65504.0, 65520.0, 1e38, 3.4e38],
                 np.float32),
        # exact ties of both formats: round to even
        (1 + np.arange(8, dtype=np.float32) / 256 + 1 / 512).astype(np.float32),
        (1 + np.arange(8, dtype=np.float32) / 1024 + 1 / 2048).astype(np.float32),
    ])
    got = half.encode(vals, name)
    np.testing.assert_array_equal(got.view(np.uint16), torch_bits(vals, name))
    back = torch.from_numpy(vals).to(TORCH[name]).float().numpy()
    np.testing.assert_array_equal(half.decode(got), back)
    nan = half.decode(half.encode(np.array([np.nan], np.float32), name))
    assert np.isnan(nan).all()


def _case(name, rows_n=200, dim=33, n=80, seed=0):
    rng = np.random.default_rng(seed)
    w = half.encode(rng.standard_normal((rows_n, dim)).astype(np.float32), name)
    rows = rng.choice(rows_n, n, replace=False).astype(np.int64)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    return rng, w, rows, grads


def _via_fp32(name, w, update):
    """The oracle: decode, the float32 kernel on the decoded table, encode."""
    w32 = half.decode(w)
    update(w32)
    return half.encode(w32, name)


@pytest.mark.parametrize("name", HALF)
@pytest.mark.parametrize("threads", [1, 2])
def test_update_kernels_equal_decode_fp32_kernel_encode(impl, name, threads):
    rng, w, rows, g = _case(name)
    s = rng.random(w.shape, dtype=np.float32)
    s1 = rng.random(w.shape[0], dtype=np.float32)
    m, v = rng.standard_normal(w.shape).astype(np.float32), rng.random(w.shape, np.float32)
    steps = rng.integers(0, 5, w.shape[0]).astype(np.int64)
    cases = [
        (lambda W: half.sgd_update(W, rows, g, 0.1, threads),
         lambda W: kernels.sgd_update(W, rows, g, 0.1)),
        (lambda W, S=s.copy(): half.adagrad_update(W, S, rows, g, 0.05, 1e-10, threads),
         lambda W, S=s.copy(): kernels.adagrad_update(W, S, rows, g, 0.05, 1e-10)),
        (lambda W, S=s1.copy(): half.rowwise_adagrad_update(W, S, rows, g, 0.05, 1e-3, threads),
         lambda W, S=s1.copy(): kernels.rowwise_adagrad_update(W, S, rows, g, 0.05, 1e-3)),
        (lambda W, M=m.copy(), V=v.copy(): half.adam_update(W, M, V, rows, g, 0.01, 0.9,
                                                            0.999, 1e-8, 7, None, threads),
         lambda W, M=m.copy(), V=v.copy(): kernels.adam_update(W, M, V, rows, g, 0.01, 0.9,
                                                               0.999, 1e-8, 7)),
        (lambda W, M=m.copy(), V=v.copy(), R=steps.copy(): half.adam_update(
            W, M, V, rows, g, 0.01, 0.9, 0.999, 1e-8, 0, R, threads),
         lambda W, M=m.copy(), V=v.copy(), R=steps.copy(): kernels.adam_update(
            W, M, V, rows, g, 0.01, 0.9, 0.999, 1e-8, 0, row_steps=R)),
    ]
    for ours, fp32 in cases:
        got = w.copy()
        ours(got)
        want = _via_fp32(name, w, fp32)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        untouched = np.setdiff1d(np.arange(w.shape[0]), rows)
        np.testing.assert_array_equal(got[untouched].view(np.uint16),
                                      w[untouched].view(np.uint16))


@pytest.mark.parametrize("name", HALF)
def test_gather_returns_float32_rows(impl, name):
    _, w, rows, _ = _case(name)
    np.testing.assert_array_equal(half.gather_rows(w, rows), half.decode(w)[rows])


def test_bad_input():
    with pytest.raises(TypeError, match="weight: expected a C-contiguous bfloat16"):
        half.sgd_update(np.zeros((2, 2), np.float32), np.array([0]),
                        np.zeros((1, 2), np.float32), 0.1)
    with pytest.raises(ValueError, match="name: expected one of"):
        half.encode(np.zeros(2, np.float32), "float8")
    w = half.encode(np.zeros((2, 2), np.float32), "bfloat16")
    with pytest.raises(TypeError, match="grads: expected a C-contiguous float32"):
        half.sgd_update(w, np.array([0]), np.zeros((1, 3), np.float32), 0.1)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(impl):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    lo = half.decode(half.encode(x, "bfloat16"))  # a representable start...
    target = lo + np.float32(0.3) * np.abs(lo) * 2 ** -8  # ...moved by ~0.3..0.6 ulp
    grads = (lo - target).astype(np.float32)  # sgd with lr=1: w - g = target
    outs = []
    for seed in range(400):
        w = half.encode(lo, "bfloat16")
        half.seeded_sgd_update(w, np.array([0]), grads, 1.0, rounding_seed=seed)
        outs.append(half.decode(w))
    outs = np.concatenate(outs)
    ok = (outs == lo) | (outs > target)  # the neighbour below (lo) or the one above
    assert ok.all()
    ulp = np.abs(lo) * 2 ** -7
    assert np.abs(outs.mean(0) - target).max() < 0.1 * ulp.max()
    assert (outs == lo).any() and (outs != lo).any()
    with pytest.raises(ValueError, match="rounding_seed: stochastic rounding is for bfloat16"):
        half.seeded_sgd_update(half.encode(x, "float16"), np.array([0]), grads, 1.0,
                               rounding_seed=1)


def test_stochastic_rounding_twins_agree():
    if not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT set or not built)")
    rng, w, rows, g = _case("bfloat16")
    s = rng.random(w.shape[0], dtype=np.float32)
    results = []
    for impl_mod in (half._IMPLS["compiled"], reference_half):
        W, S = w.copy(), s.copy()
        impl_mod.rowwise_adagrad_update(reference_half.BF16_SR, W.view(np.uint16), S, rows, g,
                                        0.05, 1e-3, seed=2 ** 63 + 5)
        results.append(W.view(np.uint16))
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], w.view(np.uint16))
