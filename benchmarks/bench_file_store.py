"""Train a file-backed table larger than RAM; rows/s beside the in-memory table and the disk.

Builds a ``FileStore`` of ``--gib`` GiB of rows (default 36 GiB = 1.5x this machine's
24 GiB of RAM; dim 128 float32 and a row-wise Adagrad accumulator of 4 bytes per row),
writes every row (so the disk, not a sparse hole, answers reads), flushes it and drops
it from the page cache (``posix_fadvise(DONTNEED)``), then trains it with
``SparseRowWiseAdagrad`` on uniform random ids for ``--steps`` steps (or ``--seconds``),
cold. Printed beside it, in the same run: the same step on an in-memory ``DenseStore``
of ``--mem-rows`` rows, and the disk's own sequential read rate (1 MiB reads of the
table file) and random read rate (4 KiB ``pread`` at random offsets, the I/O a row miss
costs). A clean ``close()`` flushes; its time is printed. The file is deleted at the end,
also on error or Ctrl-C.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_file_store.py --dir /work/bench-tmp
"""
import argparse
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch

import distemb
import results
from distemb.stores import DenseStore, FileStore

GIB = 1 << 30


def drop_cache(path):
    """Write back and evict ``path``'s pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_rates(path, seconds):
    """(sequential MB/s, random 4 KiB reads/s) of ``path``, cache dropped first."""
    size = os.path.getsize(path)
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf_size, done, t0 = 1 << 20, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds and done < size:
            done += len(os.pread(fd, buf_size, done))
        seq = done / (time.perf_counter() - t0) / 1e6
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # what the sequential pass read
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        rng = np.random.default_rng(0)
        offsets = (rng.integers(0, size, 1 << 20) // 4096) * 4096
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.pread(fd, 4096, int(offsets[n]))
            n += 1
        rand = n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return seq, rand


def fill(store, chunk_rows, log_every):
    """Write every row (a repeated random block: disk-bound, not generator-bound)."""
    w = store.column("weight")
    block = np.random.default_rng(0).uniform(-0.01, 0.01, (chunk_rows, store.dim))
    block = block.astype(np.float32)
    t0 = time.perf_counter()
    for lo in range(0, store.num_rows, chunk_rows):
        hi = min(lo + chunk_rows, store.num_rows)
        w[lo:hi] = block[:hi - lo]
        if (lo // chunk_rows) % log_every == 0:
            print(f"#   filled {hi * store.dim * 4 / GIB:5.1f} GiB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    store.flush()
    return time.perf_counter() - t0


def train(emb, num_rows, args, seed):
    """ids/s of steps of uniform ids over ``num_rows`` (median of per-step rates)."""
    opt = distemb.SparseRowWiseAdagrad([emb], lr=0.01)
    rng = np.random.default_rng(seed)
    up = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
    times, t_end = [], time.perf_counter() + args.seconds
    for _ in range(args.steps):
        ids = torch.from_numpy(rng.integers(0, num_rows, args.batch))
        t0 = time.perf_counter()
        opt.zero_grad()
        (emb(ids) * up).sum().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return args.batch / statistics.median(times), len(times), args.batch * len(times) / sum(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to test")
    p.add_argument("--gib", type=float, default=36.0, help="GiB of rows (weight column)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200, help="steps at most")
    p.add_argument("--seconds", type=float, default=120.0, help="training time at most")
    p.add_argument("--mem-rows", type=int, default=1_000_000, help="in-memory table rows")
    p.add_argument("--disk-seconds", type=float, default=10.0, help="per disk-rate probe")
    results.add_arguments(p)
    args = p.parse_args(argv)
    with results.Recorder("bench_file_store", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Write the table, train it cold, then the in-memory table and the disk's rates."""
    torch.set_num_threads(1)
    rows = int(args.gib * GIB) // (args.dim * 4)
    need = rows * (args.dim * 4 + 4)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(args.dir)) or ".").free
    if need > free * 0.9:
        sys.exit(f"--dir {args.dir}: needs {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    path = os.path.join(args.dir, "bench-file-store")
    print(f"# bench_file_store: {rows} rows x {args.dim} float32 = {rows * args.dim * 4 / GIB:.1f}"
          f" GiB (+{rows * 4 / GIB:.2f} GiB row-wise state) on {args.dir}; RAM "
          f"{ram / GIB:.1f} GiB ({rows * args.dim * 4 / ram:.2f}x); batch {args.batch}, "
          f"SparseRowWiseAdagrad, 1 thread, uniform ids")
    ctx = distemb.DistContext.embedded(num_threads=1)
    try:
        t0 = time.perf_counter()
        store = FileStore(path, num_rows=rows, dim=args.dim)
        print(f"# created and preallocated in {time.perf_counter() - t0:.1f} s", flush=True)
        secs = fill(store, 1 << 16, 64)
        print(f"# wrote every row: {rows * args.dim * 4 / GIB / secs:.2f} GiB/s "
              f"({secs:.0f} s)", flush=True)
        emb = distemb.StoreEmbedding(store, name="big", context=ctx)
        drop_cache(os.path.join(path, "weight.bin"))
        file_rate, file_steps, file_mean = train(emb, rows, args, seed=1)
        t0 = time.perf_counter()
        emb.close()
        close_s = time.perf_counter() - t0
        mem = distemb.StoreEmbedding(DenseStore(args.mem_rows, args.dim), name="mem",
                                     context=ctx)
        mem.store.column("weight")[:] = 0.01  # resident, as a trained table
        mem_rate, mem_steps, _ = train(mem, args.mem_rows, args, seed=1)
        mem.close()
        seq, rand = disk_rates(os.path.join(path, "weight.bin"), args.disk_seconds)
        print(f"| {'what':<44} | {'rate':>22} |")
        print(f"|{'-' * 46}|{'-' * 24}|")
        print(f"| {'FileStore table, cold, ids/s (median step)':<44} | {file_rate:>16.4g} ids/s |")
        print(f"| {'FileStore table, ids/s over all steps':<44} | {file_mean:>16.4g} ids/s |")
        print(f"| {'in-memory DenseStore, ids/s (median step)':<44} | {mem_rate:>16.4g} ids/s |")
        print(f"| {'disk sequential read (1 MiB preads)':<44} | {seq:>17.0f} MB/s |")
        print(f"| {'disk random read (4 KiB preads)':<44} | {rand:>15.0f} reads/s |")
        print(f"# {file_steps} file-backed steps, {mem_steps} in-memory steps; in-memory / "
              f"file = {mem_rate / file_rate:.1f}x; file ids/s / disk random reads/s = "
              f"{file_rate / rand:.2f}; clean close (msync) {close_s:.1f} s")
        rec.figure("file_ids_per_s", file_rate, "{:,.0f} ids/s",
                   "the file-backed table trained cold, median step")
        rec.figure("memory_ids_per_s", mem_rate, "{:,.0f} ids/s",
                   "the in-memory table, median step")
        rec.figure("memory_vs_file", mem_rate / file_rate, "{:.1f}x",
                   "in-memory ids/s over the file-backed table's")
        rec.figure("disk_random_reads_per_s", rand, "{:,.0f} reads/s",
                   "the disk's random 4 KiB reads, one at a time")
        rec.figure("file_vs_disk_reads", file_rate / rand, "{:.2f}x",
                   "file-backed ids/s over the disk's random reads/s")
    finally:
        shutil.rmtree(path, ignore_errors=True)
        print(f"# removed {path}")


if __name__ == "__main__":
    main()
