"""distemb.skipgram_loss against its oracle: the plain torch expression under autograd.

The oracle gathers the rows with indexing and computes word2vec's negative-sampling loss
with torch ops in float64; autograd's gradients on the row tensors are the sums per row
the fused pass must produce. Both kernel twins run (kernel_impl), with duplicate-heavy
indices (a row used as positive, negative and twice in one pair's negatives).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import distemb
from distemb.kernels.skipgram import sgns_loss_grad


def oracle(node_rows, context_rows, centers, positives, negatives):
    """The loss and its gradients by autograd, in float64."""
    u_all = node_rows.detach().double().requires_grad_()
    c_all = context_rows.detach().double().requires_grad_()
    u, v, n = u_all[centers], c_all[positives], c_all[negatives]
    loss = -(F.logsigmoid((u * v).sum(-1))
             + F.logsigmoid(-(n * u.unsqueeze(1)).sum(-1)).sum(-1)).mean()
    loss.backward()
    return loss.detach(), u_all.grad, c_all.grad


def batch(seed, b=300, k=5, d=37, un=40, uc=25, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    node = torch.randn(un, d, generator=gen) * scale
    ctx = torch.randn(uc, d, generator=gen) * scale
    centers = torch.randint(un, (b,), generator=gen)
    positives = torch.randint(uc, (b,), generator=gen)
    negatives = torch.randint(uc, (b, k), generator=gen)
    negatives[0, :2] = positives[0]  # one row as positive and twice as a negative
    return node, ctx, centers, positives, negatives


@pytest.mark.parametrize("seed,scale", [(0, 0.5), (1, 0.05), (2, 4.0)])
def test_skipgram_loss_matches_autograd(kernel_impl, seed, scale):
    node, ctx, centers, positives, negatives = batch(seed, scale=scale)
    want_loss, want_node, want_ctx = oracle(node, ctx, centers, positives, negatives)
    u = node.clone().requires_grad_()
    c = ctx.clone().requires_grad_()
    loss = distemb.skipgram_loss(u, c, centers, positives, negatives)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u.grad.double(), want_node, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(c.grad.double(), want_ctx, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_each_cpu_build_matches_autograd(isa):
    """The compiled pass's two builds, picked by kernels.cpu_isa as every kernel's
    (under 'avx512' the pass runs its AVX2 + FMA build)."""
    from distemb import kernels
    if isa not in kernels.available_cpu_isas():
        pytest.skip(f"no {isa} build here (compiled kernels loaded: {kernels.HAS_EXT}, "
                    f"builds: {kernels.available_cpu_isas()})")
    node, ctx, centers, positives, negatives = batch(7, d=133)  # a tail past 8 floats
    want_loss, want_node, want_ctx = oracle(node, ctx, centers, positives, negatives)
    with kernels.implementation("compiled"), kernels.cpu_isa(isa):
        loss, g_node, g_ctx = sgns_loss_grad(node.numpy(), ctx.numpy(), centers.numpy(),
                                             positives.numpy(), negatives.numpy())
    assert loss == pytest.approx(float(want_loss), rel=1e-5)
    np.testing.assert_allclose(g_node, want_node.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_ctx, want_ctx.numpy(), rtol=1e-4, atol=1e-6)


def test_skipgram_loss_scales_by_upstream_gradient(kernel_impl):
    node, ctx, centers, positives, negatives = batch(3)
    _, want_node, want_ctx = oracle(node, ctx, centers, positives, negatives)
    u = node.clone().requires_grad_()
    c = ctx.clone().requires_grad_()
    (3.0 * distemb.skipgram_loss(u, c, centers, positives, negatives)).backward()
    torch.testing.assert_close(u.grad.double(), 3 * want_node, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(c.grad.double(), 3 * want_ctx, rtol=1e-4, atol=1e-6)


def test_rows_no_pair_touches_get_zero_gradients(kernel_impl):
    """Rows that no pair uses get exactly zero (the compiled pass writes each row on its
    first touch instead of zeroing the buffers first, and must zero the rest)."""
    node, ctx, centers, positives, negatives = batch(6, b=7, k=2, un=300, uc=200)
    # Memory that held non-zero floats is likely to come back for the next buffers.
    for _ in range(3):
        np.full((300 + 200, 37), 7.0, np.float32)
    _, want_node, want_ctx = oracle(node, ctx, centers, positives, negatives)
    loss, g_node, g_ctx = sgns_loss_grad(node.numpy(), ctx.numpy(), centers.numpy(),
                                         positives.numpy(), negatives.numpy())
    unused_node = np.setdiff1d(np.arange(300), centers.numpy())
    unused_ctx = np.setdiff1d(np.arange(200), np.concatenate([positives.numpy(),
                                                              negatives.numpy().ravel()]))
    assert len(unused_node) > 250 and len(unused_ctx) > 150
    assert not g_node[unused_node].any() and not g_ctx[unused_ctx].any()
    np.testing.assert_allclose(g_node, want_node.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_ctx, want_ctx.numpy(), rtol=1e-4, atol=1e-6)


def test_twins_agree_closely():
    from distemb import kernels
    if not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded: only the reference twin exists here")
    node, ctx, centers, positives, negatives = (t.numpy() for t in batch(4, d=128))
    with kernels.implementation("compiled"):
        got = sgns_loss_grad(node, ctx, centers, positives, negatives)
    with kernels.implementation("reference"):
        ref = sgns_loss_grad(node, ctx, centers, positives, negatives)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-4, atol=1e-7)


def test_trains_distemb_tables_as_the_plain_loss_does(model_impl):
    """Unique-id lookups + the fused loss give the tables the plain loss gives them."""
    gen = torch.Generator().manual_seed(5)
    centers = torch.randint(30, (200,), generator=gen)
    contexts = torch.randint(30, (200,), generator=gen)
    negatives = torch.randint(30, (200, 4), generator=gen)
    init = torch.randn(30, 8, generator=gen) * 0.3
    tables = []
    for fused in (False, True):
        node = distemb.DistEmbedding(30, 8, name=f"sg-node-{fused}-{model_impl}",
                                     init_func=lambda s, d: init.clone().to(d))
        ctx = distemb.DistEmbedding(30, 8, name=f"sg-ctx-{fused}-{model_impl}",
                                    init_func=lambda s, d: (init.flip(0) * 0.5).to(d))
        opt = distemb.SparseAdam([node, ctx], lr=0.05)
        for _ in range(5):
            opt.zero_grad()
            if fused:
                u_ids, u_idx = torch.unique(centers, return_inverse=True)
                c_ids, c_idx = torch.unique(torch.cat([contexts, negatives.reshape(-1)]),
                                            return_inverse=True)
                loss = distemb.skipgram_loss(node(u_ids), ctx(c_ids), u_idx, c_idx[:200],
                                             c_idx[200:].view(200, 4))
            else:
                u = node(centers)
                both = ctx(torch.cat([contexts, negatives.reshape(-1)]))
                v, n = both[:200], both[200:].view(200, 4, -1)
                loss = -(F.logsigmoid((u * v).sum(-1))
                         + F.logsigmoid(-(n * u.unsqueeze(1)).sum(-1)).sum(-1)).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():
            tables.append((node(torch.arange(30)), ctx(torch.arange(30))))
    torch.testing.assert_close(tables[1][0], tables[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tables[1][1], tables[0][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad,message", [
    (dict(centers=torch.tensor([0, 40])), "centers: expected indices into the 40 rows"),
    (dict(negatives=torch.zeros(2, dtype=torch.int64)), "negatives: expected a 2-d"),
    (dict(positives=torch.tensor([0])), "expected 2 rows"),
    (dict(node_rows=torch.zeros(40, 3)), "context_rows: expected width 3"),
    (dict(node_rows=torch.zeros(40, 4, dtype=torch.float64)), "node_rows: expected a float32"),
])
def test_bad_input_names_argument(bad, message):
    args = dict(node_rows=torch.zeros(40, 4), context_rows=torch.zeros(25, 4),
                centers=torch.tensor([0, 1]), positives=torch.tensor([0, 1]),
                negatives=torch.tensor([[2], [3]]))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=message):
        distemb.skipgram_loss(**args)
