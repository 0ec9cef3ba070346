"""Sparse-step throughput of distemb against torch, DGL and a measured memory roofline.

One run builds, for each id distribution and thread count, every contender of
:mod:`bench_systems` on the same table size and the same id batches, then times them in
turns (one repeat of each, then the next repeat) so that load from other processes hits
all of them alike. A repeat's rate is 1 / (median time of its ``--steps`` calls); each
cell is the median over ``--repeats``. Ratios are same-run: a contender's steps/s over
the baseline's. Thread scaling is its own block, the thread counts timed in turns.

A process's rates depend on where its tables landed in physical memory (2 MiB or 4 KiB
pages, distemb/pages.py), so the whole run is repeated in ``--processes`` fresh
processes, one after another: each prints one line (its distemb/torch/DGL ratios and how
much of its memory is on huge pages), then the tables give the median over processes of
each cell and, per contender, the spread of its calls/s across processes
((max - min) / median).

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_step.py --threads 1 2
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import bench_systems as bs
import results
from distemb import kernels

BASE_TORCH = "torch Adagrad"
BASE_DGL = "DGL SparseAdagrad"
SAME_RULE = {"distemb Adagrad": "torch Adagrad", "distemb Adam": "torch SparseAdam"}
FINITE_ON = "distemb Adagrad, finite check"
ZIPF_A = 1.1  # ~57% unique ids in a batch of 4096 from 1M rows (1.2: ~33%)


def id_batches(dist, num_rows, batch, count, seed=0, zipf_a=ZIPF_A):
    """``count`` int64 id batches; zipf(``zipf_a``) ranks are scattered by a fixed
    permutation, so hot ids are spread over the table as node ids of a real graph are."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        ids = rng.integers(0, num_rows, (count, batch))
    else:
        ranks = (rng.zipf(zipf_a, (count, batch)) - 1) % num_rows
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
    out.append(bs.distemb_finite_check_on(out[list(bs.DISTEMB_OPTIMIZERS).index("Adagrad")]))
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
    batches = id_batches(dist, args.rows, args.batch, args.pool,
                         zipf_a=getattr(args, "zipf_a", ZIPF_A))  # bench_half_step has none
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
    result[HUGE_KEY] = (huge_page_share(), 0, "memory")
    for c in contenders:
        c.close()
    del contenders
    gc.collect()
    return result


HUGE_KEY = "share of anonymous memory on huge pages"


def huge_page_share():
    """AnonHugePages / Anonymous of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if ":" in line
                  and line.split()[-1] == "kB"}
        return kb.get("AnonHugePages", 0) / max(1, kb.get("Anonymous", 0))
    except OSError:
        return 0.0


def ratio(res, name, base):
    return f"{res[name][0] / res[base][0]:.2f}x" if base in res else "-"


def spread(values):
    """(max - min) / median of one contender's rates across processes."""
    return (max(values) - min(values)) / statistics.median(values)


def combine(runs):
    """Per block, the median over processes of each cell, and each contender's spread.

    ``runs``: one ``[(title, dist, threads, res), ...]`` per process (same blocks).
    Returns ``[(dist, threads, res, spreads)]``; ``res`` as one process's, ratios taken
    from the medians.
    """
    out = []
    for blocks in zip(*runs):
        dist, threads = blocks[0][1], blocks[0][2]
        res, spreads = {}, {}
        for name, (_, rows, kind) in blocks[0][3].items():
            rates = [b[3][name][0] for b in blocks]
            res[name] = (statistics.median(rates), rows, kind)
            spreads[name] = spread(rates) if min(rates) > 0 else 0.0
        out.append((dist, threads, res, spreads))
    return out


