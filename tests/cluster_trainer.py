"""A trainer of the cluster tests, and the single-process oracle it is compared with.

Run by distemb-launch: ``python tests/cluster_trainer.py OUT_DIR [--steps N]``. Each of
the T trainers takes its slice of every step's batch, trains a DistEmbedding with
SparseAdagrad, and rank 0 saves the final table to OUT_DIR/final.npy.

``disjoint`` batches (trainer r only sees ids with id % T == r) make the sync-mode
result independent of the order the servers apply the trainers' updates in.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

import distemb
from distemb.config import parse_cache_config
from distemb.context import DistContext
from distemb.kernels import reference
from distemb.kvstore.caches.trainer import CachedKVClient
from distemb.partition import range_policy
from distemb.stores import key_normal

N, D, B, LR = 40, 8, 24, 0.1


def batch(step, num_trainers, disjoint):
    """The whole batch of ``step``: (ids, targets), trainer r's slice is the r-th 1/T."""
    rng = np.random.default_rng(1000 + step)
    per, T = B // num_trainers, num_trainers
    if disjoint:
        ids = np.concatenate([rng.integers(0, N // T, per) * T + r for r in range(T)])
    else:
        ids = rng.integers(0, N, B)  # duplicate-heavy: 24 draws from 40 rows
    targets = rng.standard_normal((B, D)).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(targets)


def init(shape, dtype):
    """Deterministic initial rows (every trainer passes the same function)."""
    return torch.full(shape, 0.5, dtype=dtype)


def loss_of(rows, targets):
    # A sum over samples: the gradient of the whole batch is the sum of the slices'.
    return ((rows - targets) ** 2).sum()


def side_ids(step, ids, per):
    """The 'side' table: only rank 0 looks it up, and only on even steps."""
    return ids[:per] if step % 2 == 0 else None


#: ``--twins``: the same training on tables behind trainer caches, in the same job.
TWINS = {"exact": {"policy": "lfu", "rows": 12},
         "stale": {"policy": "lru", "rows": N, "staleness": 5}}


def dynamic_keys(ids):
    """``--dynamic``: the int64 key of each id (spread over the whole key space)."""
    return ids * 3_000_000_000_019 - 2 ** 62


def make_table(name, ctx, dynamic):
    """Table ``name`` of N rows: dense (rows 0..N-1, all at 0.5) or ``dynamic`` (a hash
    store per server, a key's first row from its key)."""
    if dynamic:
        return distemb.DynamicEmbedding(D, name=name, context=ctx,
                                        init_func=key_normal(D, std=0.1, seed=3))
    return distemb.DistEmbedding(N, D, name=name, init_func=init, context=ctx,
                                 part_policy=range_policy(N, ctx.num_servers))


def mid_step_push(ctx, table, step, ids, per):
    """``--push-every K``: on every K-th step, after every trainer looked its rows up and
    before any updates them, rank 1 writes 3 of rank 0's rows (a write outside the summed
    step: a copy rank 0 caches is then void, and its update must say so)."""
    ctx.client.barrier()
    if ctx.rank == 1:
        table.weight[ids[:3]] = torch.full((3, D), 0.25 + step / 100)
    ctx.client.barrier()


def train(out, steps, disjoint, side=False, twins=False, dynamic=False, push_every=0):
    ctx = distemb.initialize(backend="pytorch", num_threads=1)
    torch.set_num_threads(1)
    rank, T = ctx.rank, ctx.num_trainers
    key = dynamic_keys if dynamic else (lambda ids: ids)
    emb = make_table("emb", ctx, dynamic)
    tables = [emb]
    # Twins share the job's connections: a cache is a view of the trainer's client.
    caches = {k: CachedKVClient(ctx.client, parse_cache_config(v)) for k, v in TWINS.items()
              } if twins else {}
    twin_tables = {k: make_table(f"emb-{k}", DistContext(kv, backend="pytorch", num_threads=1),
                                 dynamic) for k, kv in caches.items()}
    twin_opts = {k: distemb.SparseAdagrad([t], lr=LR) for k, t in twin_tables.items()}
    if side:
        tables.append(distemb.DistEmbedding(N, D, name="side", init_func=init,
                                            part_policy=range_policy(N, ctx.num_servers)))
    opt = distemb.SparseAdagrad(tables, lr=LR)
    per = B // T
    stale_dev = 0.0  # the largest |stale twin's row - servers' row| it trained with
    for step in range(steps):
        ids, targets = batch(step, T, disjoint)
        ids = key(ids)
        sl = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        pushing = push_every and step % push_every == push_every - 1
        loss = loss_of(emb(ids[sl]), targets[sl])
        if pushing:
            mid_step_push(ctx, emb, step, ids, per)
        extra = side_ids(step, ids, per) if side and rank == 0 else None
        if extra is not None:
            loss = loss + loss_of(tables[1](extra), targets[:per])
        loss.backward()
        opt.step()
        for k, t in twin_tables.items():
            twin_opts[k].zero_grad()
            rows = t(ids[sl])
            if k == "stale":  # how far its rows are from the servers' rows, right now
                fresh = ctx.client.pull("emb-stale", ids[sl].numpy())
                stale_dev = max(stale_dev, float(np.abs(rows.detach().numpy() - fresh).max()))
            if pushing:
                mid_step_push(ctx, t, step, ids, per)
            loss_of(rows, targets[sl]).backward()
            twin_opts[k].step()
        if ctx.client.consistency == "sync":
            ctx.client.barrier()  # everyone pulls the same weights next step
    ctx.client.barrier()
    with open(os.path.join(out, f"cache{rank}.json"), "w") as f:
        json.dump(dict({k: kv.stats() for k, kv in caches.items()}, stale_dev=stale_dev), f)
    if rank == 0:
        every = key(torch.arange(N))
        for k, t in twin_tables.items():
            np.save(os.path.join(out, f"final-{k}.npy"), t.weight[every].numpy())
        np.save(os.path.join(out, "final.npy"), emb.weight[every].numpy())
        if side:
            np.save(os.path.join(out, "side.npy"), tables[1].weight[torch.arange(N)].numpy())
    distemb.shutdown()


def oracle_whole_batch(steps, side=False):
    """The sync_exact oracle: one embedded process trains on every step's whole batch.

    Returns:
        the final table, or (table, side table) with ``side``.
    """
    ctx = DistContext.embedded(backend="pytorch", num_threads=1)
    emb = distemb.DistEmbedding(N, D, name="oracle", init_func=init, context=ctx)
    side_emb = distemb.DistEmbedding(N, D, name="oracle-side", init_func=init, context=ctx)
    opt = distemb.SparseAdagrad([emb, side_emb] if side else [emb], lr=LR)
    for step in range(steps):
        ids, targets = batch(step, 2, disjoint=False)
        opt.zero_grad()
        loss = loss_of(emb(ids), targets)
        extra = side_ids(step, ids, B // 2) if side else None
        if extra is not None:
            loss = loss + loss_of(side_emb(extra), targets[:B // 2])
        loss.backward()
        opt.step()
    final = emb.weight[torch.arange(N)].numpy()
    return (final, side_emb.weight[torch.arange(N)].numpy()) if side else final


def oracle_sequential(steps, num_trainers=2):
    """The sync oracle (numpy): each trainer's update, from the same weights, one by one."""
    w = np.full((N, D), 0.5, np.float32)
    s = np.zeros_like(w)
    per = B // num_trainers
    for step in range(steps):
        ids, targets = (t.numpy() for t in batch(step, num_trainers, disjoint=True))
        slices = [slice(r * per, (r + 1) * per) for r in range(num_trainers)]
        grads = [(ids[sl], 2 * (w[ids[sl]] - targets[sl])) for sl in slices]
        for rows, g in grads:
            uniq, summed = reference.dedup_sum(rows, g)
            reference.adagrad_update(w, s, uniq, summed, LR, 1e-10)
    return w


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--disjoint", action="store_true")
    parser.add_argument("--side", action="store_true",
                        help="a second table that only rank 0 uses, on even steps")
    parser.add_argument("--twins", action="store_true",
                        help="also train copies of 'emb' behind the caches of TWINS")
    parser.add_argument("--dynamic", action="store_true",
                        help="the tables are DynamicEmbeddings keyed by dynamic_keys(id)")
    parser.add_argument("--push-every", type=int, default=0,
                        help="every K-th step rank 1 writes 3 of rank 0's rows mid-step")
    args = parser.parse_args()
    train(args.out, args.steps, args.disjoint, args.side, args.twins, args.dynamic,
          args.push_every)
    sys.exit(0)
