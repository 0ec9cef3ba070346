"""Every kernel, compiled and reference, against an independent oracle.

Oracles are torch ops (``sparse_coo_tensor(...).coalesce()``, ``torch.optim`` on a dense
or sparse parameter) or straightforward numpy loops, never the reference twin alone.
The ``impl`` fixture runs each test through the public dispatch of
:mod:`distemb.kernels` with the compiled module (skipped when it is not loaded, e.g.
under DISTEMB_NO_EXT=1) and with the reference twin.
"""
import os

import numpy as np
import pytest
import torch

from distemb import kernels
from distemb.kernels import reference

DIMS = [1, 7, 128]
THREADS = [1, 2]


@pytest.fixture
def impl(kernel_impl, monkeypatch):
    """The kernel implementation behind distemb.kernels for this test (conftest's switch).

    Small test inputs would otherwise run on one thread whatever ``num_threads`` says.
    """
    monkeypatch.setattr(kernels, "MIN_FLOATS_PER_THREAD", 1)
    return kernel_impl


def make_ids(kind, n, num_rows, seed=0):
    """int64 ids: 'uniform', 'zipf' (duplicate-heavy) or 'unique'."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(0, num_rows, n)
    if kind == "zipf":
        return ((rng.zipf(1.3, n) - 1) % num_rows).astype(np.int64)
    return rng.permutation(num_rows)[:n].astype(np.int64)


def torch_coalesce(ids, grads, num_rows):
    """Oracle of dedup_sum: torch's sparse coalesce (sums duplicates)."""
    t = torch.sparse_coo_tensor(torch.from_numpy(ids)[None], torch.from_numpy(grads),
                                (num_rows, grads.shape[1]), check_invariants=True).coalesce()
    return t.indices()[0].numpy(), t.values().numpy()


def batch_order_sums(ids, grads):
    """Oracle of the determinism promise: per unique id, rows added in batch order."""
    uniq = np.unique(ids)
    out = np.zeros((len(uniq), grads.shape[1]), np.float32)
    for k, u in enumerate(uniq):
        pos = np.flatnonzero(ids == u)
        acc = grads[pos[0]].copy()
        for p in pos[1:]:
            acc += grads[p]
        out[k] = acc
    return uniq, out


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("kind", ["uniform", "zipf", "unique"])
@pytest.mark.parametrize("threads", THREADS)
def test_dedup_sum_matches_torch_coalesce(impl, dim, kind, threads):
    num_rows = 1000
    ids = make_ids(kind, 500, num_rows)
    grads = np.random.default_rng(1).standard_normal((500, dim), dtype=np.float32)
    uniq, summed = kernels.dedup_sum(ids, grads, num_threads=threads)
    t_ids, t_vals = torch_coalesce(ids, grads, num_rows)
    np.testing.assert_array_equal(uniq, t_ids)
    np.testing.assert_allclose(summed, t_vals, rtol=1e-5, atol=1e-5)
    o_ids, o_vals = batch_order_sums(ids, grads)
    np.testing.assert_array_equal(summed, o_vals)  # bitwise: deterministic batch order


@pytest.mark.parametrize("threads", THREADS)
def test_dedup_sum_into_buffer_and_int32_ids(impl, threads):
    ids = np.array([5, 2, 5, 9, 2, 5], dtype=np.int32)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    buf = np.full((8, 2), np.nan, np.float32)
    uniq, summed = kernels.dedup_sum(ids, grads, out=buf, num_threads=threads)
    assert uniq.dtype == np.int64
    np.testing.assert_array_equal(uniq, [2, 5, 9])
    np.testing.assert_array_equal(summed, [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]])
    assert np.shares_memory(summed, buf)


