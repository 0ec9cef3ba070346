"""A DynamicEmbedding job for the cluster tests, and the embedded oracle it is compared with.

Run by distemb-launch: ``python tests/dynamic_trainer.py OUT_DIR [--steps N] [--start S]
[--save DIR] [--load DIR] [--kind hash|file]``. Four dynamic tables (SGD, Adagrad, row-wise Adagrad, Adam
with per-row steps: a float and an int64 state column) train on zipf-distributed,
duplicate-heavy batches of arbitrary int64 keys (negative ones and both int64 extremes
among them); each of the T trainers takes the r-th 1/T of every batch. Rank 0 writes
each table's ``export()`` to OUT_DIR/<table>.npz (and, with ``--load``, the export right
after loading to OUT_DIR/loaded-<table>.npz). With ``--kind file`` the tables are
file-backed (``StoreEmbedding(FileTableSpec(OUT_DIR/files/<table>, ...))``: one FileStore
per server holding a range of the keys 0..NUM_KEYS-1) and the batches use those keys.

Bit-identical by construction: the gradient of a looked-up row is ``c + round(8 row) / 8``
(``c`` a multiple of 1/8 drawn per step), a dyadic number of small magnitude, so sums of
duplicate keys are exact in float32 in any order (each trainer's partial sum, then the
server's sum of the trainers' sums, equals the one process's sum), and every update
rule runs elementwise with the same kernels on the same inputs. The gradient depends on
the rows looked up, so a wrong row on any server changes the result.
"""
import argparse
import os
import sys

import numpy as np
import torch

import distemb
from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD
from distemb.stores import key_normal
from distemb.stores.spec import FileTableSpec

NUM_KEYS, D, B = 300, 8, 64
OPTIMIZERS = {"sgd": lambda e: SparseSGD([e], lr=0.05),
              "adagrad": lambda e: SparseAdagrad([e], lr=0.1),
              "rowwise": lambda e: SparseRowWiseAdagrad([e], lr=0.1),
              "adam_row": lambda e: SparseAdam([e], lr=0.01, step_mode="per_row")}


def key_space():
    """NUM_KEYS distinct int64 keys: random over the whole range, plus the extremes
    (-2**63 and -2**63 + 1 are the hash index's reserved keys)."""
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(-2 ** 63 + 2, 2 ** 63 - 1, NUM_KEYS * 2, dtype=np.int64))
    keys = keys[rng.permutation(len(keys))][:NUM_KEYS - 4]
    return np.concatenate([[0, -1, 2 ** 63 - 1, -2 ** 63 + 2], keys]).astype(np.int64)


def batch(step, kind="hash"):
    """(keys, c) of step ``step``: zipf ranks over the key space, dyadic offsets."""
    rng = np.random.default_rng(500 + step)
    ranks = (rng.zipf(1.2, B) - 1) % NUM_KEYS
    c = rng.integers(-32, 33, (B, D)).astype(np.float32) / 8
    keys = key_space()[ranks] if kind == "hash" else ranks.astype(np.int64)
    return torch.from_numpy(keys), torch.from_numpy(c)


def make_tables(ctx, kind="hash", files=None):
    """The four tables: dynamic (``hash``) or file-backed under ``files`` (``file``)."""
    def make(i, k):
        init = key_normal(D, std=0.5, seed=i)
        if kind == "hash":
            return DynamicEmbedding(D, name=f"dyn-{k}", init_func=init, context=ctx)
        spec = FileTableSpec(os.path.join(files, k), num_rows=NUM_KEYS, dim=D, init=init,
                             preallocate=False)
        return StoreEmbedding(spec, name=f"dyn-{k}", context=ctx)
    embs = {k: make(i, k) for i, k in enumerate(OPTIMIZERS)}
    return embs, {k: OPTIMIZERS[k](e) for k, e in embs.items()}


def train(ctx, embs, opts, start, steps, rank, num_trainers, kind="hash"):
    per = B // num_trainers
    sl = slice(rank * per, (rank + 1) * per)
    for step in range(start, start + steps):
        keys, c = batch(step, kind)
        for k, emb in embs.items():
            opts[k].zero_grad()
            rows = emb(keys[sl])
            # dyadic gradients: see the module docstring
            up = c[sl] + torch.round(rows.detach() * 8) / 8
            (rows * up).sum().backward()
            opts[k].step()


def oracle(steps, start=0, kind="hash", files=None):
    """The embedded job on whole batches: {table: export()} (file tables under ``files``)."""
    ctx = distemb.DistContext.embedded(backend="pytorch", num_threads=1)
    embs, opts = make_tables(ctx, kind, files)
    train(ctx, embs, opts, start, steps, 0, 1, kind)
    out = {k: e.export() for k, e in embs.items()}
    ctx.close()
    return out


def write(path, data):
    np.savez(path, **data)


def main(args):
    ctx = distemb.initialize(backend="pytorch", num_threads=1)
    torch.set_num_threads(1)
    embs, opts = make_tables(ctx, args.kind, os.path.join(os.path.abspath(args.out), "files"))
    if args.load:
        for k, opt in opts.items():
            opt.load(os.path.join(args.load, k))
        if ctx.rank == 0:
            for k, e in embs.items():
                write(os.path.join(args.out, f"loaded-{k}.npz"), e.export())
    train(ctx, embs, opts, args.start, args.steps, ctx.rank, ctx.num_trainers, args.kind)
    if args.save:
        for k, opt in opts.items():
            opt.save(os.path.join(args.save, k))
    ctx.client.barrier()
    if ctx.rank == 0:
        for k, e in embs.items():
            write(os.path.join(args.out, f"{k}.npz"), e.export())
            print(f"table {k}: {e.size()} keys on {ctx.num_servers} servers")
    distemb.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--kind", choices=["hash", "file"], default="hash")
    main(parser.parse_args())
    sys.exit(0)
