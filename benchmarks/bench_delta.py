"""Incremental checkpoints: bytes and time of a delta against a full save of the same table.

One embedded ``DistEmbedding`` of ``--rows`` x ``--dim`` float32 rows with
``SparseAdagrad`` (so a save writes the rows and their Adagrad sums). Each repeat, in
turns: a full save (``opt.save(path)``, the baseline), then a step touching a fraction of
the rows (``--fractions``, 1% and 10% by default: a step whose ids are that many distinct
random rows) and an incremental save of it (``opt.save(path, incremental=True)``), a full
save again before each fraction. Each save is complete on disk (its segments and its
manifest fsynced) when its time is taken. Bytes are those of the files the save wrote
(its segments and manifest, and for a delta the parent's manifest kept as a link file).
Cells are medians of the repeats; ratios are a delta's over the full save's of the same
repeat.

A save also starts tracking row versions (what a delta is made of): every later update
bumps them. The last table is what that costs: an Adagrad step of ``--batch`` random ids
on a table that was saved against one that never was, timed in turns (which goes first
alternates), by wall clock and by this thread's CPU time (``time.thread_time``: on a
machine shared with other jobs, the time others held the core is left out).

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_delta.py --rows 1000000 --dim 128
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import distemb
import results
from distemb import checkpoint


def saved_bytes(path):
    """Bytes of the files the last save into ``path`` wrote."""
    head = checkpoint.read_meta(path)
    names = [n for n in os.listdir(path) if n.startswith(head["save_id"])]
    names.append("manifest.json")
    if head.get("parent"):
        names.append(f"link-{head['parent']}.json")
    return sum(os.path.getsize(os.path.join(path, n)) for n in names)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def touch(emb, opt, rows, rng):
    """One Adagrad step whose ids are ``rows`` distinct random rows of ``emb``."""
    ids = torch.from_numpy(rng.choice(emb.num_embeddings, rows, replace=False))
    opt.zero_grad()
    (emb(ids) * 0.01).sum().backward()
    opt.step()


def step_times(embs, opts, batch, steps, rng):
    """Median step time (s), wall-clock and this thread's CPU time, of each (emb, opt),
    stepped in turns on the same ids (which goes first alternates)."""
    wall, cpu = [[] for _ in embs], [[] for _ in embs]
    for n in range(steps):
        ids = torch.from_numpy(rng.integers(0, embs[0].num_embeddings, batch))
        order = range(len(embs)) if n % 2 == 0 else reversed(range(len(embs)))
        for i in order:
            emb, opt = embs[i], opts[i]
            start, start_cpu = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            (emb(ids) * 0.01).sum().backward()
            opt.step()
            wall[i].append(time.perf_counter() - start)
            cpu[i].append(time.thread_time() - start_cpu)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.10])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=4096, help="ids of a step (tracking cost)")
    p.add_argument("--steps", type=int, default=50, help="steps timed (tracking cost)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    results.add_arguments(p)
    args = p.parse_args()
    with results.Recorder("bench_delta", args) as rec:
        measure(args, rec)


def measure(args, rec):
    """The saves, then the tracking cost; the tables and their figures."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="bench_delta-", dir=args.dir)
    ctx = distemb.DistContext.embedded(num_threads=1)
    try:
        emb = distemb.DistEmbedding(args.rows, args.dim, name="delta-bench", context=ctx,
                                    init_func=lambda s, d: torch.randn(s, dtype=d) * 0.1)
        opt = distemb.SparseAdagrad([emb], lr=0.01)
        ck = os.path.join(work, "ck")
        full_s, full_b = [], []
        delta = {f: ([], []) for f in args.fractions}
        for _ in range(args.repeat):
            for f in args.fractions:
                full_s.append(timed(lambda: opt.save(ck)))
                full_b.append(saved_bytes(ck))
                touch(emb, opt, max(1, int(f * args.rows)), rng)
                delta[f][0].append(timed(lambda: opt.save(ck, incremental=True)) /
                                   full_s[-1])
                delta[f][1].append(saved_bytes(ck) / full_b[-1])
        fs, fb = statistics.median(full_s), statistics.median(full_b)
        print(f"# bench_delta: rows={args.rows:,} dim={args.dim} float32, SparseAdagrad "
              f"(a save writes rows and sums: {fb / 1e6:,.1f} MB); repeats={args.repeat}; "
              f"checkpoints in {args.dir}")
        print(f"# CPU: {results.cpu_model()}; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; medians; ratios: the "
              f"delta's over the full save's of the same repeat")
        print("| save | rows written | MB | s | bytes vs full | time vs full |")
        print("|---|---:|---:|---:|---:|---:|")
        print(f"| full | {args.rows:,} | {fb / 1e6:,.2f} | {fs:.3f} | 1.000x | 1.000x |")
        for f in args.fractions:
            tr, br = statistics.median(delta[f][0]), statistics.median(delta[f][1])
            print(f"| delta, {f:.0%} of rows touched | {int(f * args.rows):,} | "
                  f"{br * fb / 1e6:,.2f} | {tr * fs:.3f} | {br:.3f}x | {tr:.3f}x |")
            rec.figure(f"bytes_vs_full.{f:.0%}".replace("%", "pct"), br, "{:.3f}x",
                       f"a delta's bytes over a full save's, {f:.0%} of rows touched")
            rec.figure(f"time_vs_full.{f:.0%}".replace("%", "pct"), tr, "{:.3f}x",
                       f"a delta's time over a full save's, {f:.0%} of rows touched")
        other = distemb.DistEmbedding(args.rows, args.dim, name="delta-bench-unsaved",
                                      context=ctx,
                                      init_func=lambda s, d: torch.randn(s, dtype=d) * 0.1)
        other_opt = distemb.SparseAdagrad([other], lr=0.01)
        step_times([emb, other], [opt, other_opt], args.batch, 5, rng)  # warm up
        (tracked, tracked_cpu), (untracked, untracked_cpu) = step_times(
            [emb, other], [opt, other_opt], args.batch, args.steps, rng)
        print(f"\n# the cost of tracking versions after a save: an Adagrad step of "
              f"{args.batch} random ids, {args.steps} steps in turns, medians, wall-clock "
              f"and this thread's CPU time")
        print("| table | step ms | CPU ms | vs never saved | by CPU |")
        print("|---|---:|---:|---:|---:|")
        print(f"| never saved | {untracked * 1e3:.3f} | {untracked_cpu * 1e3:.3f} | 1.000x | "
              f"1.000x |")
        print(f"| saved (versions tracked) | {tracked * 1e3:.3f} | {tracked_cpu * 1e3:.3f} | "
              f"{tracked / untracked:.3f}x | {tracked_cpu / untracked_cpu:.3f}x |")
        rec.figure("tracking_cost", tracked / untracked, "{:.3f}x",
                   "an Adagrad step on a saved table (versions tracked) over one never saved")
    finally:
        ctx.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
