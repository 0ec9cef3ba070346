"""Optimizer API: zero_grad, no-op steps, LR schedulers, state_dict, save/load, bad input."""
import numpy as np
import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.errors import DistEmbError, NonFiniteGradientError
from distemb.optim import (SparseAdagrad, SparseAdam, SparseFtrl, SparseRowWiseAdagrad,
                           SparseSGD)
from distemb.partition import HashPartitionBook, NodePartitionPolicy
from tests.conftest import zipf_ids

OPTIMIZERS = {
    "sgd": lambda e: SparseSGD(e, lr=0.1),
    "adagrad": lambda e: SparseAdagrad(e, lr=0.1, lr_decay=0.01),
    "rowwise": lambda e: SparseRowWiseAdagrad(e, lr=0.1),
    "adam": lambda e: SparseAdam(e, lr=0.01),
    "adam-per-row": lambda e: SparseAdam(e, lr=0.01, step_mode="per_row"),
    "ftrl": lambda e: SparseFtrl(e, lr=0.1, l1_regularization_strength=0.01),
}
ROWS, DIM = 200, 8


def _tables(ctx, policy=None):
    init = lambda s, d: torch.randn(s, generator=torch.Generator().manual_seed(1)).to(d)
    return [DistEmbedding(ROWS, DIM, name=n, context=ctx, init_func=init, part_policy=policy)
            for n in ("a", "b")]


