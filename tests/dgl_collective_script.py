"""A training script written for ``dgl.distributed``, run under torchrun on distemb.

Two lines differ from DGL's idiom: the import (``import distemb.dgl as dist``) and the
initialize call (``dist.initialize(mode="collective")`` instead of
``dist.initialize("ip_config.txt")``: no servers, each rank holds a shard of every
table). Everything else is DGL's API: ``dist.DistEmbedding`` with an ``init_func``,
``dist.optim.SparseAdagrad``/``SparseAdam``, ``opt.zero_grad()`` every step, a
``DistTensor`` read by slice, ``dist.exit_client()``.

``python tests/dgl_collective_script.py OUT [--alone W]``: under torchrun, this rank
trains on its share (rank r of W takes the r-th 1/W of every batch) and rank 0 writes
OUT/tables.npz. With ``--alone W``: the same script in one process (standalone, no
initialize), looking up each of W ranks' shares in turn every step: the oracle (the
gradients are dyadic, as in tests/collective_trainer.py, so the sums are exact).
"""
import argparse
import os
import sys

import numpy as np
import torch

import distemb.dgl as dist

NUM, D, B, STEPS = 120, 6, 48, 8


def init_emb(shape, dtype):
    """DGL's examples' kind of initialiser (a constant: every shard the same rows)."""
    return torch.full(shape, 0.25, dtype=dtype)


def batch(step):
    rng = np.random.default_rng(50 + step)
    ids = torch.from_numpy(((rng.zipf(1.3, B) - 1) % NUM).astype(np.int64))
    c = torch.from_numpy(rng.integers(-16, 17, (B, D)).astype(np.float32) / 8)
    return ids, c


def main(out, ranks, world):
    node = dist.DistEmbedding(NUM, D, name="node_emb", init_func=init_emb)
    edge = dist.DistEmbedding(NUM // 2, D, name="edge_emb", init_func=init_emb)
    opt_node = dist.optim.SparseAdagrad([node], lr=0.1)
    opt_edge = dist.optim.SparseAdam([edge], lr=0.05)
    per = B // world
    for step in range(STEPS):
        ids, c = batch(step)
        opt_node.zero_grad()
        opt_edge.zero_grad()
        loss = 0
        for r in ranks:
            mine, cs = ids[r * per:(r + 1) * per], c[r * per:(r + 1) * per]
            for emb, keys in ((node, mine), (edge, mine // 2)):
                rows = emb(keys)
                loss = loss + (rows * (cs + torch.round(rows.detach() * 8) / 8)).sum()
        loss.backward()
        opt_node.step()
        opt_edge.step()
    got = {"node": node.weight[0:NUM].numpy(), "edge": edge.weight[0:NUM // 2].numpy()}
    if ranks[0] == 0:
        np.savez(os.path.join(out, "tables.npz"), **got)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--alone", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.alone:
        main(args.out, list(range(args.alone)), args.alone)
    else:
        ctx = dist.initialize(mode="collective")  # was: dist.initialize("ip_config.txt")
        main(args.out, [ctx.rank], ctx.num_trainers)
        dist.exit_client()
    sys.exit(0)
