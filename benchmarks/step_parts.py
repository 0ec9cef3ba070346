"""Where the time of bench_step.py's distemb step goes: its statements and its kernels.

The step is the user's (``zero_grad; rows = emb(ids); loss = (rows * upstream).sum();
loss.backward(); opt.step()``) on bench_step's table and id batches. Each statement is
timed, and inside them the three kernels (``gather_rows`` in the lookup, ``dedup_sum``
and the update in ``opt.step``), wrapped by timers here; the rest of a statement is
Python, validation and torch. Means per step over ``--steps`` steps after a warm-up, in
one process; also the minor page faults per step and the share of the process's
anonymous memory on huge pages. ``--four-k-pages`` builds the table as it lands when the
kernel has no free 2 MiB blocks at its first touch (numpy's huge-page request and
distemb's MADV_COLLAPSE both off): the slow processes bench_step's spread shows.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/step_parts.py --dist zipf
"""
import argparse
import collections
import resource
import statistics
import time

import numpy as np
import torch

import bench_step
import bench_systems as bs
import distemb
import results
from distemb import kernels
from distemb.stores import dense

KERNELS = ("gather_rows", "dedup_sum", "adagrad_update")
STATEMENTS = ("zero_grad", "lookup", "loss (mul, sum)", "backward", "opt.step")


def timed_kernels(acc):
    """Wrap the kernels of distemb.kernels with timers adding into ``acc``."""
    for name in KERNELS:
        fn = getattr(kernels, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_name] += time.perf_counter() - t0
        setattr(kernels, name, wrapped)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dist", choices=["uniform", "zipf"], default="zipf")
    p.add_argument("--zipf-a", type=float, default=bench_step.ZIPF_A,
                   help="the zipf exponent (1.1: ~57%% of a batch's ids distinct, 1.2: ~33%%)")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--four-k-pages", action="store_true",
                   help="the table on 4 KiB pages (no huge-page request, no collapse)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    results.add_arguments(p, key=None)
    args = p.parse_args(argv)
    if args.result_key is None:
        args.result_key = "four_k_pages" if args.four_k_pages else "main"
    with results.Recorder("step_parts", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Time the step's statements and kernels; print them per step."""
    if args.four_k_pages:
        np.core.multiarray._set_madvise_hugepage(False)
        dense.back_with_huge_pages = lambda array: False
    torch.set_num_threads(args.threads)
    batches = bench_step.id_batches(args.dist, args.rows, args.batch, 64,
                                    zipf_a=args.zipf_a)
    up = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
    ctx = distemb.DistContext.embedded(num_threads=args.threads)
    emb = distemb.DistEmbedding(args.rows, args.dim, name="parts", init_func=bs._uniform_init,
                                context=ctx)
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    acc = collections.defaultdict(float)
    timed_kernels(acc)

    def step(k):
        t = [time.perf_counter()]
        opt.zero_grad()
        t.append(time.perf_counter())
        rows = emb(batches[k % len(batches)])
        t.append(time.perf_counter())
        loss = (rows * up).sum()
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        for name, a, b in zip(STATEMENTS, t, t[1:]):
            acc[name] += b - a
        return t[-1] - t[0]

    for k in range(args.warmup):
        step(k)
    acc.clear()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [step(k) for k in range(args.warmup, args.warmup + args.steps)]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    n = args.steps
    print(f"# step_parts: dist={args.dist} zipf_a={args.zipf_a} rows={args.rows} dim={args.dim} "
          f"batch={args.batch} threads={args.threads} isa={kernels.ISA or '-'}"
          f"{' four-k-pages' if args.four_k_pages else ''}")
    print(f"step: {1 / statistics.median(times):.0f} steps/s (median), mean "
          f"{sum(times) / n * 1e3:.3f} ms; minor faults/step {faults:.1f}; "
          f"{bench_step.huge_page_share():.0%} of anon memory on huge pages")
    rec.figure("steps", 1 / statistics.median(times), "{:.0f} steps/s", "the step, median")
    inside = {"lookup": ["gather_rows"], "opt.step": ["dedup_sum", "adagrad_update"]}
    for name in STATEMENTS:
        own = acc[name] - sum(acc[k] for k in inside.get(name, []))
        print(f"  {name:<16} {acc[name] / n * 1e3:7.3f} ms")
        rec.figure(f"ms.{name.split()[0]}", acc[name] / n * 1e3, "{:.3f} ms",
                   f"the step's {name}, mean per step")
        for k in inside.get(name, []):
            print(f"    kernel {k:<16} {acc[k] / n * 1e3:7.3f} ms")
            rec.figure(f"ms.{k}", acc[k] / n * 1e3, "{:.3f} ms",
                       f"kernel {k} in the step, mean per step")
        if name in inside:
            print(f"    {'rest (Python, checks)':<23} {own / n * 1e3:7.3f} ms")
    ctx.close()


if __name__ == "__main__":
    main()
