"""distemb.pyg.Node2Vec against PyG's own Node2Vec + torch.optim.SparseAdam.

The oracle is PyG 2.8's ``torch_geometric.nn.Node2Vec`` (its code unedited) trained by
``torch.optim.SparseAdam`` on its ``nn.Embedding(sparse=True)``. PyG's model walks with
pyg-lib's compiled ``random_walk``, which is not on PyPI: in this test only, distemb's
plain-torch walker stands in for it (``torch.ops.pyg.random_walk``), so both models see
the same walks from the same seed. Both start from PyG's initial rows, train on the same
windows, and must agree within 1e-5 after every step (loss and every row): embedded, in
a collective job of one rank, and on two servers with two trainers (each taking half of
every batch, its loss scaled by its share, so the servers' sum is PyG's mean over the
whole batch).
"""
import numpy as np
import pytest
import torch

pytest.importorskip("torch_geometric")

import distemb  # noqa: E402
from conftest import CLUSTERS, make_placement  # noqa: E402
from distemb.pyg import Node2Vec, RandomWalker  # noqa: E402
from torch_geometric.nn import Node2Vec as PygNode2Vec  # noqa: E402
from torch_geometric.nn.models import node2vec as pyg_node2vec  # noqa: E402

N, DIM, STEPS = 60, 16, 6
ARGS = dict(embedding_dim=DIM, walk_length=6, context_size=3, walks_per_node=2,
            num_negative_samples=2)


def _graph():
    g = torch.Generator().manual_seed(7)
    src = torch.randint(N, (300,), generator=g)
    dst = torch.randint(N, (300,), generator=g)
    return torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])  # undirected


@pytest.fixture(params=["embedded", "collective1",
                        pytest.param("tcp2x2", marks=pytest.mark.multiprocess)])
def where(request, clusters):
    """Embedded, a collective job of one rank, and two trainers of a job on two servers
    (tests/conftest.py's placements)."""
    placement = make_placement(request.param, clusters)
    yield placement
    kv = placement.client
    try:
        for name in kv.names():
            if "~opt~" not in name:
                kv.delete_data(name)
    finally:
        kv.close(**({"goodbye": False} if request.param in CLUSTERS else {}))


@pytest.fixture
def pyg_model(monkeypatch):
    """PyG's Node2Vec, walking with distemb's walker in pyg-lib's place (test only)."""
    def random_walk(rowptr, col, start, walk_length, p, q):
        return RandomWalker(rowptr, col)(start, walk_length, p, q)
    monkeypatch.setattr(pyg_node2vec, "WITH_PYG_LIB", True)
    monkeypatch.setattr(torch.ops.pyg, "random_walk", random_walk, raising=False)
    torch.manual_seed(0)
    return PygNode2Vec(_graph(), sparse=True, p=0.5, q=2.0, **ARGS)


def _reference(model):
    """PyG's run: (initial rows, [(pos, neg)] per step, [loss] per step, [rows] per step)."""
    start = model.embedding.weight.detach().clone()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    batches, losses, rows = [], [], []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        pos, neg = model.sample(torch.arange(step * 10, step * 10 + 10) % N)
        opt.zero_grad()
        loss = model.loss(pos, neg)
        loss.backward()
        opt.step()
        batches.append((pos, neg))
        losses.append(loss.item())
        rows.append(model.embedding.weight.detach().clone())
    return start, batches, losses, rows


