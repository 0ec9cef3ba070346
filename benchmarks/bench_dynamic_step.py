"""A training step on row-store tables vs the dense DistEmbedding, on the same ids.

Contenders (the user-level step of bench_step.py, SparseAdagrad, one thread):
the dense ``DistEmbedding`` (baseline); a ``DynamicEmbedding`` whose keys are the ids
0..N-1; a ``DynamicEmbedding`` whose keys are arbitrary int64 (a fixed random key per
row, mapped outside the timed step); and a ``StoreEmbedding`` on a ``FileStore`` in a
temporary directory (all pages resident: the cost of the mapping, not of the disk; see
bench_file_store.py for a table beyond RAM). Every table holds all N keys before
timing (the dynamic ones by an untimed upsert), and batches cycle through a pool as in
bench_step.py, timed in turns; cells are medians, ratios same-run.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_dynamic_step.py --dist uniform
"""
import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

import bench_step as bstep
import bench_systems as bs
import distemb
import results
from distemb import kernels
from distemb.stores import FileStore, key_uniform


def _fill(emb, keys, dim):
    """Insert every key with a small uniform row (untimed): the table is fully grown."""
    rng = np.random.default_rng(1)
    for lo in range(0, len(keys), 1 << 16):
        k = keys[lo:lo + (1 << 16)]
        emb.upsert(torch.from_numpy(k), torch.from_numpy(
            rng.uniform(-0.01, 0.01, (len(k), dim)).astype(np.float32)))


def dynamic_step(name, keys, batches, upstream, tag):
    ctx = distemb.DistContext.embedded(num_threads=1)
    emb = distemb.DynamicEmbedding(upstream.shape[1], name=f"dyn-{tag}", context=ctx)
    _fill(emb, keys, upstream.shape[1])
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    mapped = [torch.from_numpy(keys[b.numpy()]) for b in batches]
    return bs.Contender(name, "step", bs._user_step(emb, opt, mapped, upstream),
                        upstream.shape[0], ctx.close, threads=1)


def file_step(rows, batches, upstream, tmp):
    ctx = distemb.DistContext.embedded(num_threads=1)
    store = FileStore(os.path.join(tmp, "table"), num_rows=rows, dim=upstream.shape[1],
                      init=key_uniform(upstream.shape[1], -0.01, 0.01))
    emb = distemb.StoreEmbedding(store, name="file", context=ctx)
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    opt_state = store.column("sum")
    opt_state[:] = 0  # touch every page: resident, as the in-memory tables
    return bs.Contender("FileStore (resident)", "step",
                        bs._user_step(emb, opt, batches, upstream), upstream.shape[0],
                        ctx.close, threads=1)


#: Each table's name in the figures.
KEYS = {"dense DistEmbedding": "dense", "DynamicEmbedding keys 0..N-1": "dynamic_seq",
        "DynamicEmbedding int64 keys": "dynamic_int64", "FileStore (resident)": "filestore"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dist", choices=["uniform", "zipf", "both"], default="both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pool", type=int, default=64)
    results.add_arguments(p)
    args = p.parse_args(argv)
    with results.Recorder("bench_dynamic_step", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Every table kind's step in turns, per id distribution; a table each."""
    torch.set_num_threads(1)
    print(f"# bench_dynamic_step: rows={args.rows} dim={args.dim} batch={args.batch} "
          f"SparseAdagrad, 1 thread, kernels={kernels.IMPL_NAME}")
    rng = np.random.default_rng(5)
    random_keys = np.unique(rng.integers(-2 ** 62, 2 ** 62, args.rows + 1000))[:args.rows]
    random_keys = random_keys[rng.permutation(args.rows)]
    tmp = tempfile.mkdtemp(prefix="bench-dyn-", dir=os.environ.get("BENCH_DIR"))
    try:
        for dist in (["uniform", "zipf"] if args.dist == "both" else [args.dist]):
            batches, upstream = bstep.inputs(args, dist)
            contenders = [
                bs.distemb_step("Adagrad", batches, upstream, args.rows, 1, dist),
                dynamic_step("DynamicEmbedding keys 0..N-1",
                             np.arange(args.rows, dtype=np.int64), batches, upstream,
                             f"seq-{dist}"),
                dynamic_step("DynamicEmbedding int64 keys", random_keys, batches, upstream,
                             f"rand-{dist}"),
                file_step(args.rows, batches, upstream, tmp),
            ]
            contenders[0].name = "dense DistEmbedding"
            res = bstep.run_turns(args, contenders)
            base = res["dense DistEmbedding"][0]
            print(f"\n## dist={dist}")
            print(f"| {'table':<30} | {'steps/s':>8} | {'ids/s':>9} | {'dense / this':>12} |")
            print(f"|{'-' * 32}|{'-' * 10}|{'-' * 11}|{'-' * 14}|")
            for name, (rate, rows, _) in res.items():
                if name == bstep.HUGE_KEY:
                    continue
                print(f"| {name:<30} | {rate:>8.1f} | {rate * rows:>9.3g} "
                      f"| {base / rate:>11.2f}x |")
                key = KEYS[name]
                rec.figure(f"steps.{key}.{dist}", rate, "{:.1f} steps/s", f"{name}, {dist} ids")
                rec.figure(f"time_vs_dense.{key}.{dist}", base / rate, "{:.2f}x",
                           f"{name}: step time over the dense table's, {dist} ids, same run")
            sys.stdout.flush()
            shutil.rmtree(os.path.join(tmp, "table"), ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
