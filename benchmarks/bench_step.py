"""Sparse-step throughput of distemb against torch, DGL and a measured memory roofline.

One run builds, for each id distribution and thread count, every contender of
:mod:`bench_systems` on the same table size and the same id batches, then times them in
turns (one repeat of each, then the next repeat) so that load from other processes hits
all of them alike. A repeat's rate is 1 / (median time of its ``--steps`` calls); each
cell is the median over ``--repeats``. Ratios are same-run: a contender's steps/s over
the baseline's. Thread scaling is its own block, the thread counts timed in turns.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_step.py --threads 1 2
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import bench_systems as bs
from distemb import kernels

BASE_TORCH = "torch Adagrad"
BASE_DGL = "DGL SparseAdagrad"
SAME_RULE = {"distemb Adagrad": "torch Adagrad", "distemb Adam": "torch SparseAdam"}
ZIPF_A = 1.1  # ~57% unique ids in a batch of 4096 from 1M rows


def id_batches(dist, num_rows, batch, count, seed=0):
    """``count`` int64 id batches; zipf ranks are scattered by a fixed permutation,
    so hot ids are spread over the table as node ids of a real graph are."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        ids = rng.integers(0, num_rows, (count, batch))
    else:
        ranks = (rng.zipf(ZIPF_A, (count, batch)) - 1) % num_rows
        ids = rng.permutation(num_rows)[ranks]
    return [torch.from_numpy(np.ascontiguousarray(b, dtype=np.int64)) for b in ids]


def time_calls(contender, start, steps):
    """Calls per second of ``steps`` consecutive calls from batch ``start`` on.

    Each call is timed alone and the rate is 1 / median call time: on machines shared
    with other jobs, a call that lost the core to another process says nothing about
    this code, and every call here does the same work.
    """
    if contender.threads is not None:
        torch.set_num_threads(contender.threads)
    times = []
    for k in range(start, start + steps):
        t0 = time.perf_counter()
        contender.run(k)
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times)


def build(args, dist, threads, batches, upstream, tag):
    """Every contender for one (distribution, thread count)."""
    out = [bs.distemb_step(name, batches, upstream, args.rows, threads, tag)
           for name in bs.DISTEMB_OPTIMIZERS]
    out += [bs.torch_step("Adagrad", batches, upstream, args.rows),
            bs.torch_step("SparseAdam", batches, upstream, args.rows)]
    if args.dgl:
        out.append(bs.dgl_step(batches, upstream, args.rows, tag, args.ip_config))
    out += bs.kernel_contenders(batches, upstream, args.rows, threads)
    return out


def measure(args, dist, threads):
    """steps/s medians of every contender for one (distribution, thread count)."""
    torch.set_num_threads(threads)
    batches, upstream = inputs(args, dist)
    return run_turns(args, build(args, dist, threads, batches, upstream, f"{dist}-{threads}"))


def measure_threads(args, dist):
    """distemb Adagrad at each thread count, timed in turns (same load for each)."""
    batches, upstream = inputs(args, dist)
    contenders = []
    for t in args.threads:
        c = bs.distemb_step("Adagrad", batches, upstream, args.rows, t, f"{dist}-scaling-{t}")
        c.name = f"distemb Adagrad {t} thread(s)"
        contenders.append(c)
    return run_turns(args, contenders)


def inputs(args, dist):
    """The id batches and the upstream gradient every contender of a block shares."""
    batches = id_batches(dist, args.rows, args.batch, args.pool)
    upstream = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
    return batches, upstream


def run_turns(args, contenders):
    """Warm up, then time one repeat of each contender in turn; medians per contender."""
    cursor = [0] * len(contenders)
    for i, c in enumerate(contenders):  # warm-up: first touches, lazy state, caches
        time_calls(c, 0, args.warmup)
        cursor[i] = args.warmup
    rates = [[] for _ in contenders]
    for _ in range(args.repeats):
        for i, c in enumerate(contenders):
            rates[i].append(time_calls(c, cursor[i], args.steps))
            cursor[i] += args.steps
    result = {c.name: (statistics.median(r), c.rows_per_call, c.kind)
              for c, r in zip(contenders, rates)}
    for c in contenders:
        c.close()
    del contenders
    gc.collect()
    return result


