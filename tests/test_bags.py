"""Pooled lookups (``emb.bag``) against their oracle: ``torch.nn.EmbeddingBag`` + torch.optim.

The oracle is ``nn.EmbeddingBag(sparse=True)`` with the matching torch optimizer (the
pairs of tests/test_optim_oracle.py) over 50 zipf steps, each optimizer, each mode, every
input form (2-D ids; 1-D ids + offsets; with ``include_last_offset``), with per-sample
weights, a padding id, empty bags, two pooled lookups in some steps, and initial rows
of few distinct values, so that max mode meets ties and must break them as torch does.
torch has no sparse gradient for max mode: its oracle is ``nn.EmbeddingBag(mode="max")``
whose dense gradient is handed to the optimizer as the sparse gradient of the ids looked
up, which is what a sparse max would be (every id of a bag but the padding id, as the
other modes' sparse gradients hold them). Tables within 1e-5 relative, as
test_optim_oracle.py's.

Then the same against the oracle on every placement of the client suite
(tests/conftest.py) and every table kind it holds (tests/suite_tables.py): pooled
lookups go through each placement's own lookup and update path.
"""
import numpy as np
import pytest
import torch

from conftest import zipf_ids
from suite_tables import Table
from test_optim_oracle import CASES, assert_within

from distemb.bags import CHUNK, Bags
from distemb.embedding import DistEmbedding
from distemb.optim import SparseAdagrad

pytestmark = pytest.mark.timeout(120)
STEPS, ROWS, DIM, BAGS, LEN = 50, 300, 7, 24, 6
FORMS = ["2d", "offsets", "last_offset"]
#: The padding id of the oracle tests: the third most frequent zipf id.
PAD = int(np.random.default_rng(12345).permutation(ROWS)[2])


