"""Optimizer state of tables on row stores: ``state_dict``/``load_state_dict`` and
``save``/``load`` resume training exactly (the oracle: the same run, uninterrupted).

Every optimizer, on a DynamicEmbedding (keys from the whole int64 range) and on a
StoreEmbedding over a dense store (a fixed key set). Resuming means a fresh context,
table and optimizer; the run's second half must then give bit-identical keys, rows and
optimizer state to the run that never stopped.
"""
import numpy as np
import pytest
import torch

from distemb.context import DistContext
from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.errors import DistEmbError
from distemb.optim import (SparseAdagrad, SparseAdam, SparseFtrl, SparseRowWiseAdagrad,
                           SparseSGD)
from distemb.stores import DenseStore, key_normal

DIM, STEPS = 4, 12
OPTS = {"sgd": lambda e: SparseSGD([e], lr=0.1),
        "adagrad": lambda e: SparseAdagrad([e], lr=0.1),
        "rowwise": lambda e: SparseRowWiseAdagrad([e], lr=0.1),
        "adam": lambda e: SparseAdam([e], lr=0.05),
        "adam_row": lambda e: SparseAdam([e], lr=0.05, step_mode="per_row"),
        "ftrl": lambda e: SparseFtrl([e], lr=0.1, l1_regularization_strength=0.01)}


def make(kind, ctx, name):
    init = key_normal(DIM, seed=5)
    if kind == "dynamic":
        return DynamicEmbedding(DIM, name=name, init_func=init, context=ctx)
    return StoreEmbedding(DenseStore(64, DIM, init=init), name=name, context=ctx)


def steps(emb, opt, kind, start, count):
    for s in range(start, start + count):
        rng = np.random.default_rng(s)
        ids = rng.integers(0, 40, 48)
        if kind == "dynamic":
            ids = ids * 230_000_000_000_000_003 - 2 ** 62
        rows = emb(torch.from_numpy(ids))
        (rows * torch.from_numpy(rng.standard_normal((48, DIM)).astype(np.float32))
         ).sum().backward()
        opt.step()


def table_of(emb):
    return emb.export()


def assert_equal(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), f"column {k!r} differs"


@pytest.mark.parametrize("kind", ["dynamic", "dense store"])
@pytest.mark.parametrize("how", ["state_dict", "save"])
@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_resume_equals_the_uninterrupted_run(tmp_path, kind, how, opt_name):
    ctx = DistContext.embedded(backend="pytorch", num_threads=1)
    full = make(kind, ctx, "t")
    full_opt = OPTS[opt_name](full)
    steps(full, full_opt, kind, 0, 2 * STEPS)
    want = table_of(full)

    first = DistContext.embedded(backend="pytorch", num_threads=1)
    a = make(kind, first, "t")
    opt_a = OPTS[opt_name](a)
    steps(a, opt_a, kind, 0, STEPS)
    sd, rows = opt_a.state_dict(), a.export()
    opt_a.save(str(tmp_path / "ck"))
    first.close()

    second = DistContext.embedded(backend="pytorch", num_threads=1)
    b = make(kind, second, "t")
    opt_b = OPTS[opt_name](b)
    if how == "state_dict":
        b.import_({"keys": rows["keys"], "weight": rows["weight"]})
        opt_b.load_state_dict(sd)
    else:
        opt_b.load(str(tmp_path / "ck"))
    steps(b, opt_b, kind, STEPS, STEPS)
    assert_equal(table_of(b), want)
    assert not np.array_equal(want["weight"], rows["weight"]), "the second half did nothing"
    ctx.close()
    second.close()


def test_state_dict_of_a_dynamic_table_is_keyed_and_checked(ctx):
    emb = DynamicEmbedding(DIM, name="keyed", context=ctx)
    opt = SparseAdagrad([emb], lr=0.1)
    emb(torch.tensor([2 ** 50, -4])).sum().backward()
    opt.step()
    sd = opt.state_dict()["state"]["keyed"]
    assert sd["keys"].tolist() == [-4, 2 ** 50] and sd["step"] == 1
    assert sd["sum"].shape == (2, DIM) and (sd["sum"] > 0).all()
    bad = opt.state_dict()
    del bad["state"]["keyed"]["keys"]
    with pytest.raises(DistEmbError, match="'keys'"):
        opt.load_state_dict(bad)
