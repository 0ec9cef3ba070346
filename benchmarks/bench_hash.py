"""Hash index and hash store: keys/s at load 0.5 and 0.9 vs a dense gather and a dict.

For each load factor the compiled :class:`~distemb.kernels.hashtable.HashIndex` is filled
with random int64 keys to that fraction of its buckets, then timed on batches of
``--batch`` keys: ``find`` (hits), ``find_or_insert`` (hits: a training lookup of known
keys), ``insert`` (new keys, timed while the table fills its last 10% up to the load),
each a median over ``--repeats`` batches. Baselines in the same run: the dense table's
row gather (``kernels.gather_rows`` of 128 floats from a table of the same number of
rows: what a dense table does instead of the hash lookup, and the lookup's cost is
paid in addition to it on a hash table), and a Python dict (``dict.get`` / insert via
``dict.setdefault`` over ``keys.tolist()``, its idiomatic batch use). Also: bytes per
key of a HashStore (rows + Adagrad state + index + eviction bookkeeping) and of the
dict, and the eviction cost per evicted key (LRU and LFU, 10% of the store).

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_hash.py --log2-buckets 22
"""
import argparse
import statistics
import sys
import time
import tracemalloc

import numpy as np

import results
from distemb import kernels
from distemb.kernels.hashtable import HashIndex
from distemb.rules import rule_of
from distemb.stores import HashStore


def median_rate(fn, batches):
    """Keys per second: batch size / median time of ``fn(batch)`` over ``batches``."""
    times = []
    for b in batches:
        t0 = time.perf_counter()
        fn(b)
        times.append(time.perf_counter() - t0)
    return len(batches[0]) / statistics.median(times)


def filled_index(keys, buckets, load, batch):
    """An index of ``buckets`` buckets filled to ``load``; insert keys/s near that load."""
    idx = HashIndex(capacity=0, max_load=0.95)
    idx.reserve(int(buckets * 0.94))
    assert idx.buckets == buckets, (idx.buckets, buckets)
    n = int(buckets * load)
    times = []
    for lo in range(0, n, batch):
        chunk = keys[lo:min(lo + batch, n)]
        t0 = time.perf_counter()
        idx.find_or_insert(chunk)
        if lo >= 0.9 * n and len(chunk) == batch:
            times.append(time.perf_counter() - t0)
    return idx, n, batch / statistics.median(times)


def dict_rates(keys, n, batches):
    """Python dict baseline: insert and find keys/s, and bytes per key (tracemalloc)."""
    tracemalloc.start()
    d = {}
    for k, v in zip(keys[:n].tolist(), range(n)):
        d[k] = v
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    find = median_rate(lambda b: [d.get(k, -1) for k in b.tolist()], batches)
    nxt = iter(range(n, n + 10 ** 9))
    new = [keys[n + i * len(batches[0]): n + (i + 1) * len(batches[0])]
           for i in range(len(batches))]
    insert = median_rate(lambda b: [d.setdefault(k, next(nxt)) for k in b.tolist()], new)
    return find, insert, size / n


