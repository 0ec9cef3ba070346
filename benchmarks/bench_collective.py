"""Collective mode (2 gloo ranks, no servers) against the server mode (2 servers x 2
trainers), DGL's KVStore (2 x 2) and the in-process store, in the same run; and grouped
exchanges (two tables in one exchange) against table-by-table exchanges.

The step of benchmarks/bench_kvstore.py (B uniform random rows of a (N, D) table,
backward of a sum, SparseAdagrad.step()), per configuration:

- ``in-process`` (baseline): the embedded store, one process;
- ``2 servers x 2 trainers, tcp`` / ``shm``: distemb-launch on 127.0.0.1, shared memory
  off / on (bench_kvstore's run_cluster);
- ``DGL 2 servers x 2 trainers``: DGL 1.1.3's dgl.distributed.DistEmbedding and
  SparseAdagrad (bench_kvstore --dgl's job, zero_grad() every step as DGL documents);
- ``collective, 2 ranks``: two processes with torchrun's environment,
  ``distemb.initialize(mode="collective")``, each holding half of the table;
- ``collective, 2 ranks, 2 tables``: the step on two such tables (B ids each), looked up
  and stepped table by table (a lookup and an optimizer each) or grouped
  (``distemb.grouped_lookup`` and one optimizer: one exchange per direction for both).

Configurations run in turns, ``--rounds`` times. Bytes per step: measured for collective
mode (what a rank sends to the other, ``CollectiveKVClient.bytes_sent``); for the server
mode over TCP, the payload a trainer sends and receives for the same step (B ids and B
rows, then U unique ids and U gradient rows, at 8 + 4 D bytes a row), computed; for DGL,
computed from its code (see ``dgl_bytes``).

Usage::

    PYTHONPATH=. python benchmarks/bench_collective.py [--steps 50] [--batch 4096]
        [--dim 128] [--rows 200000] [--rounds 3] [--no-dgl] [--only-tables]
        [--only tcp,shm,collective,dgl,by-table,grouped]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import distemb
from distemb.context import DistContext
from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_kvstore  # noqa: E402
import results  # noqa: E402


def train_two_tables(ctx, args, grouped):
    """Steps/s of the step of bench_kvstore.train on two tables (B ids each): looked up
    with one grouped lookup and stepped by one optimizer (one exchange per direction for
    both), or table by table (a lookup and an optimizer each: every exchange twice)."""
    rng = np.random.default_rng(ctx.rank)
    batches = [[torch.from_numpy(rng.integers(0, args.rows, args.batch)) for _ in range(2)]
               for _ in range(args.steps + args.warmup)]
    embs = [distemb.DistEmbedding(args.rows, args.dim, name=f"bench{t}", context=ctx,
                                  init_func=lambda s, d: torch.full(s, 0.01, dtype=d))
            for t in range(2)]
    opts = [distemb.SparseAdagrad(embs, lr=0.01)] if grouped else \
        [distemb.SparseAdagrad([e], lr=0.01) for e in embs]
    for i, ids in enumerate(batches):
        if i == args.warmup:
            ctx.client.barrier()
            start = time.perf_counter()
        for opt in opts:
            opt.zero_grad()
        if grouped:
            rows = distemb.grouped_lookup(list(zip(embs, ids)))
        else:
            rows = [e(x) for e, x in zip(embs, ids)]
        sum(r.sum() for r in rows).backward()
        for opt in opts:
            opt.step()
    ctx.client.barrier()
    return args.steps / (time.perf_counter() - start)


def step_args(args):
    """bench_kvstore's options for its step (train, run_cluster, run_dgl) at this run's
    sizes: every option it reads, not only the ones this script shares with it."""
    return bench_kvstore.step_args(steps=args.steps, warmup=args.warmup, batch=args.batch,
                                   dim=args.dim, rows=args.rows)


def rank_main(args):
    torch.set_num_threads(1)
    ctx = distemb.initialize(num_threads=1, mode="collective", timeout_s=120)
    ns = step_args(args)
    if args.tables == 1:
        rate = bench_kvstore.train(ctx, ns)
    else:
        rate = train_two_tables(ctx, args, args.grouped)
    steps = args.steps + args.warmup
    with open(os.path.join(args.out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"steps_per_s": rate, "bytes_per_step": ctx.client.bytes_sent / steps,
                   "exchanges_per_step": ctx.client.exchanges / steps}, f)
    distemb.shutdown()


def run_collective(args, world, tables=1, grouped=False):
    """``world`` ranks of this script with torchrun's environment: (steps/s, bytes/step)
    per rank."""
    with tempfile.TemporaryDirectory() as out:
        port = ports.free_port()
        argv = [sys.executable, os.path.abspath(__file__), "--rank-of-job", "--out", out,
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
                str(args.batch), "--dim", str(args.dim), "--rows", str(args.rows),
                "--tables", str(tables)] + (["--grouped"] if grouped else [])
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(world)]
        try:
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"rank pid {p.pid} exited {p.returncode}")
        finally:
            for p in procs:  # only the processes started here, by PID
                if p.poll() is None:
                    p.kill()
                    p.wait()
        got = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
        return [g["steps_per_s"] for g in got], [g["bytes_per_step"] for g in got]


def server_bytes(args):
    """A trainer's payload per step over TCP (computed): ids out, rows back, unique ids
    and gradients out, with U the expected unique count of B uniform draws from N."""
    row = 8 + 4 * args.dim
    unique = args.rows * (1 - (1 - 1 / args.rows) ** args.batch)
    return args.batch * 8 + args.batch * 4 * args.dim + unique * row


def dgl_bytes(args):
    """A DGL trainer's bytes through sockets per step, 2 x 2 on one machine (computed from
    DGL 1.1.3's code): lookups read the machine's partition from shared memory, and
    ``KVClient.push`` writes a local partition through shared memory too; what crosses a
    socket is the step's ``alltoallv`` of the uncoalesced ids and gradients to the trainer
    that updates them (ids modulo the trainers per server: half of B), and its counts."""
    return args.batch / 2 * (8 + 4 * args.dim) + 2 * 8


def run_dgl(args, workdir):
    """DGL's DistEmbedding + SparseAdagrad, 2 servers x 2 trainers (bench_kvstore's job,
    zero_grad() every step as DGL documents)."""
    return bench_kvstore.run_dgl(step_args(args), 2, 2, workdir), [dgl_bytes(args)] * 2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-dgl", action="store_true", help="leave DGL's 2 x 2 job out")
    p.add_argument("--only-tables", action="store_true",
                   help="only the two-table configurations (grouped vs table by table)")
    p.add_argument("--only", default=None, metavar="IDS",
                   help="only these configurations beside the in-process baseline, "
                        f"comma-separated, of {','.join(CONFIG_IDS)}")
    p.add_argument("--tables", type=int, default=1, choices=(1, 2), help=argparse.SUPPRESS)
    p.add_argument("--grouped", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank-of-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    results.add_arguments(p)
    args = p.parse_args()
    if args.rank_of_job:
        return rank_main(args)
    if args.only is not None:
        only = [c for c in args.only.split(",") if c]
        unknown = sorted(set(only) - set(CONFIG_IDS))
        if unknown or not only:
            p.error(f"--only: expected some of {','.join(CONFIG_IDS)}, got {args.only!r}")
    elif args.only_tables:
        only = ["by-table", "grouped"]
    else:
        only = [c for c in CONFIG_IDS if not (c == "dgl" and args.no_dgl)]
    torch.set_num_threads(1)
    ns = step_args(args)
    workdir = tempfile.TemporaryDirectory()
    # id -> (name, run, tables looked up per step, bytes label)
    every = {
        "tcp": (TCP, lambda: (bench_kvstore.run_cluster(ns, 2, 2, shm=False),
                              [server_bytes(args)] * 2), 1, "computed"),
        "shm": (SHM, lambda: (bench_kvstore.run_cluster(ns, 2, 2, shm=True), None), 1, ""),
        "collective": (COLLECTIVE, lambda: run_collective(args, 2), 1, "measured"),
        "dgl": (DGL, lambda: run_dgl(args, workdir.name), 1, "computed"),
        "by-table": (BY_TABLE, lambda: run_collective(args, 2, tables=2), 2, "measured"),
        "grouped": (GROUPED, lambda: run_collective(args, 2, tables=2, grouped=True), 2,
                    "measured")}
    if "dgl" in only:
        bench_kvstore.dgl_graph(args, workdir.name)
    configs = {every[c][0]: every[c][1:] for c in CONFIG_IDS if c in only}
    with results.Recorder("bench_collective", args) as rec:
        measure(args, ns, configs, rec)
    workdir.cleanup()


def measure(args, ns, configs, rec):
    """Every configuration in turns, ``args.rounds`` times; the table of medians."""
    rates = {name: [] for name in [BASE] + list(configs)}
    ratios = {name: [] for name in rates}
    sent = {name: [] for name in configs}
    for r in range(args.rounds):
        base = bench_kvstore.train(DistContext.embedded(num_threads=1), ns)
        rates[BASE].append([base])
        ratios[BASE].append(1.0)
        for name, (run, _, _) in configs.items():
            got, nbytes = run()
            rates[name].append(got)
            ratios[name].append(sum(got) / base)
            if nbytes is not None:
                sent[name].append(np.mean(nbytes))
        print(f"round {r + 1}/{args.rounds}: in-process {base:.1f}, " + ", ".join(
            f"{name} {np.mean(rates[name][-1]):.1f}" for name in configs) +
            f" steps/s; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\nB={args.batch} ids per table per trainer, D={args.dim}, N={args.rows} rows "
          f"per table, SparseAdagrad, steps={args.steps}, one thread per process, "
          f"{os.cpu_count()} cores, {args.rounds} round(s) in turns, medians\n")
    print("| configuration | steps/s per trainer | rows/s (all trainers) | vs 2 x 2 tcp | "
          "bytes sent per step per trainer |")
    print("|---|---|---|---|---|")
    for name in rates:
        tables = configs[name][1] if name in configs else 1
        label = configs[name][2] if name in configs else ""
        mean = float(np.median([np.mean(r) for r in rates[name]]))
        total = float(np.median([sum(r) for r in rates[name]])) * args.batch * tables
        vs_tcp = None if TCP not in rates else float(np.median(
            [sum(a) / sum(b) for a, b in zip(rates[name], rates[TCP])]))
        nbytes = sent.get(name) or []
        cell = "-" if not nbytes else f"{np.median(nbytes) / 1e6:.2f} MB ({label})"
        print(f"| {name} | {mean:.1f} | {total / 1e6:.2f} M | "
              f"{'-' if vs_tcp is None else f'{vs_tcp:.2f}x'} | {cell} |")
        key = bench_kvstore.slug(name)
        rec.figure(f"steps.{key}", mean, "{:.1f} steps/s", f"{name}: steps/s per trainer")
        if vs_tcp is not None:
            rec.figure(f"vs_tcp.{key}", vs_tcp, "{:.2f}x",
                       f"{name}: steps/s (all trainers) over the 2 x 2 TCP job's, same round")
        if nbytes:
            rec.figure(f"bytes_sent.{key}", float(np.median(nbytes)) / 1e6, "{:.2f} MB",
                       f"{name}: bytes sent per step per trainer ({label})")
    if GROUPED in rates and BY_TABLE in rates:
        gains = [sum(a) / sum(b) for a, b in zip(rates[GROUPED], rates[BY_TABLE])]
        print(f"\ngrouped vs table by table (2 tables, 2 ranks): {np.median(gains):.2f}x "
              f"steps/s (median of the rounds' ratios; each round: "
              f"{', '.join(f'{g:.2f}' for g in gains)})")
        rec.figure("grouped_vs_by_table", float(np.median(gains)), "{:.2f}x",
                   "two tables, 2 ranks: grouped exchanges' steps/s over table by table's")


BASE = "in-process, 1 table (baseline)"
TCP = "2 servers x 2 trainers, tcp"
SHM = "2 servers x 2 trainers, shm"
COLLECTIVE = "collective, 2 ranks"
DGL = "DGL 2 servers x 2 trainers"
BY_TABLE = "collective, 2 ranks, 2 tables, table by table"
GROUPED = "collective, 2 ranks, 2 tables, grouped"
#: --only's names of the configurations, in the order they run.
CONFIG_IDS = ("tcp", "shm", "collective", "dgl", "by-table", "grouped")


if __name__ == "__main__":
    main()
