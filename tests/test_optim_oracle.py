"""Optimizers against their oracle: nn.Embedding(sparse=True) + the matching torch.optim.

Each test runs 50 steps of zipf-distributed, duplicate-heavy ids through both, with the
same initial weights and the same upstream gradients, and compares the tables within
1e-5 relative: elementwise rtol 1e-5, plus an absolute slack of 1e-5 times the table's
largest entry, because float32 summation order alone (torch's SGD adds duplicate rows
into the weight one by one, we sum them first) moves entries that cross zero by more
than 1e-5 of their own tiny value. Lookups are split in two per step, so traces of several lookups (and
duplicates across them) are exercised. Sharded tables (range and hash, several parts)
run the same path as one-part tables.
"""
import numpy as np
import pytest
import torch

from distemb.embedding import DistEmbedding
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD
from distemb.partition import HashPartitionBook, NodePartitionPolicy, range_policy
from tests.conftest import zipf_ids

STEPS, ROWS, BATCH = 50, 300, 256
RTOL = 1e-5


class RowWiseAdagradOracle(torch.optim.Optimizer):
    """Row-wise Adagrad written directly in torch ops on the coalesced sparse gradient."""

    def __init__(self, params, lr, eps=1e-10):
        super().__init__(params, {"lr": lr, "eps": eps})
        for p in self.param_groups[0]["params"]:
            self.state[p]["sum"] = torch.zeros(p.shape[0], device=p.device)

    def step(self):
        g = self.param_groups[0]
        for p in g["params"]:
            grad = p.grad.coalesce()
            idx, val = grad.indices()[0], grad.values()
            s = self.state[p]["sum"]
            s[idx] += (val * val).mean(1)
            p.data[idx] -= g["lr"] * (val / (s[idx].sqrt() + g["eps"])[:, None])


class PerRowAdamOracle(torch.optim.Optimizer):
    """Lazy Adam whose bias correction uses each row's own step count, in torch ops."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        for p in self.param_groups[0]["params"]:
            st = self.state[p]
            st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
            st["t"] = torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)

    def step(self):
        g = self.param_groups[0]
        b1, b2 = g["betas"]
        for p in g["params"]:
            grad = p.grad.coalesce()
            idx, val = grad.indices()[0], grad.values()
            st = self.state[p]
            st["t"][idx] += 1
            m = st["m"][idx] + (val - st["m"][idx]) * (1 - b1)
            v = st["v"][idx] + (val * val - st["v"][idx]) * (1 - b2)
            st["m"][idx], st["v"][idx] = m, v
            t = st["t"][idx]
            size = (g["lr"] * torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)).float()
            p.data[idx] -= size[:, None] * (m / (v.sqrt() + g["eps"]))


CASES = {
    "sgd": (lambda e: SparseSGD(e, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "adagrad": (lambda e: SparseAdagrad(e, lr=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adagrad-decay-init": (
        lambda e: SparseAdagrad(e, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1,
                                eps=1e-2),
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01,
                                      initial_accumulator_value=0.1, eps=1e-2)),
    "rowwise_adagrad": (lambda e: SparseRowWiseAdagrad(e, lr=0.1),
                        lambda p: RowWiseAdagradOracle(p, lr=0.1)),
    "adam": (lambda e: SparseAdam(e, lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    "adam-betas": (lambda e: SparseAdam(e, lr=0.02, betas=(0.8, 0.99), eps=1e-3),
                   lambda p: torch.optim.SparseAdam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-3)),
    "adam-per-row": (lambda e: SparseAdam(e, lr=0.01, step_mode="per_row"),
                     lambda p: PerRowAdamOracle(p, lr=0.01)),
}


def _policy(kind, rows):
    if kind == "one-part":
        return None
    if kind == "range-3":
        return range_policy(rows, 3)
    return NodePartitionPolicy(HashPartitionBook(2, node_counts={"_N": rows}))


def run_both(ctx, case, dim, policy_kind="one-part", steps=STEPS, seed=0, table_device=None,
             lookup_device=None, oracle_device="cpu"):
    """Our table and the oracle's after ``steps`` steps, and the initial weights (on CPU).

    ``table_device`` and ``lookup_device`` go to ``DistEmbedding(device=)`` and
    ``emb(ids, device=)``; ``oracle_device`` is where the torch oracle runs.
    """
    make_ours, make_torch = CASES[case]
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(ROWS, dim, generator=gen)
    ref = torch.nn.Embedding(ROWS, dim, sparse=True).to(oracle_device)
    ref.weight.data.copy_(w0)
    ref_opt = make_torch([ref.weight])
    emb = DistEmbedding(ROWS, dim, name=f"oracle-{case}-{dim}", context=ctx,
                        part_policy=_policy(policy_kind, ROWS), device=table_device)
    emb.weight[torch.arange(ROWS)] = w0
    opt = make_ours([emb])
    for _ in range(steps):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, BATCH))
        upstream = torch.randn(BATCH, dim, generator=gen)
        ref_opt.zero_grad()
        (ref(ids.to(oracle_device)) * upstream.to(oracle_device)).sum().backward()
        ref_opt.step()
        half = BATCH // 2
        a = emb(ids[:half], device=lookup_device)
        b = emb(ids[half:].int(), device=lookup_device)  # int32 ids too
        up = upstream.to(a.device)
        ((a * up[:half]).sum() + (b * up[half:]).sum()).backward()
        opt.step()
    return emb.weight[torch.arange(ROWS)].cpu(), ref.weight.detach().cpu(), w0


def assert_within(ours, expected):
    torch.testing.assert_close(ours, expected, rtol=RTOL,
                               atol=RTOL * float(expected.abs().max()))


@pytest.mark.parametrize("dim", [1, 7, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_oracle(ctx, model_impl, case, dim):
    ours, expected, w0 = run_both(ctx, case, dim)
    assert (expected - w0).abs().max() > 1e-2, "the oracle did not move: the test would be void"
    assert_within(ours, expected)


@pytest.mark.parametrize("policy_kind", ["range-3", "hash-2"])
@pytest.mark.parametrize("case", ["adagrad", "adam", "rowwise_adagrad"])
def test_sharded_tables_match_oracle(ctx, case, policy_kind):
    ours, expected, _ = run_both(ctx, case, 7, policy_kind=policy_kind, steps=20)
    assert_within(ours, expected)


def test_duplicates_are_summed_not_averaged(ctx):
    emb = DistEmbedding(4, 2, name="dup", context=ctx)
    opt = SparseSGD([emb], lr=1.0)
    emb(torch.tensor([1, 1, 1])).sum().backward()
    opt.step()
    assert emb.weight[torch.tensor([1])].tolist() == [[-3.0, -3.0]]
