"""Bounded staleness vs exact: DeepWalk's Micro-F1 with a trainer cache, in a real job.

Runs ``graph_examples/deepwalk.py`` (the project's DeepWalk evaluation: skip-gram on
random walks, then logistic regression on the frozen node table, Micro-/Macro-F1 on the
dataset's test split) under ``distemb-launch`` with S servers and T trainers on this
machine, the same seeds in every job:

- ``exact``: a trainer cache in exact mode (results as without a cache);
- ``staleness s``: the same cache with bounded staleness ``s`` (a cached row may miss up
  to ``s - 1`` steps of other trainers' updates; see distemb/kvstore/caches/trainer.py);
- ``exact, seed k`` (``--noise-seed``): the exact job with other seeds (walks,
  negatives, initial rows): how much the F1 moves between runs that are equally right,
  the scale the staleness effect is judged against.

The cache holds ``--cache-fraction`` of each table (default: all of it, so every row
can be served stale: the relaxation's largest effect). Prints each job's F1 and the
differences.

Usage::

    PYTHONPATH=. python benchmarks/bench_staleness.py [--dataset wordnet] [--servers 2]
        [--trainers 2] [--staleness 5] [--cache-fraction 1.0] [--noise-seed 1]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import results
from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_deepwalk(workdir, servers, trainers, deepwalk_args, staleness=0, fraction=1.0,
                 policy="lru", consistency="sync", seed=0, timeout=3600):
    """One distemb-launch job of deepwalk.py; its rank 0's metrics.json as a dict.

    Args:
        workdir: a directory for the job's files.
        servers, trainers: processes of the job (all on 127.0.0.1).
        deepwalk_args: deepwalk.py options (dataset, sizes), without --seed/--out.
        staleness: the cache's staleness (0: exact); fraction, policy: its size and policy.
        consistency: the job's consistency mode.
        seed: deepwalk.py's --seed.
        timeout: seconds before the job is killed.
    """
    tag = f"s{staleness}-seed{seed}-{time.monotonic_ns()}"
    out = os.path.join(workdir, tag)
    ip = os.path.join(workdir, f"ip-{tag}.txt")
    port = ports.free_port(servers + 1)  # the servers', then the master's
    with open(ip, "w") as f:
        f.write(f"127.0.0.1 {port}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", ip, "--num-servers",
            str(servers), "--num-trainers", str(trainers), "--consistency", consistency,
            "--cache-fraction", str(fraction), "--cache-policy", policy,
            "--cache-staleness", str(staleness), "--master-port", str(port + servers),
            "--config-out", os.path.join(workdir, f"cluster-{tag}.json"), "--",
            sys.executable, os.path.join(ROOT, "graph_examples", "deepwalk.py"), "--quiet",
            "--threads", "1", "--seed", str(seed), "--out", out, *deepwalk_args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"deepwalk job (staleness {staleness}, seed {seed}) exited "
                           f"{done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="wordnet")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--staleness", type=int, default=5)
    p.add_argument("--cache-fraction", type=float, default=1.0)
    p.add_argument("--cache-policy", default="lru", choices=("lru", "lfu"))
    p.add_argument("--consistency", default="sync")
    p.add_argument("--noise-seed", type=int, action="append", default=[],
                   help="also run the exact job with this seed (repeatable)")
    p.add_argument("--max-steps", type=int, default=0, help="0: one whole epoch")
    p.add_argument("deepwalk_args", nargs="*", help="more deepwalk.py options, after --")
    results.add_arguments(p)
    args = p.parse_args()
    with results.Recorder("bench_staleness", args) as rec:
        measure(args, rec)


def measure(args, rec):
    """The jobs one after another; their F1 and the differences."""
    # Batches of 4,096 pairs, as the recorded run (benchmarks/results/bench_staleness.json;
    # deepwalk.py's default is 16,384); a --batch-size after -- overrides it.
    dw = ["--dataset", args.dataset, "--max-steps", str(args.max_steps), "--batch-size", "4096",
          *args.deepwalk_args]
    jobs = [("exact", 0, 0), (f"staleness {args.staleness}", args.staleness, 0)] + [
        (f"exact, seed {s}", 0, s) for s in args.noise_seed]
    print(f"DeepWalk on {args.dataset}: {args.servers} servers x {args.trainers} trainers, "
          f"{args.consistency}, cache {args.cache_policy} {args.cache_fraction:.0%} of each "
          f"table, one thread per process, {os.cpu_count()} cores", flush=True)
    got = {}
    with tempfile.TemporaryDirectory() as work:
        for name, stale, seed in jobs:
            t0 = time.perf_counter()
            m = run_deepwalk(work, args.servers, args.trainers, dw, stale,
                             args.cache_fraction, args.cache_policy, args.consistency, seed)
            got[name] = m
            print(f"  {name}: Micro-F1 {m['test_micro_f1']:.4f}, Macro-F1 "
                  f"{m['test_macro_f1']:.4f}, final loss {m['final_loss']:.4f}, "
                  f"{m['steps']} steps on rank 0, {time.perf_counter() - t0:.0f} s; load "
                  f"average {os.getloadavg()[0]:.1f}", flush=True)
    exact = got["exact"]
    print("\n| job | Micro-F1 | Macro-F1 | final loss | Micro-F1 - exact (points) |")
    print("|---|---|---|---|---|")
    for n, (name, m) in enumerate(got.items()):
        print(f"| {name} | {m['test_micro_f1']:.4f} | {m['test_macro_f1']:.4f} | "
              f"{m['final_loss']:.4f} | "
              f"{100 * (m['test_micro_f1'] - exact['test_micro_f1']):+.2f} |")
        key = ["exact", "stale"][n] if n < 2 else f"seed{jobs[n][2]}"
        rec.figure(f"micro_f1.{key}", m["test_micro_f1"], "{:.4f}", f"{name}: test Micro-F1")
        rec.figure(f"macro_f1.{key}", m["test_macro_f1"], "{:.4f}", f"{name}: test Macro-F1")
    diff = 100 * (got[jobs[1][0]]["test_micro_f1"] - exact["test_micro_f1"])
    print(f"\nstaleness {args.staleness} - exact: {diff:+.2f} Micro-F1 points "
          f"(target: within 0.5)")
    rec.figure("stale_minus_exact", diff, "{:+.2f} points",
               f"Micro-F1 with staleness {args.staleness} minus exact's")


if __name__ == "__main__":
    main()