def ratio(res, name, base):
    return f"{res[name][0] / res[base][0]:.2f}x" if base in res else "-"


def print_table(dist, threads, res):
    """One block of the table: steps/s, rows/s and same-run ratios."""
    print(f"\n## dist={dist} threads={threads}")
    print(f"| {'contender':<30} | {'calls/s':>9} | {'rows/s':>11} | {'vs torch':>8} "
          f"| {'vs torch same rule':>18} | {'vs DGL':>7} | {'of roofline':>11} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 20}|{'-' * 9}|{'-' * 13}|")
    t_gather = 1 / max(res["roofline gather (np.take)"][0], res["kernel gather_rows"][0])
    t_rmw = 1 / res["roofline rmw w,s (w[r]-=0*g)"][0]
    roofline_of = {
        "distemb Adagrad": 1 / (t_gather + t_rmw),  # memory-only step: gather + rmw
        "kernel adagrad_update": 1 / t_rmw,
        "kernel gather_rows": res["roofline gather (np.take)"][0],
    }
    for name, (rate, rows, kind) in res.items():
        step = kind == "step"
        roof = f"{rate / roofline_of[name]:.0%}" if name in roofline_of else ""
        same = ratio(res, name, SAME_RULE[name]) if name in SAME_RULE else ""
        print(f"| {name:<30} | {rate:>9.1f} | {rate * rows:>11.3g} "
              f"| {ratio(res, name, BASE_TORCH) if step else '':>8} | {same:>18} "
              f"| {ratio(res, name, BASE_DGL) if step else '':>7} | {roof:>11} |")
    sys.stdout.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=128, help="embedding dim")
    p.add_argument("--batch", type=int, default=4096, help="ids per step (with duplicates)")
    p.add_argument("--dist", choices=["uniform", "zipf", "both"], default="both")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="OpenMP / torch threads, one measurement block each")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    p.add_argument("--steps", type=int, default=40, help="calls per timed repeat")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--pool", type=int, default=64,
                   help="distinct id batches cycled through (64 x 4096 rows >> L3)")
    p.add_argument("--no-dgl", dest="dgl", action="store_false", help="skip the DGL baseline")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dgl and not bs.dgl_available():
        print("DGL not importable: DGL baseline skipped")
        args.dgl = False
    args.ip_config = os.path.join(tempfile.mkdtemp(prefix="bench-dgl-"), "ip_config.txt")
    print(f"# bench_step: rows={args.rows} dim={args.dim} batch={args.batch} "
          f"repeats={args.repeats} steps={args.steps} kernels={kernels.IMPL_NAME} "
          f"isa={kernels.ISA or '-'} (this CPU runs {kernels.available_cpu_isas()}) "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}")
    print("# calls/s: steps/s for full steps, kernel calls/s for kernels; rows/s: ids "
          "looked up per s (steps, gathers, dedup) or unique rows updated per s (updates)")
    dists = ["uniform", "zipf"] if args.dist == "both" else [args.dist]
    for dist in dists:
        for threads in args.threads:
            print_table(dist, threads, measure(args, dist, threads))
    if len(args.threads) > 1:
        print("\n## thread scaling, timed in turns: distemb Adagrad steps/s (medians)")
        for dist in dists:
            res = measure_threads(args, dist)
            rates = [r for r, _, _ in res.values()]
            cells = "  ".join(f"{name}: {r:.1f}" for name, r in zip(res, rates))
            print(f"{dist}: {cells}  (last/first = {rates[-1] / rates[0]:.2f}x)")
    sys.stdout.flush()
    if args.dgl:
        # DGL's DistTensor.__del__ raises in standalone mode at interpreter exit
        # (its fake KVStore is torn down first): skip that noise, results are printed.
        os._exit(0)


if __name__ == "__main__":
    main()
