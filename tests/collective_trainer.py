"""A collective-mode job for tests/test_collective.py, and the one-process oracle.

Run as one rank of a torch.distributed job (torchrun's environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): ``python tests/collective_trainer.py OUT_DIR [--steps N]
[--die-at STEP] [--timeout S]``. One dense table per optimizer distemb has (SGD, Adagrad,
row-wise Adagrad, Adam with global and per-row steps, FTRL; and Adagrad again on a
table sharded by a hash policy) trains on zipf-distributed,
duplicate-heavy batches of B ids; rank r takes the r-th 1/W of every batch, and on every
fifth step the last rank looks nothing up (it still takes part in the exchanges). Rank 0
writes each table's rows and optimizer state (``opt.state_dict()``, pulled collectively)
to OUT_DIR/<table>.npz. ``--die-at S``: the last rank (or ``--die-rank R``) exits
abruptly at step S; the others must raise KVStoreError naming it (they print it and exit
3). ``--mismatch``: rank 1
defines a table with another row length; ``--apart``: rank 0 alone reads a row before
training. Every rank must raise KVStoreError (printed, exit 3). ``--save DIR`` after
training, ``--load DIR`` before it (from step ``--start``): every optimizer's checkpoint
at DIR/<table>, collective (each rank writes and reads its own shards).

Bit-identical by construction (as the client suite's job in tests/test_kvclient_suite.py):
the gradient of a looked-up row is ``c + round(8 row) / 8`` with ``c`` a multiple of 1/8, a dyadic number of small
magnitude, so every sum of duplicate ids is exact in float32 in any order (each rank's
partial sums, then the owner's sum of the ranks' sums, equal the one process's sum), and
each owner runs the same update kernel on the same inputs. The gradient depends on the
rows looked up, so a wrong row from any owner changes the result.
"""
import argparse
import os
import sys

import numpy as np
import torch

import distemb
from distemb import DistEmbedding
from distemb.errors import KVStoreError
from distemb.optim import (SparseAdagrad, SparseAdam, SparseFtrl, SparseRowWiseAdagrad,
                           SparseSGD)
from distemb.partition import HashPartitionBook, PartitionPolicy

NUM, D, B = 300, 8, 64
OPTIMIZERS = {"sgd": lambda e: SparseSGD([e], lr=0.05),
              "adagrad": lambda e: SparseAdagrad([e], lr=0.1),
              "rowwise": lambda e: SparseRowWiseAdagrad([e], lr=0.1),
              "adam": lambda e: SparseAdam([e], lr=0.01),
              "adam_row": lambda e: SparseAdam([e], lr=0.01, step_mode="per_row"),
              "ftrl": lambda e: SparseFtrl([e], lr=0.1, l1_regularization_strength=0.01)}
#: Tables sharded by id modulo the partitions (the others: ranges).
HASHED = ("adagrad_hash",)
OPTIMIZERS["adagrad_hash"] = OPTIMIZERS["adagrad"]


def initial(i):
    """Table ``i``'s initial rows (pushed by every rank: a collective write)."""
    return torch.from_numpy(np.random.default_rng(i).normal(0, 0.5, (NUM, D))
                            .astype(np.float32))


def batch(step):
    """(ids, c) of step ``step``: zipf ranks over the rows, dyadic offsets."""
    rng = np.random.default_rng(900 + step)
    ids = (rng.zipf(1.2, B) - 1) % NUM
    c = rng.integers(-32, 33, (B, D)).astype(np.float32) / 8
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(c)


def rows_of(step, rank, world):
    """The batch rows rank ``rank`` of ``world`` looks up at ``step``."""
    if world > 1 and rank == world - 1 and step % 5 == 4:
        return slice(0, 0)
    per = B // world
    return slice(rank * per, (rank + 1) * per)


def make_tables(ctx, parts):
    """Every table, the ``HASHED`` ones by a hash policy of ``parts`` partitions."""
    embs = {}
    for i, k in enumerate(OPTIMIZERS):
        policy = None if k not in HASHED else PartitionPolicy(
            "node", "_N", HashPartitionBook(parts, node_counts={"_N": NUM}))
        embs[k] = DistEmbedding(NUM, D, name=f"coll-{k}", context=ctx, part_policy=policy)
        embs[k].weight[torch.arange(NUM)] = initial(i)
    return embs, {k: OPTIMIZERS[k](e) for k, e in embs.items()}


def train(embs, opts, steps, ranks, world, die_at=None, start=0):
    """Steps ``start``.. ``start + steps - 1``; ``ranks``: the ranks whose batch rows this
    process looks up (all of them: the oracle)."""
    for step in range(start, start + steps):
        if die_at == step:
            os._exit(9)
        ids, c = batch(step)
        sl = [rows_of(step, r, world) for r in ranks]
        mine = torch.cat([ids[s] for s in sl])
        cs = torch.cat([c[s] for s in sl])
        for k, emb in embs.items():
            opts[k].zero_grad()
            rows = emb(mine)
            up = cs + torch.round(rows.detach() * 8) / 8  # dyadic: see the docstring
            (rows * up).sum().backward()
            opts[k].step()


def snapshot(embs, opts):
    out = {}
    for k, emb in embs.items():
        state = opts[k].state_dict()["state"][emb.name]
        out[k] = {"weight": emb.weight[torch.arange(NUM)].numpy()}
        out[k].update({s: v.numpy() for s, v in state.items() if s != "step"})
    return out


def oracle(steps, world, load=None, then=()):
    """The same job in one embedded process on the concatenated batches: ``steps`` steps
    of ``world`` ranks (after loading checkpoint ``load``, when given), then each
    ``(steps, world)`` of ``then``."""
    ctx = distemb.DistContext.embedded(backend="pytorch", num_threads=1)
    embs, opts = make_tables(ctx, world)
    if load:
        for k, opt in opts.items():
            opt.load(os.path.join(load, k))
    start = 0
    for n, w in ((steps, world),) + tuple(then):
        train(embs, opts, n, range(w), w, start=start)
        start += n
    out = snapshot(embs, opts)
    ctx.close()
    return out


def main(args):
    torch.set_num_threads(1)
    ctx = distemb.initialize(backend="pytorch", num_threads=1, mode="collective",
                             timeout_s=args.timeout)
    world, rank = ctx.num_trainers, ctx.rank
    dying = world - 1 if args.die_rank is None else args.die_rank
    die_at = args.die_at if rank == dying else None
    try:
        if args.mismatch:
            DistEmbedding(NUM, D + (rank == 1), name="mismatched", context=ctx)
        embs, opts = make_tables(ctx, world)
        if args.apart and rank == 0:
            embs["sgd"].weight[torch.arange(3)]
        if args.load:
            for k, opt in opts.items():
                opt.load(os.path.join(args.load, k))
        train(embs, opts, args.steps, [rank], world, die_at, args.start)
        if args.save:
            for k, opt in opts.items():
                opt.save(os.path.join(args.save, k))
    except KVStoreError as e:
        print(f"rank {rank}: KVStoreError: {e}", flush=True)
        os._exit(3)
    out = snapshot(embs, opts)
    if rank == 0:
        for k, arrays in out.items():
            np.savez(os.path.join(args.out, f"{k}.npz"), **arrays)
    print(f"rank {rank} of {world}: done", flush=True)
    distemb.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--die-rank", type=int)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--apart", action="store_true")
    main(parser.parse_args())
    sys.exit(0)
