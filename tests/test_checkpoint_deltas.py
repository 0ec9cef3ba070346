"""Incremental checkpoints and the sink of evicted rows, on every placement (issue 38).

Oracles:

- a full save followed by incremental saves (``opt.save(path, incremental=True)``)
  loads bit-identical to a full save at the same step, and to the live table: every
  table kind on every placement (tests/conftest.py), hash tables with keys removed and
  evicted between the saves;
- a hash table that evicts on its own (a capacity) hands every evicted row and its
  Adagrad state to its sink directory, in eviction order, and the rows in the sink and in
  the table are those of ``torch.optim.Adagrad`` on ``nn.Embedding(sparse=True)`` over the
  same steps (no key comes back after its eviction, so nothing is lost only if the sink
  has it); its chain of saves loads as the full save does.
"""
import dataclasses
import json
import os
import uuid

import numpy as np
import pytest
import torch

from conftest import make_placement
from suite_tables import Table

from distemb import checkpoint
from distemb.dynamic import DynamicEmbedding
from distemb.optim import SparseAdagrad, SparseAdam
from distemb.stores import key_normal

pytestmark = pytest.mark.timeout(180)
N, D, B = 40, 4, 32


def dyadic_batch(step, n):
    """(rows, c) of step ``step``: zipf ranks over ``n`` rows, offsets in 1/8ths (sums of
    dyadic gradients are exact in any order)."""
    rng = np.random.default_rng(700 + step)
    return (rng.zipf(1.2, B) - 1) % n, rng.integers(-32, 33, (B, D)).astype(np.float32) / 8


def saving_job(t, ck, full, device=None):
    """Train table ``t`` with per-row Adam (three state columns, one of int64) on dyadic
    gradients; a full save of ``ck`` after step 3, incremental saves after steps 5 and 7
    and one of nothing, then a full save of ``full``. A hash table loses keys to remove()
    before the first delta and to evict() before the second: rank 0 returns how many."""
    def job(ctx, rank, num_trainers):
        emb = t.embedding(ctx)
        opt = SparseAdam([emb], lr=0.01, step_mode="per_row")
        ctx.client.barrier()
        per = B // num_trainers

        def train(steps):
            for step in steps:
                rows, c = dyadic_batch(step, t.n)
                share = slice(rank * per, (rank + 1) * per)
                keys = torch.from_numpy(t.key_of(rows[share]))
                opt.zero_grad()
                out = emb(keys, device=device)
                up = torch.from_numpy(c[share]).to(out.device) + torch.round(out.detach() * 8) / 8
                (out * up).sum().backward()
                opt.step()

        train(range(3))
        opt.save(ck)
        train(range(3, 5))
        gone = [0, 0]
        if t.store == "hash" and rank == 0:
            gone[0] = emb.remove(torch.from_numpy(t.key_of(np.arange(4))))
        ctx.client.barrier()
        opt.save(ck, incremental=True)
        train(range(5, 7))
        if t.store == "hash" and rank == 0:
            gone[1] = len(emb.evict(emb.size() - 5))
        ctx.client.barrier()
        opt.save(ck, incremental=True)
        opt.save(ck, incremental=True)  # nothing changed since
        opt.save(full)
        ctx.client.barrier()
        return gone
    return job


def loaded(t, path, tmp_path):
    """export() of a fresh embedded table of ``t``'s kind after ``opt.load(path)``."""
    if t.store == "file":  # its own files
        t = _copy(t)
        t.spec = dataclasses.replace(t.spec, path=str(tmp_path / f"load-{uuid.uuid4().hex[:6]}"))
    where = make_placement("embedded", None)
    try:
        def job(ctx, rank, num_trainers):
            emb = t.embedding(ctx)
            SparseAdam([emb], lr=0.01, step_mode="per_row").load(path)
        where.run(job)
        return where.client.export(t.name)
    finally:
        where.client.close()


def _copy(t):
    other = object.__new__(type(t))
    other.__dict__.update(t.__dict__)
    return other


def assert_same(got, want, what):
    keys, cols = got
    np.testing.assert_array_equal(keys, want[0], err_msg=f"{what}: keys")
    assert sorted(cols) == sorted(want[1]), what
    for c in cols:
        assert cols[c].dtype == want[1][c].dtype, (what, c)
        np.testing.assert_array_equal(cols[c], want[1][c], err_msg=f"{what}: {c}")


def test_base_and_deltas_load_as_the_full_save_at_the_same_step(placement, table_kind,
                                                                tmp_path):
    t = Table(table_kind, N, D, str(tmp_path))
    ck, full = str(tmp_path / "ck"), str(tmp_path / "full")
    gone = placement.run(saving_job(t, ck, full, device=placement.device))[0]
    live = placement.client.export(t.name)
    chain = loaded(t, ck, tmp_path)
    assert_same(chain, loaded(t, full, tmp_path), f"{placement.name} {table_kind}: "
                                                  "base + 3 deltas vs the full save")
    assert_same(chain, live, f"{placement.name} {table_kind}: base + 3 deltas vs the table")
    # the deltas are deltas: fewer rows than the table, the last none, keys removed
    head = checkpoint.read_meta(ck)
    assert len(head["links"]) == 3 and head["parent"] == head["links"][-1]
    links = [json.load(open(os.path.join(ck, f"link-{i}.json"))) for i in head["links"]]
    counts = [sum(r["count"] for r in m["tensors"][t.name]["shards"]) for m in links[1:]]
    assert 0 < counts[0] < len(live[0]) and 0 < counts[1] < len(live[0]), counts
    assert all(r["count"] == 0 for r in head["tensors"][t.name]["shards"])
    if t.store == "hash":
        tombstones = [sum((r.get("tombstones") or {}).get("count", 0)
                          for r in m["tensors"][t.name]["shards"]) for m in links[1:]]
        assert tombstones == gone and min(gone) > 0, (tombstones, gone)