def print_table(dist, threads, res, spreads=None, processes=1):
    """One block of the table: steps/s, rows/s and same-run ratios (medians over
    ``processes`` processes, with each contender's spread across them)."""
    res = {k: v for k, v in res.items() if k != HUGE_KEY}
    over = f" (median of {processes} processes)" if processes > 1 else ""
    print(f"\n## dist={dist} threads={threads}{over}")
    print(f"| {'contender':<30} | {'calls/s':>9} | {'rows/s':>11} | {'vs torch':>8} "
          f"| {'vs torch same rule':>18} | {'vs DGL':>7} | {'of roofline':>11} "
          f"| {'spread':>6} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 20}|{'-' * 9}|{'-' * 13}"
          f"|{'-' * 8}|")
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
        spr = f"{spreads[name]:.0%}" if spreads else ""
        print(f"| {name:<30} | {rate:>9.1f} | {rate * rows:>11.3g} "
              f"| {ratio(res, name, BASE_TORCH) if step else '':>8} | {same:>18} "
              f"| {ratio(res, name, BASE_DGL) if step else '':>7} | {roof:>11} "
              f"| {spr:>6} |")
    if FINITE_ON in res:
        print(f"\ndistemb Adagrad with check_finite=True (step() refuses NaN and infinite "
              f"gradients): {ratio(res, FINITE_ON, 'distemb Adagrad')} the calls/s of the "
              f"same step without it (the default)")
    sys.stdout.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=128, help="embedding dim")
    p.add_argument("--batch", type=int, default=4096, help="ids per step (with duplicates)")
    p.add_argument("--dist", choices=["uniform", "zipf", "both"], default="both")
    p.add_argument("--zipf-a", type=float, default=ZIPF_A,
                   help="the zipf exponent of --dist zipf (1.1: ~57%% of a batch's ids "
                        "distinct, 1.2: ~33%%)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="OpenMP / torch threads, one measurement block each")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    p.add_argument("--steps", type=int, default=40, help="calls per timed repeat")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--pool", type=int, default=64,
                   help="distinct id batches cycled through (64 x 4096 rows >> L3)")
    p.add_argument("--no-dgl", dest="dgl", action="store_false", help="skip the DGL baseline")
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes that each run everything, one after another "
                        "(medians and spread over them)")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a child's results
    results.add_arguments(p)
    return p.parse_args(argv)


def run_blocks(args):
    """Every block of one process: ``[(title, dist, threads, res), ...]``."""
    dists = ["uniform", "zipf"] if args.dist == "both" else [args.dist]
    blocks = [(f"{dist}-{t}", dist, t, measure(args, dist, t))
              for dist in dists for t in args.threads]
    if len(args.threads) > 1:
        blocks += [(f"scaling-{dist}", dist, "scaling", measure_threads(args, dist))
                   for dist in dists]
    return blocks


def process_line(k, blocks):
    """One process's summary: distemb Adagrad against torch and DGL per block."""
    cells = []
    for _, dist, threads, res in blocks:
        if threads == "scaling":
            continue
        cell = f"{dist}/{threads}t: {res['distemb Adagrad'][0]:.0f} steps/s " \
               f"{ratio(res, 'distemb Adagrad', BASE_TORCH)} torch"
        if BASE_DGL in res:
            cell += f" {ratio(res, 'distemb Adagrad', BASE_DGL)} DGL"
        cells.append(cell + f", {res[HUGE_KEY][0]:.0%} of anon memory on huge pages")
    return f"process {k}: " + "; ".join(cells)