def test_dedup_sum_ids_spanning_int64(impl):
    # ids too far apart for the packed radix keys: the comparison-sort fallback
    ids = np.array([2**62, -2**62, 7, 2**62, -2**62, -1], dtype=np.int64)
    grads = np.arange(6, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    uniq, summed = kernels.dedup_sum(ids, grads)
    o_ids, o_vals = batch_order_sums(ids, grads)
    np.testing.assert_array_equal(uniq, o_ids)
    np.testing.assert_array_equal(summed, o_vals)


@pytest.mark.parametrize("dim", DIMS)
def test_dedup_sum_empty(impl, dim):
    uniq, summed = kernels.dedup_sum(np.empty(0, np.int64), np.empty((0, dim), np.float32))
    assert uniq.shape == (0,) and summed.shape == (0, dim)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_gather_rows_matches_fancy_indexing(impl, dim, threads):
    table = np.random.default_rng(2).standard_normal((300, dim), dtype=np.float32)
    rows = make_ids("zipf", 200, 300)
    np.testing.assert_array_equal(kernels.gather_rows(table, rows, num_threads=threads),
                                  table[rows])
    out = np.empty((200, dim), np.float32)
    assert kernels.gather_rows(table, rows, out, threads) is out
    np.testing.assert_array_equal(out, table[rows])
    assert kernels.gather_rows(table, rows[:0], num_threads=threads).shape == (0, dim)


def _coalesced(dim, num_rows=400, n=600, seed=3):
    ids = make_ids("zipf", n, num_rows, seed)
    grads = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    return torch_coalesce(ids, grads, num_rows)


def _dense_grad(rows, grads, num_rows):
    g = torch.zeros(num_rows, grads.shape[1])
    g[torch.from_numpy(rows)] = torch.from_numpy(grads)
    return g


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_sgd_matches_torch_sgd(impl, dim, threads):
    num_rows = 400
    w0 = np.random.default_rng(4).standard_normal((num_rows, dim), dtype=np.float32)
    w, p = w0.copy(), torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], lr=0.3)
    for seed in range(3):
        rows, grads = _coalesced(dim, num_rows, seed=seed)
        kernels.sgd_update(w, rows, grads, 0.3, threads)
        p.grad = _dense_grad(rows, grads, num_rows)
        opt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_adagrad_matches_torch_adagrad(impl, dim, threads):
    num_rows, lr, eps, init = 400, 0.1, 1e-10, 0.05
    w0 = np.random.default_rng(5).standard_normal((num_rows, dim), dtype=np.float32)
    w, s = w0.copy(), np.full((num_rows, dim), init, np.float32)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.Adagrad([p], lr=lr, eps=eps, initial_accumulator_value=init)
    for seed in range(3):
        rows, grads = _coalesced(dim, num_rows, seed=seed)
        kernels.adagrad_update(w, s, rows, grads, lr, eps, threads)
        p.grad = _dense_grad(rows, grads, num_rows)
        opt.step()
    np.testing.assert_allclose(s, opt.state[p]["sum"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_rowwise_adagrad_matches_numpy_formula(impl, dim, threads):
    num_rows, clr, eps = 400, 0.1, 1e-6
    w = np.random.default_rng(6).standard_normal((num_rows, dim), dtype=np.float32)
    s = np.full(num_rows, 0.01, np.float32)
    w_o, s_o = w.astype(np.float64), s.astype(np.float64)
    for seed in range(3):
        rows, grads = _coalesced(dim, num_rows, seed=seed)
        kernels.rowwise_adagrad_update(w, s, rows, grads, clr, eps, threads)
        for r, g in zip(rows, grads.astype(np.float64)):  # the formula, row by row
            s_o[r] += (g * g).sum() / dim
            w_o[r] -= clr * g / (np.sqrt(s_o[r]) + eps)
    np.testing.assert_allclose(s, s_o, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w, w_o, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_adam_matches_torch_sparse_adam(impl, dim, threads):
    num_rows, lr, betas, eps = 400, 0.05, (0.9, 0.99), 1e-8
    w0 = np.random.default_rng(7).standard_normal((num_rows, dim), dtype=np.float32)
    w = w0.copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SparseAdam([p], lr=lr, betas=betas, eps=eps)
    for step in range(1, 4):
        rows, grads = _coalesced(dim, num_rows, seed=step)
        kernels.adam_update(w, m, v, rows, grads, lr, betas[0], betas[1], eps, step,
                            num_threads=threads)
        p.grad = torch.sparse_coo_tensor(torch.from_numpy(rows)[None],
                                         torch.from_numpy(grads), p.shape,
                                         check_invariants=True)
        opt.step()
    np.testing.assert_allclose(m, opt.state[p]["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, opt.state[p]["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("threads", THREADS)
def test_adam_per_row_steps_matches_numpy_formula(impl, dim, threads):
    num_rows, lr, b1, b2, eps = 50, 0.05, 0.9, 0.99, 1e-8
    w = np.random.default_rng(8).standard_normal((num_rows, dim), dtype=np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    counts = np.zeros(num_rows, np.int64)
    w_o, m_o, v_o = w.astype(np.float64), np.zeros((num_rows, dim)), np.zeros((num_rows, dim))
    n_o = np.zeros(num_rows)
    for seed in range(4):
        rows, grads = _coalesced(dim, num_rows, n=40, seed=seed)
        kernels.adam_update(w, m, v, rows, grads, lr, b1, b2, eps, 999,
                            row_steps=counts, num_threads=threads)
        for r, g in zip(rows, grads.astype(np.float64)):
            n_o[r] += 1
            m_o[r] = b1 * m_o[r] + (1 - b1) * g
            v_o[r] = b2 * v_o[r] + (1 - b2) * g * g
            size = lr * np.sqrt(1 - b2 ** n_o[r]) / (1 - b1 ** n_o[r])
            w_o[r] -= size * m_o[r] / (np.sqrt(v_o[r]) + eps)
    np.testing.assert_array_equal(counts, n_o)
    np.testing.assert_allclose(m, m_o, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(w, w_o, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", THREADS)
def test_updates_with_no_rows_change_nothing(impl, threads):
    w = np.ones((5, 3), np.float32)
    s, m = np.ones((5, 3), np.float32), np.ones((5, 3), np.float32)
    rows, grads = np.empty(0, np.int64), np.empty((0, 3), np.float32)
    kernels.sgd_update(w, rows, grads, 0.1, threads)
    kernels.adagrad_update(w, s, rows, grads, 0.1, 1e-10, threads)
    kernels.rowwise_adagrad_update(w, s[:, 0].copy(), rows, grads, 0.1, 1e-10, threads)
    kernels.adam_update(w, s, m, rows, grads, 0.1, 0.9, 0.99, 1e-8, 1, num_threads=threads)
    assert (w == 1).all() and (s == 1).all() and (m == 1).all()


def test_dispatch_rejects_bad_input(impl):
    w = np.zeros((4, 3), np.float32)
    s = np.zeros((4, 3), np.float32)
    rows, g = np.array([0, 2]), np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="ids"):
        kernels.dedup_sum(np.array([0.0, 1.0]), g)
    with pytest.raises(TypeError, match="grads"):
        kernels.dedup_sum(rows, g.astype(np.float64))
    with pytest.raises(ValueError, match="grads"):
        kernels.dedup_sum(rows, np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="out"):
        kernels.dedup_sum(rows, g, out=np.empty((1, 3), np.float32))
    with pytest.raises(TypeError, match="table"):
        kernels.gather_rows(w.astype(np.float64), rows)
    with pytest.raises(ValueError, match="out"):
        kernels.gather_rows(w, rows, np.empty((3, 3), np.float32))
    with pytest.raises(TypeError, match="weight"):
        kernels.sgd_update(w[:, :2], rows, g, 0.1)  # not C-contiguous
    with pytest.raises(ValueError, match="grads"):
        kernels.sgd_update(w, rows, np.ones((2, 2), np.float32), 0.1)
    with pytest.raises(ValueError, match="rows"):
        kernels.sgd_update(w, rows[None], g, 0.1)
    with pytest.raises(ValueError, match="state_sum"):
        kernels.adagrad_update(w, s[:3], rows, g, 0.1, 1e-10)
    with pytest.raises(TypeError, match="state_sum"):
        kernels.rowwise_adagrad_update(w, s, rows, g, 0.1, 1e-10)
    with pytest.raises(ValueError, match="num_threads"):
        kernels.gather_rows(w, rows, num_threads=0)
    with pytest.raises(TypeError, match="row_steps"):
        kernels.adam_update(w, s, s.copy(), rows, g, 0.1, 0.9, 0.99, 1e-8, 1,
                            row_steps=np.zeros(4, np.int32))


def test_compiled_kernels_loaded():
    if os.environ.get("DISTEMB_NO_EXT", "") not in ("", "0"):
        pytest.skip("DISTEMB_NO_EXT forces the reference twins")
    assert kernels.HAS_EXT, "distemb._kernels did not import: build it (setup.py build_ext)"
    assert kernels.IMPL_NAME == "compiled"


def test_small_work_runs_on_one_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "gather_rows",
                        lambda t, r, o, num_threads: calls.append(num_threads))
    table = np.zeros((10, 4), np.float32)
    with kernels.implementation("reference"):
        kernels.gather_rows(table, np.arange(3), num_threads=8)
        big = np.zeros((4 * kernels.MIN_FLOATS_PER_THREAD, 1), np.float32)
        kernels.gather_rows(big, np.arange(big.shape[0]), num_threads=8)
    assert calls == [1, 4]


def test_implementation_switch_restores_and_rejects_bad_names():
    before = kernels.active()
    with kernels.implementation("reference"):
        assert kernels.active() == "reference"
    assert kernels.active() == before
    with pytest.raises(ValueError, match="name: expected 'compiled' or 'reference', got 'fast'"):
        with kernels.implementation("fast"):
            pass
    if not kernels.HAS_EXT:
        with pytest.raises(RuntimeError, match="compiled kernels are not loaded"):
            with kernels.implementation("compiled"):
                pass