def bag_batch(rng, form, num_rows, bags=BAGS, length=LEN):
    """(ids, offsets, weights) of one step: ``bags`` bags of zipf ids, one of them empty
    or all padding; 2-D ids have no offsets."""
    if form == "2d":
        ids = zipf_ids(rng, num_rows, bags * length).reshape(bags, length)
        ids[rng.integers(bags)] = PAD % num_rows  # a bag of padding only: zeros
        offsets = None
    else:
        lengths = rng.integers(0, 2 * length + 1, bags)
        lengths[rng.integers(bags)] = 0  # an empty bag
        ids = zipf_ids(rng, num_rows, int(lengths.sum()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        offsets = torch.from_numpy(offsets if form == "last_offset" else offsets[:-1])
    weights = torch.from_numpy(rng.uniform(-1, 2, ids.shape).astype(np.float32))
    return torch.from_numpy(ids), offsets, weights


def split(ids, offsets, weights, form, part, parts):
    """Bags ``part`` of ``parts`` equal shares of a batch, as a batch of their own
    (ids, offsets, weights or None)."""
    if form == "2d":
        n = len(ids) // parts
        lo, hi, mine = part * n, (part + 1) * n, None
    else:
        starts = offsets if form == "offsets" else offsets[:-1]
        ends = torch.cat([starts[1:], torch.tensor([len(ids)])])
        n = len(starts) // parts
        lo, hi = int(starts[part * n]), int(ends[(part + 1) * n - 1])
        mine = starts[part * n:(part + 1) * n] - lo
        if form == "last_offset":
            mine = torch.cat([mine, torch.tensor([hi - lo])])
    return ids[lo:hi], mine, None if weights is None else weights[lo:hi]


def torch_step(ref, opt, mode, ids, offsets, weights, up, pad):
    """One step of the oracle (``ref``: an nn.EmbeddingBag, sparse but in max mode)."""
    opt.zero_grad()
    out = ref(ids, offsets, per_sample_weights=weights)
    (out * up).sum().backward()
    if mode == "max":  # the dense gradient as the sparse one of the ids looked up
        looked = torch.unique(ids.reshape(-1))
        looked = looked[looked != pad]
        ref.weight.grad = torch.sparse_coo_tensor(looked[None], ref.weight.grad[looked],
                                                  ref.weight.shape)
    opt.step()


def initial_rows(seed, rows=ROWS, dim=DIM):
    """Rows of few distinct values (halves in [-2, 2]): ties for max mode."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (rows, dim), generator=gen).float() / 2


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bag_matches_embedding_bag_and_torch_optim(ctx, case, mode, form):
    make_ours, make_torch = CASES[case]
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    w0 = initial_rows(7)
    ref = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=mode != "max",
                                include_last_offset=form == "last_offset", padding_idx=PAD)
    ref.weight.data.copy_(w0)
    ref_opt = make_torch([ref.weight])
    emb = DistEmbedding(ROWS, DIM, name=f"bag-{case}", context=ctx)
    emb.weight[torch.arange(ROWS)] = w0
    opt = make_ours([emb])
    ties = 0
    for step in range(STEPS):
        ids, offsets, weights = bag_batch(rng, form, ROWS)
        weights = weights if mode == "sum" and step % 2 == 0 else None
        up = torch.randn(BAGS, DIM, generator=gen)
        if mode == "max":
            rows = ref.weight.detach()[ids.reshape(-1)]
            ties += int((rows[:, None, :] == rows[None, :, :]).sum())
        torch_step(ref, ref_opt, mode, ids, offsets, weights, up, PAD)
        padding = PAD - ROWS if step % 3 == 0 else PAD  # torch's negative form too
        last = form == "last_offset"
        if step % 2:  # two pooled lookups, sharing ids: two traced lookups summed
            a, b = (emb.bag(i, o, mode=mode, per_sample_weights=w, include_last_offset=last,
                            padding_idx=padding)
                    for i, o, w in (split(ids, offsets, weights, form, p, 2) for p in (0, 1)))
            loss = (a * up[:BAGS // 2]).sum() + (b * up[BAGS // 2:]).sum()
            assert len(emb.trace) == 2
        else:
            out = emb.bag(ids.int(), offsets, mode=mode, per_sample_weights=weights,
                          include_last_offset=last, padding_idx=padding)
            loss = (out * up).sum()
            assert len(emb.trace) == 1
        loss.backward()
        opt.step()
    expected = ref.weight.detach()
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert torch.equal(expected[PAD], w0[PAD]), "the padding row moved in the oracle"
    if mode == "max":
        assert ties > BAGS * LEN * STEPS, "too few ties for the test to check them"
    assert_within(emb.weight[torch.arange(ROWS)], expected)


def test_max_ties_go_to_the_bags_first_row_holding_the_max(ctx):
    """A bag of distinct ids whose rows are equal: torch gives the gradient to the
    first; so must the pooled lookup, which reduces rows in the unique ids' order."""
    emb = DistEmbedding(10, 2, name="ties", context=ctx)
    emb.weight[torch.arange(10)] = torch.ones(10, 2)
    ids = torch.tensor([[7, 2, 5], [5, 7, 2]])
    out = emb.bag(ids, mode="max")
    out.sum().backward()
    (lookup,) = emb.trace
    ref = torch.nn.EmbeddingBag(10, 2, mode="max")
    ref.weight.data.fill_(1.0)
    ref(ids).sum().backward()
    got = torch.zeros(10, 2)
    got[torch.as_tensor(lookup.ids)] = lookup.rows.grad
    assert torch.equal(got, ref.weight.grad) and got[7].tolist() == [1.0, 1.0]
    assert got[5].tolist() == [1.0, 1.0] and got[2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["sum", "weighted", "mean", "max"])
def test_one_lookup_of_unique_ids_with_summed_gradients(ctx, mode):
    """The trace holds one lookup of the ascending unique ids and their (U, D) rows,
    never a row per id, and its gradient is each id's sum (the oracle: nn.EmbeddingBag's
    sparse gradient, coalesced; max mode's dense one at the ids looked up), ids seen
    around and far past CHUNK times included (summed in chunks); per-sample weights get
    their gradient too (the padding id's entries none)."""
    rng = np.random.default_rng(3)
    counts = [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5, 700]
    ids = np.repeat(rng.permutation(ROWS)[:len(counts)], counts)
    ids = np.concatenate([ids, rng.integers(0, ROWS, 600), np.full(40, PAD)])
    ids = torch.from_numpy(rng.permutation(ids))
    lengths = rng.integers(0, 18, 200)
    lengths[-1] = len(ids) - lengths[:-1].sum()
    assert lengths[-1] > 0 and (lengths == 0).any()
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    w0 = initial_rows(3)
    emb = DistEmbedding(ROWS, DIM, name="once", context=ctx)
    emb.weight[torch.arange(ROWS)] = w0
    weights = torch.from_numpy(rng.uniform(-1, 2, len(ids)).astype(np.float32)) \
        if mode == "weighted" else None
    mode = "sum" if mode == "weighted" else mode
    ours_w = None if weights is None else weights.clone().requires_grad_()
    up = torch.randn(len(offsets), DIM, generator=torch.Generator().manual_seed(3))
    (emb.bag(ids, offsets, mode=mode, per_sample_weights=ours_w, padding_idx=PAD)
     * up).sum().backward()
    ref = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=mode != "max", padding_idx=PAD)
    ref.weight.data.copy_(w0)
    ref_w = None if weights is None else weights.clone().requires_grad_()
    (ref(ids, offsets, per_sample_weights=ref_w) * up).sum().backward()
    looked = torch.unique(ids)
    looked = looked[looked != PAD]
    want = ref.weight.grad.coalesce() if mode != "max" else \
        torch.sparse_coo_tensor(looked[None], ref.weight.grad[looked]).coalesce()
    (lookup,) = emb.trace
    np.testing.assert_array_equal(np.asarray(lookup.ids), want.indices()[0].numpy())
    assert tuple(lookup.rows.shape) == (len(looked), DIM) < (len(ids), DIM)
    torch.testing.assert_close(lookup.rows.grad, want.values(), rtol=1e-5, atol=1e-5)
    if weights is not None:
        torch.testing.assert_close(ours_w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
        assert (ours_w.grad[ids == PAD] == 0).all()


def test_bags_without_autograd_record_nothing(ctx):
    emb = DistEmbedding(5, 2, name="nograd", context=ctx)
    with torch.no_grad():
        out = emb.bag(torch.tensor([[1, 2], [4, 4]]), mode="mean")
    assert out.shape == (2, 2) and emb.trace == []


def test_empty_bags_and_no_ids(ctx):
    """Bags with no ids (or only the padding id) are zeros in every mode, and a batch of
    no ids at all looks nothing up."""
    emb = DistEmbedding(5, 2, name="empty", context=ctx,
                        init_func=lambda s, d: torch.ones(s, dtype=d))
    for mode in ("sum", "mean", "max"):
        out = emb.bag(torch.tensor([3, 1, 1]), torch.tensor([0, 0, 2, 3]), mode=mode,
                      padding_idx=1)
        assert out[:2].tolist() == [[0.0, 0.0], [1.0, 1.0]] and out[2:].abs().sum() == 0
        out = emb.bag(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]), mode=mode)
        assert out.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert [len(t.ids) for t in emb.trace] == [1, 0] * 3


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ids=torch.tensor([1, 2]), offsets=None), ValueError,
     r"offsets: 1-D ids need the offsets .* got None"),
    (dict(ids=torch.tensor([[1, 2]]), offsets=torch.tensor([0])), ValueError,
     r"offsets: 2-D ids are one bag per row; expected None, got a tensor of shape \(1,\)"),
    (dict(ids=torch.tensor([[1, 2]]), include_last_offset=True), ValueError,
     r"include_last_offset: 2-D ids .* expected False, got True"),
    (dict(ids=torch.tensor([[[1]]])), ValueError,
     r"ids: expected 2-D ids .* got shape \(1, 1, 1\)"),
    (dict(ids=torch.tensor([1.0]), offsets=torch.tensor([0])), TypeError,
     r"ids: expected an integer tensor \(int32 or int64\), got torch.float32"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([1])), ValueError,
     r"offsets: the first bag must start at 0, got offsets\[0\]=1"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 1])), ValueError,
     r"offsets: expected non-decreasing offsets, got offsets\[2\]=1 after 2"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([0, 3])), ValueError,
     r"offsets: expected offsets\[-1\] <= 2 \(the number of ids\), got offsets\[-1\]=3"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([0, 1]), include_last_offset=True),
     ValueError, r"offsets: expected offsets\[-1\] = 2 \(the number of ids; it ends the "
                 r"last bag\), got offsets\[-1\]=1"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([[0]])), ValueError,
     r"offsets: expected a 1-D tensor, got shape \(1, 1\)"),
    (dict(ids=torch.tensor([1, 2]), offsets=torch.tensor([0.0])), TypeError,
     r"offsets: expected an integer tensor"),
    (dict(ids=torch.tensor([[1, 2]]), mode="median"), ValueError,
     r"mode: must be one of \['sum', 'mean', 'max'\], got 'median'"),
    (dict(ids=torch.tensor([[1, 2]]), mode="mean", per_sample_weights=torch.ones(1, 2)),
     ValueError, r"per_sample_weights: only mode 'sum' weights its rows, got mode 'mean'"),
    (dict(ids=torch.tensor([[1, 2]]), per_sample_weights=torch.ones(2)), ValueError,
     r"per_sample_weights: expected the ids' shape \(1, 2\), got \(2,\)"),
    (dict(ids=torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2, dtype=torch.int64)),
     TypeError, r"per_sample_weights: expected a float tensor, got torch.int64"),
    (dict(ids=torch.tensor([[1, 2]]), padding_idx=5), ValueError,
     r"padding_idx: expected an id in \[-5, 5\) .* got 5"),
    (dict(ids=torch.tensor([[1, 2]]), padding_idx=1.0), TypeError,
     r"padding_idx: expected an int id or None, got 1.0"),
    (dict(ids=torch.tensor([[1, 2]]), padding_idx=True), TypeError,
     r"padding_idx: expected an int id or None, got True"),
])
def test_bad_arguments_are_refused_naming_them(ctx, kwargs, error, match):
    emb = DistEmbedding(5, 2, name="bad", context=ctx)
    with pytest.raises(error, match=match):
        emb.bag(**kwargs)
    assert emb.trace == []


