"""Pooled lookups: distemb's ``emb.bag`` step against ``nn.EmbeddingBag(sparse=True)``.

The whole training step a user writes, for each pooling mode::

    opt.zero_grad(); out = emb.bag(ids, offsets, mode=mode)        # distemb
    opt.zero_grad(); out = bag(ids, offsets)                       # torch: nn.EmbeddingBag
    loss = (out * upstream).sum(); loss.backward(); opt.step()

Contenders, each on a table of ``--rows`` rows of ``--dim`` floats with Adagrad (lr 0.01):

- ``torch EmbeddingBag`` (the baseline): ``nn.EmbeddingBag(mode=mode, sparse=True)`` +
  ``torch.optim.Adagrad``, as torch documents it. torch has no sparse gradient for mode
  'max': there its baseline is ``sparse=False`` with the dense Adagrad (torch's only
  way), which updates every row.
- ``distemb bag``: ``DistEmbedding`` + ``SparseAdagrad``, ``emb.bag(ids, offsets, mode)``.
- ``distemb unpooled``: the same table, the rows of every id looked up and reduced in
  torch (``emb(ids).view(B, L, D).sum(1)``, ``.mean(1)``, ``.amax(1)``): what a user
  writes without pooled lookups.

Bags are ``--bags`` bags of ``--length`` zipf(1.1) ids (ranks scattered over the table by
a fixed permutation), given as 1-D ids + offsets; the upstream gradient is a fixed
linear read-out (it never drives rows toward subnormal floats). Each contender cycles
through the same pool of pre-drawn batches; contenders are timed in turns (one repeat
each, then the next repeat), a repeat's time is the median of its ``--steps`` steps, a
cell the median of the repeats, and ratios are same-run: the baseline's median step
time over the contender's. Each step is timed twice: wall-clock, and the CPU time of this
thread (``time.thread_time``; every contender runs in this one thread), which leaves out
the time other processes held the core: on a machine shared with other jobs, the
wall-clock ratio moves with their load, the CPU-time ratio much less.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_bag.py --threads 1
"""
import argparse
import os
import platform
import statistics
import subprocess
import time
import warnings

import numpy as np
import torch

import distemb
import results

# torch's sparse Adagrad warns once that sparse invariant checks are off; not our concern.
warnings.filterwarnings("ignore", message="Sparse invariant checks")
MODES = ("sum", "mean", "max")
REDUCE = {"sum": lambda r: r.sum(1), "mean": lambda r: r.mean(1),
          "max": lambda r: r.amax(1)}


def cpu_name():
    """The CPU's model name (lscpu), for the header."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def batches(args):
    """``--pool`` batches of 1-D ids (``bags * length`` zipf ids) and their offsets."""
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(args.rows)
    n = args.bags * args.length
    ids = [torch.from_numpy(perm[(rng.zipf(1.1, n) - 1) % args.rows]) for _ in range(args.pool)]
    return ids, torch.arange(0, n, args.length)


def _init(shape, dtype):
    return torch.empty(shape, dtype=dtype).uniform_(-0.01, 0.01)  # touches every page


def contenders(args, mode, ids, offsets, upstream, tag):
    """{name: step(k)} of one mode, and the function that frees their tables."""
    ctx = distemb.DistContext.embedded(num_threads=args.threads)
    emb = distemb.DistEmbedding(args.rows, args.dim, name=f"bench-bag-{tag}", init_func=_init,
                                context=ctx)
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    ref = torch.nn.EmbeddingBag(args.rows, args.dim, mode=mode, sparse=mode != "max")
    with torch.no_grad():
        ref.weight.uniform_(-0.01, 0.01)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.01)
    shape = (args.bags, args.length, args.dim)

    def pooled(k):
        opt.zero_grad()
        (emb.bag(ids[k % len(ids)], offsets, mode=mode) * upstream).sum().backward()
        opt.step()

    def unpooled(k):
        opt.zero_grad()
        (REDUCE[mode](emb(ids[k % len(ids)]).view(shape)) * upstream).sum().backward()
        opt.step()

    def baseline(k):
        ref_opt.zero_grad()
        (ref(ids[k % len(ids)], offsets) * upstream).sum().backward()
        ref_opt.step()

    return {"torch EmbeddingBag": baseline, "distemb bag": pooled,
            "distemb unpooled": unpooled}, ctx.close


def time_turns(steps, args):
    """{name: (wall, cpu)}: medians over repeats of the median step time, in turns."""
    times = {name: ([], []) for name in steps}
    k = 0
    for name, step in steps.items():  # warm-up: first touches, allocator, state
        for j in range(args.warmup):
            step(j)
    for _ in range(args.repeats):
        for name, step in steps.items():
            wall, cpu = [], []
            for j in range(args.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                step(k + j)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            times[name][0].append(statistics.median(wall))
            times[name][1].append(statistics.median(cpu))
        k += args.steps
    return {name: (statistics.median(w), statistics.median(c))
            for name, (w, c) in times.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=128, help="row length")
    p.add_argument("--bags", type=int, default=4096, help="bags per step (B)")
    p.add_argument("--length", type=int, default=20, help="ids per bag (L)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["sum", "mean"],
                   help="pooling modes ('max': torch's baseline is dense, see above)")
    p.add_argument("--threads", type=int, default=1, help="torch and distemb threads")
    p.add_argument("--pool", type=int, default=16, help="pre-drawn batches cycled")
    p.add_argument("--steps", type=int, default=8, help="steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats (turns)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender")
    p.add_argument("--seed", type=int, default=0)
    results.add_arguments(p)
    args = p.parse_args(argv)
    for name in ("rows", "dim", "bags", "length", "threads", "pool", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with results.Recorder("bench_bag", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Every contender of every mode, in turns per mode; the table."""
    torch.set_num_threads(args.threads)
    ids, offsets = batches(args)
    upstream = torch.randn(args.bags, args.dim, generator=torch.Generator().manual_seed(1))
    unique = statistics.median(len(torch.unique(b)) for b in ids)
    print(f"# bench_bag: rows={args.rows} dim={args.dim} bags={args.bags} "
          f"length={args.length} ids/step={len(ids[0])} unique/step={unique:.0f} "
          f"threads={args.threads} repeats={args.repeats} steps={args.steps} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"# CPU: {cpu_name()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
          f"; median step times in ms, wall-clock and CPU; ratios: the baseline's time "
          f"over the contender's, same run")
    print()
    print("| mode | contender          | step ms |  CPU ms | vs torch EmbeddingBag | by CPU |")
    print("|------|--------------------|---------|---------|-----------------------|--------|")
    for i, mode in enumerate(args.modes):
        steps, close = contenders(args, mode, ids, offsets, upstream, i)
        got = time_turns(steps, args)
        steps.clear()
        close()
        base, base_cpu = got["torch EmbeddingBag"]
        for name, (t, c) in got.items():
            print(f"| {mode:<4} | {name:<18} | {t * 1e3:7.2f} | {c * 1e3:7.2f} | "
                  f"{base / t:20.2f}x | {base_cpu / c:5.2f}x |")
            key = f"{mode}.{name.split()[-1]}"  # sum.EmbeddingBag, sum.bag, sum.unpooled
            rec.figure(f"vs_torch.{key}", base / t, "{:.2f}x",
                       f"{mode}, {name}: torch's step time over this one's, wall clock")
            rec.figure(f"vs_torch_cpu.{key}", base_cpu / c, "{:.2f}x",
                       f"{mode}, {name}: torch's step time over this one's, CPU time")
    print(f"# load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
