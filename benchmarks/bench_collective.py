"""Collective mode (2 gloo ranks, no servers) against the server mode (2 servers x 2
trainers) and the in-process store, in the same run.

The step of benchmarks/bench_kvstore.py (B uniform random rows of a (N, D) table,
backward of a sum, SparseAdagrad.step()), per configuration:

- ``in-process`` (baseline): the embedded store, one process;
- ``2 servers x 2 trainers, tcp`` / ``shm``: distemb-launch on 127.0.0.1, shared memory
  off / on (bench_kvstore's run_cluster);
- ``collective, 2 ranks``: two processes with torchrun's environment,
  ``distemb.initialize(mode="collective")``, each holding half of the table.

Configurations run in turns, ``--rounds`` times, each round against its own in-process
baseline. Bytes per step: measured for collective mode (what a rank sends to the other,
``CollectiveKVClient.bytes_sent``); for the server mode over TCP, the payload a trainer
sends and receives for the same step (B ids and B rows, then U unique ids and U gradient
rows, at 8 + 4 D bytes a row), computed, not measured.

Usage::

    PYTHONPATH=. python benchmarks/bench_collective.py [--steps 50] [--batch 4096]
        [--dim 128] [--rows 200000] [--rounds 3]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import distemb
from distemb.context import DistContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_kvstore  # noqa: E402


def rank_main(args):
    torch.set_num_threads(1)
    ctx = distemb.initialize(num_threads=1, mode="collective", timeout_s=120)
    ns = argparse.Namespace(**{**vars(args), "dynamic_table": False})
    rate = bench_kvstore.train(ctx, ns)
    steps = args.steps + args.warmup
    with open(os.path.join(args.out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"steps_per_s": rate, "bytes_per_step": ctx.client.bytes_sent / steps}, f)
    distemb.shutdown()


def run_collective(args, world):
    """``world`` ranks of this script with torchrun's environment: (steps/s, bytes/step)
    per rank."""
    with tempfile.TemporaryDirectory() as out:
        port = bench_kvstore.free_port()
        argv = [sys.executable, os.path.abspath(__file__), "--rank-of-job", "--out", out,
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
                str(args.batch), "--dim", str(args.dim), "--rows", str(args.rows)]
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank-of-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of_job:
        return rank_main(args)
    torch.set_num_threads(1)
    ns = argparse.Namespace(**{**vars(args), "dynamic_table": False})
    configs = {"2 servers x 2 trainers, tcp": lambda: (bench_kvstore.run_cluster(
                   ns, 2, 2, shm=False), [server_bytes(args)] * 2),
               "2 servers x 2 trainers, shm": lambda: (bench_kvstore.run_cluster(
                   ns, 2, 2, shm=True), None),
               "collective, 2 ranks": lambda: run_collective(args, 2)}
    rates = {name: [] for name in ["in-process (baseline)"] + list(configs)}
    ratios = {name: [] for name in rates}
    sent = {name: [] for name in configs}
    for r in range(args.rounds):
        base = bench_kvstore.train(DistContext.embedded(num_threads=1), ns)
        rates["in-process (baseline)"].append([base])
        ratios["in-process (baseline)"].append(1.0)
        for name, run in configs.items():
            got, nbytes = run()
            rates[name].append(got)
            ratios[name].append(sum(got) / base)
            if nbytes is not None:
                sent[name].append(np.mean(nbytes))
        print(f"round {r + 1}/{args.rounds}: in-process {base:.1f}, " + ", ".join(
            f"{name} {np.mean(rates[name][-1]):.1f}" for name in configs) +
            f" steps/s; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\nB={args.batch} D={args.dim} N={args.rows} steps={args.steps}, one thread per "
          f"process, {os.cpu_count()} cores, {args.rounds} round(s) in turns, medians\n")
    print("| configuration | steps/s per trainer | rows/s (all trainers) | vs in-process | "
          "vs 2 x 2 tcp | bytes sent per step per trainer |")
    print("|---|---|---|---|---|---|")
    tcp = "2 servers x 2 trainers, tcp"
    for name in rates:
        mean = float(np.median([np.mean(r) for r in rates[name]]))
        total = float(np.median([sum(r) for r in rates[name]])) * args.batch
        vs_tcp = np.median([sum(a) / sum(b) for a, b in zip(rates[name], rates[tcp])])
        nbytes = sent.get(name) or []
        cell = "-" if not nbytes else (f"{np.median(nbytes) / 1e6:.2f} MB" +
                                       (" (computed)" if name == tcp else " (measured)"))
        print(f"| {name} | {mean:.1f} | {total / 1e6:.2f} M | "
              f"{float(np.median(ratios[name])):.2f}x | {vs_tcp:.2f}x | {cell} |")


if __name__ == "__main__":
    main()
