"""The CPU kernels under each ISA build this CPU runs (csrc/cpu_kernels.h), timed in turns.

Every build gives the same bits (tests/test_cpu_isa.py); this shows what each one buys:
on bench_step's table (1M x 128 float32, batches of 4096 uniform or zipf ids), the
median time of one call of the gather, dedup and the Adagrad and Adam updates, per
build. The builds take turns, one round of 64 calls each, ``--rounds`` times; each cell
is the median over rounds of the round's median call, and the ratio is the baseline's
time over the cell's.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_isa.py
"""
import argparse
import statistics
import time

import numpy as np

import bench_step
import results
from distemb import kernels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    results.add_arguments(p)
    args = p.parse_args(argv)
    with results.Recorder("bench_isa", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Time every kernel under every build; print a table per id distribution."""
    isas = kernels.available_cpu_isas()
    print(f"# bench_isa: rows={args.rows} dim={args.dim} batch={args.batch} 1 thread; "
          f"this CPU runs {isas}, the process's default is {kernels.ISA}")
    rng = np.random.default_rng(1)
    w = rng.random((args.rows, args.dim), dtype=np.float32)
    s = np.full_like(w, 0.1)
    m = np.full_like(w, 0.1)
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    out = np.empty_like(grads)
    for dist in ("uniform", "zipf"):
        ids = [b.numpy() for b in bench_step.id_batches(dist, args.rows, args.batch, 64)]
        summed = [kernels.dedup_sum(i, grads) for i in ids]
        ops = {
            "gather_rows": lambda k: kernels.gather_rows(w, ids[k], out),
            "dedup_sum": lambda k: kernels.dedup_sum(ids[k], grads),
            "adagrad_update": lambda k: kernels.adagrad_update(w, s, *summed[k], 1e-6, 1e-10),
            "adam_update": lambda k: kernels.adam_update(w, s, m, *summed[k], 1e-6, 0.9,
                                                         0.999, 1e-8, 1),
        }
        times = {}
        for _ in range(args.rounds):
            for isa in isas:
                with kernels.cpu_isa(isa):
                    for name, call in ops.items():
                        calls = []
                        for k in range(len(ids)):
                            t0 = time.perf_counter()
                            call(k)
                            calls.append(time.perf_counter() - t0)
                        times.setdefault((name, isa), []).append(statistics.median(calls))
        print(f"\n## dist={dist}: ms per call (x: baseline's time / this build's)")
        print("| kernel | " + " | ".join(isas) + " |")
        print("|---|" + "---|" * len(isas))
        for name in ops:
            base = statistics.median(times[(name, isas[0])])
            cells = []
            for isa in isas:
                t = statistics.median(times[(name, isa)])
                cells.append(f"{t * 1e3:.3f} ({base / t:.2f}x)")
                rec.figure(f"{name}.{isa}.{dist}", base / t, "{:.2f}x",
                           f"{name}, {dist} ids: the baseline build's time over the {isa} build's")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