def torch_adagrad(keys_of_steps, grads_of, init, lr):
    """Rows and Adagrad sums of ``torch.optim.Adagrad`` on ``nn.Embedding(sparse=True)``
    over the steps (each step's keys, and ``grads_of(step, rows) -> up``): {key: (row,
    sum)} of every key looked up."""
    keys = np.unique(np.concatenate(keys_of_steps))
    emb = torch.nn.Embedding(len(keys), D, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init(keys)))
    opt = torch.optim.Adagrad(emb.parameters(), lr=lr)
    for step, ks in enumerate(keys_of_steps):
        idx = torch.from_numpy(np.searchsorted(keys, ks))
        opt.zero_grad()
        out = emb(idx)
        (out * grads_of(step, out.detach())).sum().backward()
        opt.step()
    state = opt.state[emb.weight]["sum"]
    return {int(k): (emb.weight[i].detach().numpy(), state[i].numpy())
            for i, k in enumerate(keys)}


@pytest.mark.holding("hash-key")
def test_evicted_rows_reach_the_sink_in_order_and_the_chain_replays_the_evictions(
        placement, tmp_path):
    """A hash table of capacity 6 per shard (low water 1/2) sees 8 fresh keys a step for
    8 steps: lookups past the capacity evict, never a key of the step, and no evicted key
    comes back. Its sink directory then holds each evicted key once, every shard's in
    eviction (least recent first) order, and sink + table hold every key's row and
    Adagrad sum as torch has them; a full save after step 2 and deltas after steps 5 and
    8 load as a full save after step 8 does. (A device cache refuses a table that evicts
    on its own: tests/test_keyed_suite.py; with bounded staleness an update may reach a
    key after its eviction, so there the sink and the chain are checked, not torch.)"""
    if placement.refuser == "DeviceCachedKVClient":
        pytest.skip("a device cache refuses a table whose store evicts on its own "
                    "(tests/test_keyed_suite.py tests the refusal)")
    tag, sink = uuid.uuid4().hex[:8], str(tmp_path / "sink")
    ck, full = str(tmp_path / "ck"), str(tmp_path / "full")
    servers = placement.client.num_servers
    steps = [np.arange(8, dtype=np.int64) * 7919 + 10 ** 6 * s - 3 for s in range(8)]
    init = key_normal(D, seed=4)

    def up(step, out):
        c = torch.from_numpy(np.random.default_rng(step).integers(-8, 9, (8, D))
                             .astype(np.float32) / 8)
        return c + torch.round(out * 8) / 8

    def job(ctx, rank, num_trainers):
        emb = DynamicEmbedding(D, name=f"sunk-{tag}", init_func=init, capacity=6 * servers,
                               low_water=0.5, sink=sink, context=ctx)
        opt = SparseAdagrad([emb], lr=0.5)
        ctx.client.barrier()
        for step, keys in enumerate(steps):
            # every trainer looks every key up (so no trainer's lookup evicts a key another
            # has yet to update); rank 0's gradient is the step's, the others' are zeros
            opt.zero_grad()
            out = emb(torch.from_numpy(keys), device=placement.device)
            g = up(step, out.detach().cpu()) * (1.0 if rank == 0 else 0.0)
            (out * g.to(out.device)).sum().backward()
            opt.step()
            ctx.client.barrier()
            if step in (2, 5, 7):
                opt.save(ck, incremental=step != 2)
        opt.save(full)
        ctx.client.barrier()
        return emb.name

    name = placement.run(job)[0]
    live = placement.client.export(name)
    sunk = list(checkpoint.read_evicted(sink, name))
    keys = np.concatenate([k for _, k, _ in sunk])
    assert len(keys) > 8, "nothing was evicted: the test proves nothing"
    assert len(np.unique(keys)) == len(keys), "a key was sunk twice"
    assert not np.isin(keys, live[0]).any(), "a live key is in the sink"
    everything = np.concatenate(steps)
    assert sorted(np.concatenate([keys, live[0]]).tolist()) == sorted(everything.tolist())
    step_of = {int(k): s for s, ks in enumerate(steps) for k in ks}
    for part in {p for p, _, _ in sunk}:
        order = [step_of[int(k)] for p, ks, _ in sunk if p == part for k in ks]
        assert order == sorted(order), f"shard {part} sank keys out of eviction order"
    chain_rows = loaded_keyed(name, ck, init)
    assert_same(chain_rows, loaded_keyed(name, full, init), "base + 2 deltas vs the full save")
    assert_same(chain_rows, live, "base + 2 deltas vs the table")
    if placement.name.endswith("cache_stale"):
        return
    want = torch_adagrad(steps, up, init, lr=0.5)
    got = {int(k): (w, s) for _, ks, cols in sunk for k, w, s in
           zip(ks, cols["weight"], cols["sum"])}
    got.update({int(k): (w, s) for k, w, s in zip(live[0], live[1]["weight"], live[1]["sum"])})
    for k, (w, s) in want.items():
        np.testing.assert_array_equal(got[k][0], w, err_msg=f"row of key {k}")
        np.testing.assert_array_equal(got[k][1], s, err_msg=f"Adagrad sum of key {k}")


def loaded_keyed(name, path, init):
    """export() of a fresh embedded hash table ``name`` after ``opt.load(path)``."""
    where = make_placement("embedded", None)
    try:
        def job(ctx, rank, num_trainers):
            emb = DynamicEmbedding(D, name=name, init_func=init, context=ctx)
            SparseAdagrad([emb], lr=0.5).load(path)
        where.run(job)
        return where.client.export(name)
    finally:
        where.client.close()
