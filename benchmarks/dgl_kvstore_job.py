"""One process of DGL 1.1.3's distributed KVStore job run by bench_kvstore.py --dgl.

DGL_ROLE=server: serve the partition. Otherwise a trainer: time the same step as
bench_kvstore.py (lookup, trivial backward, SparseAdagrad) on dgl.distributed's
DistEmbedding and print ``{"steps_per_s": ...}``. DGL pickles ``init_func`` to its
servers, so it is a module-level function here.
"""
import json
import os
import sys
import time

import numpy as np
import torch

import dgl


def init_emb(shape, dtype):
    return torch.full(shape, 0.01, dtype=dtype)


def train_step(emb, opt, ids):
    """One timed step, used as DGL documents its optimizer.

    DGL's optimizer needs zero_grad() every step: without it DGL 1.1.3 keeps its trace
    and re-applies every earlier lookup's gradient at each step() (the mistake that made
    this benchmark report 76x / 86x; tests/test_bench_baselines.py checks the step).
    """
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.step()


def main():
    torch.set_num_threads(1)
    dgl.distributed.initialize(os.environ["DGL_IP_CONFIG"])
    if os.environ["DGL_ROLE"] == "server":
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
        world_size=world)
    g = dgl.distributed.DistGraph("g")
    dim, batch = int(os.environ["BENCH_DIM"]), int(os.environ["BENCH_BATCH"])
    steps, warmup = int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_WARMUP"])
    emb = dgl.distributed.DistEmbedding(g.num_nodes(), dim, name="bench", init_func=init_emb)
    opt = dgl.distributed.optim.SparseAdagrad([emb], lr=0.01)
    rng = np.random.default_rng(rank)
    batches = [torch.from_numpy(rng.integers(0, g.num_nodes(), batch))
               for _ in range(steps + warmup)]
    for i, ids in enumerate(batches):
        if i == warmup:
            g.barrier()
            start = time.perf_counter()
        train_step(emb, opt, ids)
    g.barrier()
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
