"""The co-located 1 server x 1 trainer job with glibc malloc tuned by distemb and as glibc
leaves it (``DISTEMB_MALLOC=default``), in turns: steps/s and minor page faults.

Every process of the job counts: the launcher waits for its servers and trainers, so
``RUSAGE_CHILDREN`` of the launcher's parent holds them all. See :mod:`distemb.malloc`.

    OMP_WAIT_POLICY=passive python benchmarks/bench_malloc.py --rounds 5
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

import results
from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(args, malloc):
    """(steps/s of the trainer, minor faults of every process of the job)."""
    with tempfile.TemporaryDirectory() as out:
        ip = os.path.join(out, "ip.txt")
        with open(ip, "w") as f:
            f.write(f"127.0.0.1 {ports.free_port()}\n")
        argv = [sys.executable, "-m", "distemb.launch", "--ip-config", ip, "--num-servers",
                "1", "--num-trainers", "1", "--config-out", os.path.join(out, "c.json"),
                "--", sys.executable, os.path.join(ROOT, "benchmarks", "bench_kvstore.py"),
                "--trainer", "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--batch", str(args.batch), "--dim", str(args.dim), "--rows", str(args.rows)]
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_WAIT_POLICY="passive",
                   DISTEMB_NUM_THREADS="1", DISTEMB_MALLOC=malloc)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        subprocess.run(argv, env=env, check=True, timeout=600, cwd=ROOT)
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
        with open(os.path.join(out, "rank0.json")) as f:
            return json.load(f)["steps_per_s"], faults


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    results.add_arguments(p)
    args = p.parse_args()
    with results.Recorder("bench_malloc", args) as rec:
        measure(args, rec)


def measure(args, rec):
    """Both malloc settings in turns, ``args.rounds`` times; the table."""
    runs = {"tuned": [], "default": []}
    for _ in range(args.rounds):
        for malloc in runs:
            runs[malloc].append(run_job(args, malloc))
    print(f"co-located 1 x 1, shm, B={args.batch} D={args.dim} N={args.rows}, "
          f"{args.steps} steps, {args.rounds} rounds in turns; load {os.getloadavg()[0]:.1f}")
    print("| malloc | steps/s each round | median | minor faults (median) |\n|---|---|---|---|")
    med = {}
    for malloc, rs in runs.items():
        med[malloc] = statistics.median(r[0] for r in rs)
        print(f"| {malloc} | {', '.join(f'{r[0]:.0f}' for r in rs)} | {med[malloc]:.0f} | "
              f"{statistics.median(r[1] for r in rs):,.0f} |")
        rec.figure(f"steps.{malloc}", med[malloc], "{:.0f} steps/s",
                   f"the co-located job with glibc malloc {malloc}, median")
        rec.figure(f"faults.{malloc}", statistics.median(r[1] for r in rs), "{:,.0f}",
                   f"minor page faults of the whole job, malloc {malloc}, median")
    print(f"tuned / default: {med['tuned'] / med['default']:.2f}x")
    rec.figure("tuned_vs_default", med["tuned"] / med["default"], "{:.2f}x",
               "steps/s with distemb's malloc thresholds over glibc's own")


if __name__ == "__main__":
    main()
