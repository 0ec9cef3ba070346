"""FTRL-Proximal (SparseFtrl, the ftrl kernels) against tf.keras.optimizers.Ftrl's formula.

Oracles:
- a float64 numpy implementation of Keras' update (keras/src/optimizers/ftrl.py,
  ``update_step``), written here from that formula, run on the same 60 steps of
  duplicate-heavy zipf ids as SparseFtrl on a DistEmbedding. Duplicates of an id in one
  step are summed first (torch's sparse-gradient semantics; Keras sums duplicate indices
  of a sparse gradient too), then each touched row gets one update;
- the numbers TensorFlow's own tests publish for Keras' Ftrl
  (tensorflow/python/keras/optimizer_v2/ftrl_test.py: 10 steps on two small variables),
  written out below, through the kernels on both implementations.
The half kernels must equal "decode, float32 kernel, encode" bit for bit, as for every
rule (tests/test_half_kernels.py).
"""
import numpy as np
import pytest
import torch

from distemb import DistEmbedding, SparseFtrl, kernels
from distemb.kernels import half
from tests.conftest import zipf_ids

STEPS, ROWS, BATCH = 60, 300, 256


def keras_ftrl(w, n, z, g, lr, lr_power=-0.5, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0):
    """One step of Keras' Ftrl.update_step in float64: returns the new (w, n, z)."""
    l2_reg = l2 + beta / (2.0 * lr)
    grad_to_use = g + 2.0 * l2_shrinkage * w
    new_n = n + g * g
    z = z + grad_to_use - (new_n ** -lr_power - n ** -lr_power) / lr * w
    quadratic = new_n ** -lr_power / lr + 2.0 * l2_reg
    w = (np.clip(z, -l1, l1) - z) / quadratic
    return w, new_n, z


CASES = {
    "defaults": dict(lr=0.1),
    "l1-l2-shrinkage-beta": dict(lr=0.05, l1=0.5, l2=0.02, l2_shrinkage=0.03, beta=0.5),
    "power-0.3": dict(lr=0.05, lr_power=-0.3, l1=0.5),
    "fixed-rate": dict(lr=0.02, lr_power=0.0, l2=0.1),
    "zero-accumulator": dict(lr=0.1, initial_accumulator_value=0.0, l1=0.5),
}


def _optimizer(emb, case):
    kw = dict(CASES[case])
    names = {"lr_power": "learning_rate_power", "l1": "l1_regularization_strength",
             "l2": "l2_regularization_strength",
             "l2_shrinkage": "l2_shrinkage_regularization_strength"}
    return SparseFtrl([emb], **{names.get(k, k): v for k, v in kw.items()})


