"""bf16 / fp16 rows vs fp32 rows: the training step on bench_step.py's uniform case.

Contenders (the user-level step of bench_step.py, one thread, 1M x 128 table, batch
4096, uniform ids from a pool of 64 batches, timed in turns; medians, same-run ratios):
the dense ``DistEmbedding`` (float32, bench_step.py's contender) and ``StoreEmbedding``
on a ``DenseStore`` with float32, bfloat16 and float16 rows, each under SparseAdagrad
(float32 state of D floats per row: half rows save a quarter of the bytes) and
SparseRowWiseAdagrad (one float per row: half rows save nearly half).

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_half_step.py
"""
import argparse
import sys

import numpy as np
import torch

import bench_step as bstep
import bench_systems as bs
import distemb
from distemb import kernels
from distemb.stores import DenseStore, key_uniform

OPTIMIZERS = {"Adagrad": distemb.SparseAdagrad, "RowWiseAdagrad": distemb.SparseRowWiseAdagrad}


def store_step(dtype, opt_name, rows, batches, upstream):
    ctx = distemb.DistContext.embedded(num_threads=1)
    store = DenseStore(rows, upstream.shape[1], dtype=dtype,
                       init=key_uniform(upstream.shape[1], -0.01, 0.01))
    emb = distemb.StoreEmbedding(store, context=ctx)
    opt = OPTIMIZERS[opt_name]([emb], lr=0.01)
    for name, (shape, _) in store.columns().items():
        if name != "weight":
            store.column(name)[...] = 0  # touch the state's pages, as a trained table
    return bs.Contender(f"{opt_name} {dtype} rows", "step",
                        bs._user_step(emb, opt, batches, upstream), upstream.shape[0],
                        ctx.close, threads=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dist", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pool", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# bench_half_step: rows={args.rows} dim={args.dim} batch={args.batch} "
          f"dist={args.dist} 1 thread kernels={kernels.IMPL_NAME}")
    batches, upstream = bstep.inputs(args, args.dist)
    for opt_name in OPTIMIZERS:
        contenders = [store_step(d, opt_name, args.rows, batches, upstream)
                      for d in ("float32", "bfloat16", "float16")]
        if opt_name == "Adagrad":
            dense = bs.distemb_step("Adagrad", batches, upstream, args.rows, 1, "half")
            dense.name = "Adagrad DistEmbedding (fp32)"
            contenders.insert(0, dense)
        res = bstep.run_turns(args, contenders)
        base = res[f"{opt_name} float32 rows"][0]
        print(f"\n## {opt_name}")
        print(f"| {'table':<32} | {'steps/s':>8} | {'ids/s':>9} | {'vs fp32 rows':>12} |")
        print(f"|{'-' * 34}|{'-' * 10}|{'-' * 11}|{'-' * 14}|")
        for name, (rate, n, _) in res.items():
            print(f"| {name:<32} | {rate:>8.1f} | {rate * n:>9.3g} | {rate / base:>11.2f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