def run_processes(args, argv):
    """Run everything in ``args.processes`` fresh child processes; their blocks."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        for k in range(args.processes):
            path = os.path.join(tmp, f"{k}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--processes", "1",
                   "--json", path]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
            with open(path) as f:
                blocks = [(t, d, th, {n: tuple(v) for n, v in res.items()})
                          for t, d, th, res in json.load(f)]
            print(process_line(k, blocks))
            sys.stdout.flush()
            runs.append(blocks)
    return runs


def name_figures(rec, dist, threads, res):
    """The figures of one block the documentation quotes (medians over processes)."""
    where = f"{dist} ids, {threads} thread(s)"
    rec.figure(f"adagrad_steps.{dist}.{threads}t", res["distemb Adagrad"][0], "{:.0f} steps/s",
               f"distemb Adagrad, {where}")
    for name in bs.DISTEMB_OPTIMIZERS:
        key = name.lower()
        rec.figure(f"{key}_vs_torch.{dist}.{threads}t",
                   res[f"distemb {name}"][0] / res[BASE_TORCH][0], "{:.2f}x",
                   f"distemb {name} steps/s over torch Adagrad's, {where}")
        if BASE_DGL in res:
            rec.figure(f"{key}_vs_dgl.{dist}.{threads}t",
                       res[f"distemb {name}"][0] / res[BASE_DGL][0], "{:.2f}x",
                       f"distemb {name} steps/s over DGL SparseAdagrad's, {where}")
    if FINITE_ON in res:
        rec.figure(f"finite_check_vs_off.{dist}.{threads}t",
                   res[FINITE_ON][0] / res["distemb Adagrad"][0], "{:.2f}x",
                   f"distemb Adagrad with check_finite=True: its steps/s over the same step "
                   f"without the check, {where}")
    rec.figure(f"adagrad_update_of_roofline.{dist}.{threads}t",
               res["kernel adagrad_update"][0] / res["roofline rmw w,s (w[r]-=0*g)"][0],
               "{:.0%}", f"the fused Adagrad kernel's rate over a read-modify-write pass, {where}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.dgl and not bs.dgl_available():
        if args.json is None:
            print("DGL not importable: DGL baseline skipped")
        args.dgl = False
    args.ip_config = os.path.join(tempfile.mkdtemp(prefix="bench-dgl-"), "ip_config.txt")
    if args.json is not None:  # a child: measure, hand the results back, print nothing
        with open(args.json, "w") as f:
            json.dump(run_blocks(args), f)
        sys.stdout.flush()
        os._exit(0)  # DGL's DistTensor.__del__ raises at interpreter exit (standalone)
    with results.Recorder("bench_step", args, argv) as rec:
        report(args, argv, rec)
    if args.dgl:
        # DGL's DistTensor.__del__ raises in standalone mode at interpreter exit
        # (its fake KVStore is torn down first): skip that noise, results are printed.
        os._exit(0)


def report(args, argv, rec):
    """Measure (in this process or in fresh ones), print the tables, name the figures."""
    print(f"# bench_step: rows={args.rows} dim={args.dim} batch={args.batch} "
          f"zipf_a={args.zipf_a} "
          f"repeats={args.repeats} steps={args.steps} processes={args.processes} "
          f"kernels={kernels.IMPL_NAME} isa={kernels.ISA or '-'} (this CPU runs "
          f"{kernels.available_cpu_isas()}) OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '')}")
    print("# calls/s: steps/s for full steps, kernel calls/s for kernels; rows/s: ids "
          "looked up per s (steps, gathers, dedup) or unique rows updated per s (updates); "
          "spread: (max - min) / median of calls/s across the processes")
    if args.processes > 1:
        runs = run_processes(args, [a for a in argv])
    else:
        runs = [run_blocks(args)]
    for dist, threads, res, spreads in combine(runs):
        if threads == "scaling":
            continue
        print_table(dist, threads, res, spreads if len(runs) > 1 else None, len(runs))
        name_figures(rec, dist, threads, res)
    scaling = [(dist, res) for dist, threads, res, _ in combine(runs) if threads == "scaling"]
    if scaling:
        print("\n## thread scaling, timed in turns: distemb Adagrad steps/s (medians)")
        for dist, res in scaling:
            named = [(n, r) for n, (r, _, _) in res.items() if n != HUGE_KEY]
            rates = [r for _, r in named]
            cells = "  ".join(f"{name}: {r:.1f}" for name, r in named)
            print(f"{dist}: {cells}  (last/first = {rates[-1] / rates[0]:.2f}x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