def test_walks_and_negatives_are_pygs_from_the_same_seed(pyg_model):
    ours = Node2Vec(_graph(), p=0.5, q=2.0, context=distemb.DistContext.embedded(), **ARGS)
    assert torch.equal(ours.rowptr, pyg_model.rowptr) and torch.equal(ours.col, pyg_model.col)
    for seed in range(3):
        batch = torch.arange(seed, N, 7)
        torch.manual_seed(seed)
        want = pyg_model.sample(batch)
        torch.manual_seed(seed)
        got = ours.sample(batch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert repr(ours) == repr(pyg_model) == f"Node2Vec({N}, {DIM})"


def test_node2vec_equals_pygs_with_sparse_adam_every_step(where, pyg_model):
    start, batches, losses, rows = _reference(pyg_model)

    def job(ctx, rank, num_trainers):
        model = Node2Vec(_graph(), p=0.5, q=2.0, name="n2v-oracle", context=ctx, **ARGS)
        if rank == 0:
            model.embedding.weight[slice(0, N)] = start
        ctx.client.barrier()
        opt = distemb.SparseAdam([model.embedding], lr=0.05)
        got_losses, got_rows = [], []
        for pos, neg in batches:
            share = lambda t: t.chunk(num_trainers)[rank]  # noqa: E731
            opt.zero_grad()
            loss = model.loss(share(pos), share(neg)) / num_trainers
            loss.backward()
            opt.step()
            ctx.client.barrier()
            got_losses.append(float(loss))
            got_rows.append(model.embedding.weight[slice(0, N)].clone())
        return got_losses, got_rows

    results = where.run(job)
    trainer_losses = np.sum([r[0] for r in results], axis=0)
    np.testing.assert_allclose(trainer_losses, losses, rtol=0, atol=1e-5)
    for step, want in enumerate(rows):
        for rank, (_, got_rows) in enumerate(results):
            torch.testing.assert_close(got_rows[step], want, rtol=0, atol=1e-5,
                                       msg=f"step {step}, trainer {rank}")


def test_loss_is_pygs_at_large_scores_too(pyg_model):
    """Rows far from zero (scores of +-40: PyG's 1e-15 inside the log is all that bounds
    its loss there) still give PyG's loss within 1e-5 relative, and finite gradients."""
    ours = Node2Vec(_graph(), p=0.5, q=2.0, context=distemb.DistContext.embedded(), **ARGS)
    big = torch.randn(N, DIM) * 3
    with torch.no_grad():
        pyg_model.embedding.weight.copy_(big)
    ours.embedding.weight[slice(0, N)] = big
    torch.manual_seed(3)
    pos, neg = pyg_model.sample(torch.arange(N))
    want = float(pyg_model.loss(pos, neg))
    got = ours.loss(pos, neg)
    got.backward()
    assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    assert all(torch.isfinite(t.rows.grad).all() for t in ours.embedding.trace)


@pytest.mark.parametrize("kwargs, match", [
    (dict(walk_length=2, context_size=3), "walk_length: expected >= context_size"),
    (dict(walk_length=3, context_size=0), "context_size: expected a positive int"),
    (dict(walk_length=3, context_size=2, walks_per_node=0), "walks_per_node: expected"),
])
def test_bad_sizes_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Node2Vec(_graph(), DIM, context=distemb.DistContext.embedded(), **kwargs)


def test_walker_refuses_bad_input_by_name():
    w = RandomWalker(torch.tensor([0, 1, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="start: expected node ids in 0..1, got 0..5"):
        w(torch.tensor([0, 5]), 2)
    with pytest.raises(ValueError, match="p, q: node2vec parameters must be > 0"):
        w(torch.tensor([0]), 2, p=0.0)
    with pytest.raises(ValueError, match="walk_length: expected an int >= 1, got 0"):
        w(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="rowptr, col: expected CSR offsets"):
        RandomWalker(torch.tensor([0, 3]), torch.tensor([1]))


def test_biased_walk_follows_node2vec_odds():
    """On a triangle 0-1-2 with a pendant 3 on 1: after 0 -> 1, node2vec's odds of the
    next node are 1/p (back to 0), 1 (2, a neighbour of 0) and 1/q (3): p=0.5, q=4 gives
    2 : 1 : 0.25 of 3.25."""
    edges = [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1), (1, 3), (3, 1)]
    rowptr = torch.tensor([0, 2, 5, 7, 8])
    col = torch.tensor([1, 2, 0, 2, 3, 0, 1, 1])
    assert len(edges) == len(col)
    torch.manual_seed(0)
    walker = RandomWalker(rowptr, col)
    walks = walker(torch.zeros(40000, dtype=torch.int64), 2, p=0.5, q=4.0)
    third = walks[walks[:, 1] == 1, 2]
    freq = torch.bincount(third, minlength=4).double() / len(third)
    np.testing.assert_allclose(freq[[0, 2, 3]].numpy(), [2 / 3.25, 1 / 3.25, 0.25 / 3.25],
                               atol=0.02)
