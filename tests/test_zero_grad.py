"""zero_grad() wherever it sits in the loop, against torch.optim on nn.Embedding(sparse=True).

Three loop orders, each run through distemb and through the torch oracle with the same
initial rows, the same duplicate-heavy ids and the same loss, for many steps:

- canonical torch: ``out = emb(x); loss = f(out); opt.zero_grad(); loss.backward(); opt.step()``
- zero-grad first: ``opt.zero_grad(); out = emb(x); loss.backward(); opt.step()``
- DGL's examples (train_dist_transductive.py): forward, ``emb_opt.zero_grad()``,
  ``dense_opt.zero_grad()``, backward, ``emb_opt.step()``, ``dense_opt.step()``

The tables must be equal after every order (the bug: zero_grad() between forward and
backward dropped the lookup, so nothing trained).
"""
import numpy as np
import pytest
import torch

from distemb.embedding import DistEmbedding
from distemb.errors import TraceOverflowError
from distemb.optim import SparseAdagrad, SparseAdam, SparseSGD
from tests.conftest import zipf_ids

STEPS, ROWS, DIM, BATCH = 40, 200, 8, 128

OPTIMIZERS = {
    "sgd": (SparseSGD, torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (SparseAdagrad, torch.optim.Adagrad, {"lr": 0.1}),
    "adam": (SparseAdam, torch.optim.SparseAdam, {"lr": 0.05}),
}


def _loss(rows, targets):
    return ((rows - targets) ** 2).sum(dim=1).mean()


def _batches(seed):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, BATCH))
        yield ids, torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))


def _train(order, lookup, opt, dense_opt):
    """Run ``STEPS`` steps of ``order`` through ``lookup`` and ``opt``."""
    for ids, targets in _batches(7):
        if order == "zero_first":
            opt.zero_grad()
            loss = _loss(lookup(ids), targets)
            loss.backward()
            opt.step()
        elif order == "canonical":
            loss = _loss(lookup(ids), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:  # DGL's example: a dense model too, both optimizers zeroed mid-step
            out = dense_opt.param_groups[0]["params"][0] * lookup(ids)
            loss = _loss(out, targets)
            opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            opt.step()
            dense_opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("order", ["canonical", "zero_first", "dgl"])
def test_zero_grad_anywhere_matches_torch(ctx, name, order):
    ours_cls, torch_cls, kw = OPTIMIZERS[name]
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))

    oracle = torch.nn.Embedding(ROWS, DIM, sparse=True)
    oracle.weight.data.copy_(init)
    scale_t = torch.nn.Parameter(torch.ones(DIM))
    _train(order, oracle, torch_cls(oracle.parameters(), **kw),
           torch.optim.SGD([scale_t], lr=0.01))

    emb = DistEmbedding(ROWS, DIM, name="zg", init_func=lambda s, d: init.clone(),
                        context=ctx)
    scale_o = torch.nn.Parameter(torch.ones(DIM))
    _train(order, emb, ours_cls([emb], **kw), torch.optim.SGD([scale_o], lr=0.01))

    got = emb.weight[torch.arange(ROWS)]
    want = oracle.weight.detach()
    assert not torch.equal(got, init), "nothing trained"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(scale_o.detach(), scale_t.detach(), rtol=1e-5, atol=1e-6)
    assert emb.trace == []


def test_zero_grad_drops_only_finished_backward(ctx):
    emb = DistEmbedding(10, 2, name="zg2", context=ctx)
    opt = SparseSGD([emb], lr=1.0)
    emb(torch.tensor([1])).sum().backward()      # an earlier pass: its gradient is dropped
    pending = emb(torch.tensor([2, 2])).sum()     # no backward yet: kept
    opt.zero_grad()
    assert len(emb.trace) == 1
    pending.backward()
    opt.step()
    rows = emb.weight[torch.arange(3)]
    assert rows[:, 0].tolist() == [0.0, 0.0, -2.0]  # duplicates sum, row 1 untouched
    assert emb.trace == []


def test_lookup_awaiting_backward_survives_step_and_trace_stays_bounded(ctx):
    emb = DistEmbedding(10, 2, name="zg3", context=ctx, trace_limit=4)
    opt = SparseSGD([emb], lr=1.0)
    late = emb(torch.tensor([3])).sum()
    opt.step()                                    # nothing to apply yet
    late.backward()
    opt.step()                                    # applied now, as torch would
    assert emb.weight[torch.tensor([3])][0, 0].item() == -1.0
    with pytest.warns(ResourceWarning):
        for _ in range(4):
            emb(torch.tensor([1]))                # never backpropagated
    with pytest.raises(TraceOverflowError):
        emb(torch.tensor([1]))