@pytest.mark.parametrize("dim", [1, 7, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_ftrl_matches_keras_formula_in_float64(ctx, model_impl, case, dim):
    hyper = dict(CASES[case])
    init = hyper.pop("initial_accumulator_value", 0.1)
    rng = np.random.default_rng(dim)
    gen = torch.Generator().manual_seed(dim)
    w0 = torch.randn(ROWS, dim, generator=gen)
    emb = DistEmbedding(ROWS, dim, name=f"ftrl-{case}-{dim}", context=ctx)
    emb.weight[torch.arange(ROWS)] = w0
    opt = _optimizer(emb, case)
    w, n, z = w0.double().numpy().copy(), np.full((ROWS, dim), init), np.zeros((ROWS, dim))
    dup_steps = 0
    for _ in range(STEPS):
        ids = zipf_ids(rng, ROWS, BATCH)
        upstream = torch.randn(BATCH, dim, generator=gen)
        half_batch = BATCH // 2
        a = emb(torch.from_numpy(ids[:half_batch]))
        b = emb(torch.from_numpy(ids[half_batch:]).int())
        ((a * upstream[:half_batch]).sum() + (b * upstream[half_batch:]).sum()).backward()
        opt.step()
        uniq, inverse = np.unique(ids, return_inverse=True)
        dup_steps += uniq.shape[0] < ids.shape[0]
        g = np.zeros((uniq.shape[0], dim))
        np.add.at(g, inverse, upstream.double().numpy())  # duplicates summed
        w[uniq], n[uniq], z[uniq] = keras_ftrl(w[uniq], n[uniq], z[uniq], g, **hyper)
    ours = emb.weight[torch.arange(ROWS)].double().numpy()
    assert dup_steps == STEPS, "every step must repeat ids: the test would not cover sums"
    assert np.abs(w - w0.double().numpy()).max() > 1e-2, "the oracle did not move"
    if hyper.get("l1", 0) > 0:
        assert (w == 0).sum() > 0, "l1 zeroed nothing: the clip is not exercised"
    # float32 against float64 over 60 steps: the largest miss seen is 1/3 of this bound
    np.testing.assert_allclose(ours, w, rtol=2e-5, atol=2e-6 * np.abs(w).max())


# TensorFlow's published results for Keras' Ftrl: lr 3.0, initial accumulator 0.1,
# var0 = [1, 2] with gradient [0.1, 0.2] and var1 = [4, 3] with gradient [0.01, 0.02],
# every step, 10 steps (tensorflow/python/keras/optimizer_v2/ftrl_test.py).
PUBLISHED = {
    "testFtrlWithL1": (dict(l1=0.001, l2=0.0),
                       [[-7.66718769, -10.91273689], [-0.93460727, -1.86147261]]),
    "testFtrlWithL1_L2": (dict(l1=0.001, l2=2.0),
                          [[-0.24059935, -0.46829352], [-0.02406147, -0.04830509]]),
    "testFtrlWithL1_L2_L2Shrinkage": (
        dict(l1=0.001, l2=2.0, l2_shrinkage=0.1),
        [[-0.22578995, -0.44345796], [-0.14378493, -0.13229476]]),
    "testFtrlWithL2_Beta": (dict(l1=0.0, l2=0.1, beta=0.1),
                            [[-2.735487, -4.704625], [-0.294335, -0.586556]]),
}


def _published_run(update, **hyper):
    w = np.array([[1.0, 2.0], [4.0, 3.0]], np.float32)
    n = np.full((2, 2), 0.1, np.float32)
    z = np.zeros((2, 2), np.float32)
    g = np.array([[0.1, 0.2], [0.01, 0.02]], np.float32)
    full = dict(lr=3.0, lr_power=-0.5, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0)
    full.update(hyper)
    for _ in range(10):
        w = update(w, n, z, np.array([0, 1]), g, **full)
    return w


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_kernels_reproduce_tensorflows_published_ftrl_results(kernel_impl, name):
    hyper, want = PUBLISHED[name]

    def f32(w, n, z, rows, g, **h):
        kernels.ftrl_update(w, n, z, rows, g, **h)
        return w

    np.testing.assert_allclose(_published_run(f32, **hyper), want, rtol=1e-5)
    # the float64 oracle of the test above says the same (so it is Keras' formula)
    def f64(w, n, z, rows, g, **h):
        w2, n[...], z[...] = keras_ftrl(w.astype(np.float64), n.astype(np.float64),
                                        z.astype(np.float64), g.astype(np.float64), **h)
        return w2
    np.testing.assert_allclose(_published_run(f64, **hyper), want, rtol=1e-5)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
@pytest.mark.parametrize("lr_power", [-0.5, 0.0, -0.3])
def test_half_ftrl_equals_decode_fp32_kernel_encode(kernel_impl, name, lr_power):
    rng = np.random.default_rng(3)
    w = half.encode(rng.standard_normal((200, 33)).astype(np.float32), name)
    rows = rng.choice(200, 80, replace=False).astype(np.int64)
    g = rng.standard_normal((80, 33)).astype(np.float32)
    n0 = rng.random(w.shape, np.float32)
    z0 = rng.standard_normal(w.shape).astype(np.float32)
    hyper = dict(lr=0.05, lr_power=lr_power, l1=0.3, l2=0.01, l2_shrinkage=0.02, beta=0.1)
    got, n1, z1 = w.copy(), n0.copy(), z0.copy()
    half.ftrl_update(got, n1, z1, rows, g, **hyper, num_threads=2)
    w32, n2, z2 = half.decode(w), n0.copy(), z0.copy()
    kernels.ftrl_update(w32, n2, z2, rows, g, **hyper)
    np.testing.assert_array_equal(got.view(np.uint16), half.encode(w32, name).view(np.uint16))
    np.testing.assert_array_equal(n1, n2)
    np.testing.assert_array_equal(z1, z2)
    assert (half.decode(got)[rows] == 0).any(), "l1 zeroed nothing"


def test_bad_hyperparameters_are_refused():
    emb = DistEmbedding(4, 2, name="ftrl-bad")
    with pytest.raises(ValueError, match="learning_rate_power: expected a number <= 0"):
        SparseFtrl([emb], lr=0.1, learning_rate_power=0.5)
    with pytest.raises(ValueError, match="lr: expected a number > 0"):
        SparseFtrl([emb], lr=0.0)
    with pytest.raises(ValueError, match="l1_regularization_strength: expected a number >= 0"):
        SparseFtrl([emb], lr=0.1, l1_regularization_strength=-1.0)
    w = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="lr: expected a positive learning rate"):
        kernels.ftrl_update(w, w.copy(), w.copy(), np.array([0]), np.ones((1, 2), np.float32),
                            0.0, -0.5, 0.0, 0.0, 0.0, 0.0)