def eviction_cost(n, dim, policy, repeats):
    """Seconds per evicted key when evicting 10% of an ``n``-key HashStore."""
    costs = []
    for r in range(repeats):
        s = HashStore(dim, evict=policy, reserve=n)
        for spec in rule_of("adagrad").states:
            s.add_column(spec.name, spec.shape(dim), spec.dtype)
        rng = np.random.default_rng(r)
        keys = rng.integers(-2 ** 62, 2 ** 62, n)
        for lo in range(0, n, 65536):  # lookups in batches: ticks and counts differ
            s.lookup(keys[lo:lo + 65536])
        s.lookup(rng.choice(keys, n // 4))
        t0 = time.perf_counter()
        gone = s.evict(int(n * 0.9))
        costs.append((time.perf_counter() - t0) / len(gone))
    return statistics.median(costs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log2-buckets", type=int, default=22, help="buckets of the index")
    p.add_argument("--batch", type=int, default=65536, help="keys per timed call")
    p.add_argument("--repeats", type=int, default=15, help="timed batches (median)")
    p.add_argument("--dim", type=int, default=128, help="row length (gather, bytes/key)")
    p.add_argument("--gather-rows", type=int, default=1 << 21,
                   help="rows of the dense table gathered from (at most the keys held)")
    p.add_argument("--evict-keys", type=int, default=1 << 20, help="store size for eviction")
    results.add_arguments(p)
    args = p.parse_args(argv)
    if not kernels.HAS_EXT:
        sys.exit("the compiled kernels are not loaded: build them (setup.py build_ext)")
    if (1 << args.log2_buckets) * 0.5 < 10 * args.batch:
        p.error(f"--log2-buckets {args.log2_buckets}, --batch {args.batch}: the index at "
                "load 0.5 must hold at least 10 batches (the insert rate is timed over the "
                "last tenth of its filling)")
    with results.Recorder("bench_hash", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """The index at load 0.5 and 0.9 against a dense gather and a dict; bytes; eviction."""
    buckets = 1 << args.log2_buckets
    rng = np.random.default_rng(0)
    keys = rng.integers(-2 ** 62, 2 ** 62, buckets + args.batch * (args.repeats + 1))
    print(f"# bench_hash: buckets=2^{args.log2_buckets} batch={args.batch} "
          f"repeats={args.repeats} dim={args.dim} (one core)")
    print(f"| {'load':>4} | {'keys':>9} | {'find':>9} | {'find_or_insert':>14} "
          f"| {'insert':>9} | {'dense gather':>12} | {'dict find':>9} | {'dict insert':>11} "
          f"| {'foi / gather':>12} | {'foi / dict':>10} |")
    print("|" + "|".join("-" * w for w in (6, 11, 11, 16, 11, 14, 11, 13, 14, 12)) + "|")
    for load in (0.5, 0.9):
        idx, n, insert = filled_index(keys, buckets, load, args.batch)
        hits = [keys[rng.integers(0, n, args.batch)] for _ in range(args.repeats)]
        find = median_rate(idx.find, hits)
        foi = median_rate(idx.find_or_insert, hits)
        g_rows = min(n, args.gather_rows)
        table = np.zeros((g_rows, args.dim), np.float32)
        table[:] = 1  # touch every page, as a trained table
        rows = [rng.integers(0, g_rows, args.batch) for _ in range(args.repeats)]
        out = np.empty((args.batch, args.dim), np.float32)
        gather = median_rate(lambda r: kernels.gather_rows(table, r, out), rows)
        del table
        d_find, d_insert, d_bytes = dict_rates(keys, n, hits[:5])
        print(f"| {load:>4} | {n:>9} | {find / 1e6:>7.1f}M | {foi / 1e6:>12.1f}M "
              f"| {insert / 1e6:>7.1f}M | {gather / 1e6:>10.1f}M | {d_find / 1e6:>7.2f}M "
              f"| {d_insert / 1e6:>9.2f}M | {foi / gather:>11.2f}x | {foi / d_find:>9.1f}x |")
        print(f"#   bytes/key at load {load}: index {idx.nbytes() / n:.1f} "
              f"(dict: {d_bytes:.1f}, keys and values as Python ints)")
        rec.figure(f"find_or_insert.{load}", foi, "{:,.0f} keys/s",
                   f"find-or-insert of held keys at load {load}, one core")
        rec.figure(f"dense_gather.{load}", gather, "{:,.0f} rows/s",
                   f"a dense table's row gather on the same core (dim {args.dim})")
        rec.figure(f"dict_find.{load}", d_find, "{:,.0f} keys/s", "a Python dict's find")
        rec.figure(f"foi_vs_dict.{load}", foi / d_find, "{:.1f}x",
                   f"find-or-insert over a Python dict's find, load {load}")
        rec.figure(f"index_bytes_per_key.{load}", idx.nbytes() / n, "{:.1f} B",
                   f"the index's bytes per key at load {load}")
        sys.stdout.flush()
        del idx
    s = HashStore(args.dim, reserve=1 << 16)
    for spec in rule_of("adagrad").states:
        s.add_column(spec.name, spec.shape(args.dim), spec.dtype)
    s.lookup(keys[:1 << 16])
    print(f"# HashStore bytes/key, dim={args.dim} + Adagrad state, 65536 keys: "
          f"{s.nbytes() / s.size():.0f} (rows+state {2 * 4 * args.dim}, rest: index at "
          f"load {s.load_factor():.2f} and 24 B of slot key/tick/count)")
    for policy in ("lru", "lfu"):
        cost = eviction_cost(args.evict_keys, 16, policy, 3)
        print(f"# eviction {policy}: {cost * 1e9:.0f} ns per evicted key "
              f"(10% of a {args.evict_keys}-key store, dim 16 + Adagrad state)")
        rec.figure(f"evict_ns.{policy}", cost * 1e9, "{:.0f} ns",
                   f"{policy} eviction, per evicted key (10% of a store evicted)")


if __name__ == "__main__":
    main()
