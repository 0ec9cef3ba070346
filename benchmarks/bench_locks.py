"""What consistent reads cost: KVServer pull/update under the per-shard reader/writer
lock, and a seqlock-guarded gather from a shared-memory shard, against the same kernels
called bare (the baseline: what the server did before, with no lock on pulls).

B random rows of an (N, D) float32 table, one thread; contenders timed in turns
(one batch each, in a shuffled order, then the next), each on batches the others did
not just read, each cell the median of its calls.

Usage::

    PYTHONPATH=. python benchmarks/bench_locks.py [--rows 200000] [--dim 128]
        [--batch 4096] [--calls 300]
"""
import argparse
import time

import numpy as np

import results
from distemb import kernels
from distemb.kvstore import KVServer
from distemb.rules import AdagradHyper, rule_of
from distemb.stores.dense import DenseSpec
from distemb.stores.types import WEIGHT
from distemb.transport.shm import ShmArena, attach


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--calls", type=int, default=300)
    results.add_arguments(p)
    args = p.parse_args()
    with results.Recorder("bench_locks", args) as rec:
        measure(args, rec)


def measure(args, rec):
    """Every contender in turns, ``args.calls`` times; the table of medians."""
    rng = np.random.default_rng(0)
    arena = ShmArena("bench-locks", 0)
    try:
        # The table as a server with shared memory holds it: a dense store whose rows are
        # a segment of the arena, its seqlock that segment's counter, Adagrad's state a
        # second column of the store.
        srv = KVServer()
        spec = DenseSpec((args.rows, args.dim))
        table, = srv.create_table("w", spec, spec.router(), [0], arena)
        table.set_counter(WEIGHT, arena.version_of(table.store.column(WEIGHT)))
        srv.attach_states("w", 0, table.init_states("adagrad", {}))
        w, s = table.store.column(WEIGHT), table.store.column("sum")
        w[...] = 0.01
        s[...] = 0.0  # every page touched now
        mapped = attach(arena.dup_segment(w), w.shape, "float32")
        rule, hyper = rule_of("adagrad"), AdagradHyper(clr=0.01, eps=1e-10)
        batches = [np.unique(rng.integers(0, args.rows, args.batch)) for _ in range(64)]
        grads = np.full((args.batch, args.dim), 0.001, np.float32)
        contenders = {
            "pull, bare kernel (baseline)": lambda ids: kernels.gather_rows(w, ids),
            "pull, KVServer (read lock)": lambda ids: srv.pull("w", 0, ids),
            "pull, shared-memory seqlock read": lambda ids: mapped.read(
                lambda a: kernels.gather_rows(a, ids)),
            "update, KVServer (write lock + version)": lambda ids: srv.update(
                "w", 0, ids, grads[:len(ids)], "adagrad", hyper),
            "update, bare kernel (baseline)": lambda ids: rule.apply(
                kernels, w, {"sum": s}, ids, grads[:len(ids)], hyper),
        }
        times = {name: [] for name in contenders}
        items = list(contenders.items())
        for i in range(args.calls + 10):
            # A shuffled order each turn: whoever runs after an update pays for writing
            # back its dirty rows, so a fixed order would bias the comparison.
            for k in rng.permutation(len(items)):
                name, fn = items[k]
                # Each contender its own batch: none reads rows another just cached.
                ids = batches[(i + 13 * k) % len(batches)]
                t = time.perf_counter()
                fn(ids)
                if i >= 10:  # warm-up
                    times[name].append(time.perf_counter() - t)
        # The locks alone (no rows): what every pull and update now pays on top.
        alone = {}
        for what, ctx in (("read lock alone", table.read),
                          ("write lock + version bumps alone", table.write)):
            t = time.perf_counter()
            for _ in range(20000):
                with ctx():
                    pass
            alone[what] = (time.perf_counter() - t) / 20000
    finally:
        arena.close()
    print(f"N={args.rows} D={args.dim} B={args.batch} calls={args.calls}, one thread, "
          f"median per call\n")
    print("| operation | us per call | vs bare kernel |")
    print("|---|---|---|")
    for name, ts in times.items():
        base = np.median(times["pull, bare kernel (baseline)" if name.startswith("pull")
                               else "update, bare kernel (baseline)"])
        print(f"| {name} | {np.median(ts) * 1e6:.1f} | {np.median(ts) / base:.3f}x |")
        key = "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
        rec.figure(f"us.{key}", np.median(ts) * 1e6, "{:.1f} us", f"{name}, per call")
        rec.figure(f"vs_bare.{key}", np.median(ts) / base, "{:.3f}x",
                   f"{name}: time per call over the bare kernel's")
    pull = np.median(times["pull, bare kernel (baseline)"])
    for what, t in alone.items():
        print(f"| {what} | {t * 1e6:.2f} | {t / pull:.4f}x of a bare pull |")
        key = "read_lock" if what.startswith("read") else "write_lock"
        rec.figure(f"us.{key}", t * 1e6, "{:.2f} us", what)
        rec.figure(f"of_pull.{key}", t / pull, "{:.1%}", f"{what}, over a bare pull")


if __name__ == "__main__":
    main()