def test_a_hash_tables_padding_id_is_a_key_never_inserted(ctx):
    """A hash table's padding id is any int64 key (a negative one is that key): it is
    not looked up, so not inserted."""
    emb = DistEmbedding(None, 2, name="hash-pad", context=ctx)
    out = emb.bag(torch.tensor([[-1, 2 ** 40], [-1, -1]]), mode="mean", padding_idx=-1)
    assert out.shape == (2, 2) and out[1].abs().sum() == 0
    assert emb.contains(torch.tensor([-1, 2 ** 40])).tolist() == [False, True]
    assert Bags.of(torch.tensor([[3]]), padding_idx=-2 ** 63).unique.tolist() == [3]
    with pytest.raises(ValueError, match=r"padding_idx: expected an int64 key, got"):
        Bags.of(torch.tensor([[3]]), padding_idx=2 ** 63)


# --- every placement and table kind of the client suite ---------------------------------

PLACEMENT_STEPS, PLACEMENT_ROWS = 9, 40
MODES = ["sum", "mean", "max"]


def placement_batch(step, t):
    """Step ``step``'s (mode, form, oracle ids, offsets, weights, upstream): modes and
    forms rotate, so 9 steps take every pair."""
    mode, form = MODES[step % 3], FORMS[(step // 3) % 3]
    rng = np.random.default_rng(900 + step)
    ids, offsets, weights = bag_batch(rng, form, t.n, bags=8, length=4)
    up = torch.from_numpy(rng.standard_normal((8, t.dim)).astype(np.float32))
    return mode, form, ids, offsets, weights if mode == "sum" else None, up


def bag_job(t, device):
    """Trainer r of T pools its share of every step's bags into table ``t``."""
    def job(ctx, rank, num_trainers):
        emb = t.embedding(ctx)
        opt = SparseAdagrad([emb], lr=0.1)
        ctx.client.barrier()
        for step in range(PLACEMENT_STEPS):
            mode, form, ids, offsets, weights, up = placement_batch(step, t)
            keys = torch.from_numpy(t.key_of(ids.numpy()))
            mine, off, w = split(keys, offsets, weights, form, rank, num_trainers)
            per = len(up) // num_trainers
            opt.zero_grad()
            out = emb.bag(mine, off, mode=mode, per_sample_weights=w,
                          include_last_offset=form == "last_offset",
                          padding_idx=int(t.key_of([PAD % t.n])[0]), device=device)
            (out * up[rank * per:(rank + 1) * per].to(out.device)).sum().backward()
            opt.step()
        ctx.client.barrier()
    return job


def test_bag_on_every_placement_and_table_kind(placement, table_kind, tmp_path):
    """The pooled job (every mode and input form, Adagrad) on this placement (two
    trainers on half the bags each in the 2x2 job) against nn.EmbeddingBag + Adagrad."""
    t = Table(table_kind, PLACEMENT_ROWS, 4, str(tmp_path))
    placement.run(bag_job(t, placement.device))
    weight = torch.nn.Parameter(torch.from_numpy(t.initial()))
    opt = torch.optim.Adagrad([weight], lr=0.1)
    for step in range(PLACEMENT_STEPS):
        mode, form, ids, offsets, weights, up = placement_batch(step, t)
        ref = torch.nn.EmbeddingBag(t.n, t.dim, mode=mode, sparse=mode != "max",
                                    include_last_offset=form == "last_offset",
                                    padding_idx=PAD % t.n)
        ref.weight = weight  # one table, every mode's module
        torch_step(ref, opt, mode, ids, offsets, weights, up, PAD % t.n)
    want = weight.detach().numpy()
    assert np.abs(want - t.initial()).max() > 0.05, "the oracle did not train"
    np.testing.assert_allclose(t.rows(placement.client), want, rtol=t.rtol,
                               atol=t.rtol * float(np.abs(want).max()))