def _train(embs, opt, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        loss = 0
        for emb in embs:
            rows = emb(torch.from_numpy(zipf_ids(rng, ROWS, 64)))
            loss = loss + (rows ** 2).sum()
        loss.backward()
        opt.step()


def _weights(embs):
    return [e.weight[torch.arange(ROWS)] for e in embs]


def test_zero_grad_clears_and_empty_step_is_noop(ctx):
    emb, = _tables(ctx)[:1]
    opt = SparseSGD([emb], lr=1.0)
    before = emb.weight[torch.arange(ROWS)]
    emb(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()
    opt.step()
    opt.step()
    torch.testing.assert_close(emb.weight[torch.arange(ROWS)], before, rtol=0, atol=0)


def test_lookup_without_backward_is_ignored(ctx):
    emb, other = _tables(ctx)
    opt = SparseSGD([emb], lr=1.0)
    emb(torch.tensor([3]))  # traced but never part of a loss: no gradient
    emb(torch.tensor([4])).sum().backward()
    before = emb.weight[torch.tensor([3, 4])]
    opt.step()
    after = emb.weight[torch.tensor([3, 4])]
    assert torch.equal(after[0], before[0]) and torch.allclose(after[1], before[1] - 1)


def test_step_lr_drives_param_groups(ctx):
    emb, = _tables(ctx)[:1]
    opt = SparseSGD([emb], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    moved = []
    for _ in range(3):
        before = emb.weight[torch.tensor([0])]
        emb(torch.tensor([0])).sum().backward()
        opt.step()
        sched.step()
        moved.append(float((before - emb.weight[torch.tensor([0])])[0, 0]))
    assert moved == pytest.approx([1.0, 0.5, 0.25])


def test_step_runs_torchs_step_hooks_around_the_update(ctx):
    """step() is left out of torch's profiler wrapper (module docstring of
    distemb.optim.base), so it runs the hooks that wrapper ran, in torch's order."""
    emb, = _tables(ctx)[:1]
    opt = SparseSGD([emb], lr=1.0)
    calls = []

    def seen(tag):
        def hook(o, args, kwargs):
            row = float(emb.weight[torch.tensor([0])][0, 0])
            calls.append((tag, o is opt, args[0] is opt, row))
        return hook

    handles = [register_optimizer_step_pre_hook(seen("global pre")),
               opt.register_step_pre_hook(seen("pre")), opt.register_step_post_hook(seen("post")),
               register_optimizer_step_post_hook(seen("global post"))]
    try:
        start = float(emb.weight[torch.tensor([0])][0, 0])
        emb(torch.tensor([0])).sum().backward()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert [c[:3] for c in calls] == [(t, True, True) for t in
                                      ("global pre", "pre", "post", "global post")]
    assert [c[3] for c in calls] == pytest.approx([start, start, start - 1, start - 1])


def test_a_step_pre_hook_may_replace_the_arguments(ctx):
    emb, = _tables(ctx)[:1]
    opt = SparseSGD([emb], lr=1.0)
    ran = []
    handle = opt.register_step_pre_hook(
        lambda o, args, kwargs: (args, {"closure": lambda: ran.append(1) or 7.0}))
    try:
        assert opt.step() == 7.0 and ran == [1]
        bad = opt.register_step_pre_hook(lambda o, args, kwargs: "nonsense")
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            opt.step()
        bad.remove()
    finally:
        handle.remove()


def test_step_is_not_a_profiler_range(ctx):
    emb, = _tables(ctx)[:1]
    opt = SparseSGD([emb], lr=1.0)
    emb(torch.tensor([0])).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0).step()  # the check can fail
    names = [e.name for e in prof.events()]
    assert not any("SparseSGD" in n for n in names)
    assert any(n.startswith("Optimizer.step#SGD") for n in names)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_roundtrip_continues_exactly(name):
    ctx_a = DistContext.embedded(num_threads=1)
    ctx_b = DistContext.embedded(num_threads=1)
    embs_a, embs_b = _tables(ctx_a), _tables(ctx_b)
    opt_a, opt_b = OPTIMIZERS[name](embs_a), OPTIMIZERS[name](embs_b)
    _train(embs_a, opt_a, 5, seed=0)
    sd = opt_a.state_dict()
    for ea, eb in zip(embs_a, embs_b):
        eb.weight[torch.arange(ROWS)] = ea.weight[torch.arange(ROWS)]
    opt_b.load_state_dict(sd)
    _train(embs_a, opt_a, 5, seed=1)
    _train(embs_b, opt_b, 5, seed=1)
    for wa, wb in zip(_weights(embs_a), _weights(embs_b)):
        torch.testing.assert_close(wa, wb, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_save_load_continues_exactly_even_resharded(tmp_path, name):
    """Train, save; load into a fresh, differently sharded job; both continue identically."""
    path = str(tmp_path / "ck.npz")
    ctx_a = DistContext.embedded(num_threads=1)
    embs_a = _tables(ctx_a)
    opt_a = OPTIMIZERS[name](embs_a)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.5)
    for _ in range(3):
        _train(embs_a, opt_a, 1, seed=0)
        sched.step()
    opt_a.save(path)
    ctx_b = DistContext.embedded(num_threads=1)
    hashed = NodePartitionPolicy(HashPartitionBook(3, node_counts={"_N": ROWS}))
    embs_b = _tables(ctx_b, policy=hashed)
    opt_b = OPTIMIZERS[name](embs_b)
    opt_b.load(path)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    for wa, wb in zip(_weights(embs_a), _weights(embs_b)):
        torch.testing.assert_close(wa, wb, rtol=0, atol=0)
    _train(embs_a, opt_a, 4, seed=7)
    _train(embs_b, opt_b, 4, seed=7)
    for wa, wb in zip(_weights(embs_a), _weights(embs_b)):
        torch.testing.assert_close(wa, wb, rtol=0, atol=0)


def test_load_errors(tmp_path, ctx):
    embs = _tables(ctx)
    SparseSGD(embs, lr=0.1).save(str(tmp_path / "sgd.npz"))
    with pytest.raises(DistEmbError, match="saved by SparseSGD .*cannot load into SparseAdagrad"):
        SparseAdagrad(embs, lr=0.1).load(str(tmp_path / "sgd.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DistEmbError, match="not a distemb checkpoint"):
        SparseSGD(embs, lr=0.1).load(str(tmp_path / "junk.npz"))
    small = DistEmbedding(ROWS + 1, DIM, name="a2", context=ctx)
    opt = SparseSGD(embs, lr=0.1)
    sd = opt.state_dict()
    with pytest.raises(DistEmbError, match="no state for table 'a2'"):
        SparseSGD([small], lr=0.1).load_state_dict(sd)


@pytest.mark.parametrize("make,message", [
    (lambda e: SparseSGD(e, lr=-1), "lr: expected a number >= 0.0, got -1"),
    (lambda e: SparseAdagrad(e, lr=0.1, eps=-1e-3), "eps: expected a number >= 0.0"),
    (lambda e: SparseAdam(e, lr=0.1, betas=(0.9, 1.0)), "betas\\[1\\]: expected a number >= 0.0 and < 1.0"),
    (lambda e: SparseAdam(e, lr=0.1, betas=0.9), "betas: expected a pair"),
    (lambda e: SparseAdam(e, lr=0.1, step_mode="row"), "step_mode: expected 'global' or 'per_row'"),
    (lambda e: SparseSGD([], lr=0.1), "params: expected a non-empty list"),
    (lambda e: SparseSGD([e[0], e[0]], lr=0.1), "each DistEmbedding may appear once"),
    (lambda e: SparseSGD([torch.zeros(2)], lr=0.1), "params\\[0\\]: expected a DistEmbedding, got Tensor"),
])
def test_bad_optimizer_arguments(ctx, make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make(_tables(ctx))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_step_with_a_non_finite_gradient_changes_no_table(bad):
    """Tables 'a' and 'b' in one optimizer, each in its own embedded context (two clients):
    'b' gets one bad gradient; step() refuses naming 'b' before 'a' (first in the list)
    or 'b' changes, the step count stays, and the next good step trains as torch's."""
    ctxs = [DistContext.embedded(num_threads=1) for _ in range(2)]
    init = lambda s, d: torch.randn(s, generator=torch.Generator().manual_seed(1)).to(d)
    embs = [DistEmbedding(ROWS, DIM, name=n, context=c, init_func=init)
            for n, c in zip("ab", ctxs)]
    opt = SparseAdam(embs, lr=0.01, check_finite=True)
    ref = [torch.nn.Embedding(ROWS, DIM, sparse=True) for _ in embs]
    for r in ref:
        r.weight.data.copy_(init((ROWS, DIM), torch.float32))
    ref_opt = torch.optim.SparseAdam([r.weight for r in ref], lr=0.01)
    ids = torch.tensor([3, 7, 7, 11])
    before = [e.weight[torch.arange(ROWS)].clone() for e in embs]
    up = torch.ones(4, DIM)
    bad_up = up.clone()
    bad_up[2, 5] = bad
    ((embs[0](ids) * up).sum() + (embs[1](ids) * bad_up).sum()).backward()
    with pytest.raises(NonFiniteGradientError, match=r"step\(\): the gradients of table\(s\) "
                                                     r"\['b'\] hold NaN or infinity"):
        opt.step()
    for e, b in zip(embs, before):
        assert torch.equal(e.weight[torch.arange(ROWS)], b), e.name
    assert opt.state_dict()["state"]["a"]["step"] == 0
    # the refused gradients are gone: a good step applies its own only, as torch does
    for tables in (embs, ref):
        ((tables[0](ids) * up).sum() + (tables[1](ids) * up).sum()).backward()
    opt.step()
    ref_opt.step()
    for e, r in zip(embs, ref):
        torch.testing.assert_close(e.weight[torch.arange(ROWS)], r.weight.detach(), rtol=1e-6,
                                   atol=1e-7)
    for c in ctxs:
        c.close()



def test_the_finite_check_is_off_by_default_and_takes_a_bool():
    emb = DistEmbedding(ROWS, DIM, context=DistContext.embedded(num_threads=1))
    for make in OPTIMIZERS.values():
        assert make([emb]).check_finite is False
    assert SparseSGD([emb], lr=0.1, check_finite=True).check_finite is True
    with pytest.raises(TypeError, match="check_finite: expected True or False, got 1"):
        SparseAdagrad([emb], lr=0.1, check_finite=1)


def test_making_and_stepping_an_optimizer_does_not_import_dynamo():
    """torch wraps Optimizer.add_param_group (which __init__ calls) to keep torch.compile
    out, and the wrapper imports torch._dynamo at its first call: ~1.4 s of CPU in every
    trainer that made an optimizer. A fresh process makes one, steps, saves and loads
    its state, and never imports it."""
    import subprocess
    import sys

    code = ("import sys, torch, distemb\n"
            "emb = distemb.DistEmbedding(10, 4, name='t')\n"
            "opt = distemb.SparseAdam([emb], lr=0.1)\n"
            "for _ in range(2):\n"
            "    opt.zero_grad(); emb(torch.tensor([1, 2, 2])).sum().backward(); opt.step()\n"
            "opt.load_state_dict(opt.state_dict())\n"
            "opt.add_param_group({'params': [], 'lr': 0.5})\n"
            "assert [g['lr'] for g in opt.param_groups] == [0.1, 0.5], opt.param_groups\n"
            "print('torch._dynamo' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]
