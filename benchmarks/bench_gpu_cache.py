"""The GPU cache (distemb.kvstore.caches.device) against the host table without it.

One step: ``rows = emb(ids, device=DEV)``, ``(rows ** 2).sum().backward()``,
``SparseAdagrad.step()`` on a host table (embedded), D=128 by default. Contenders, each
in its own context, on the same id stream:

- ``host``: the baseline, no cache: every looked-up row crosses PCIe to the device, the
  gradients are summed there and the unique ids and sums come back; the host updates.
- ``lru-5%``, ``lfu-5%``, ``lru-20%``, ``lfu-20%``: a device cache of that share of the
  table's rows (with their Adagrad state): only misses come in, cached rows are updated
  on the device, dirty rows go back at eviction.

Id streams: ``sage``, the input nodes of DGL's NeighborSampler([10, 10]) batches of 1,024
training seeds on WordNet (117,659 rows), and ``zipf``, 13,000 zipf(1.1) draws per step
over a table of the same size (both from benchmarks/id_streams.py).

Printed per stream and contender, after ``--warmup`` steps: the hit rate (unique rows
looked up that were cached), rows and bytes moved host->device and device->host per step
(device-independent: the same on a GPU and on the CPU twin), and, on a GPU, steps/s
(median of rounds) and the ratio to ``host``.

Usage::

    # no GPU needed: the cache on the CPU with the tests' CUDA twin; hit rates and bytes
    PYTHONPATH=. python benchmarks/bench_gpu_cache.py --twin [--steps 60] [--warmup 20]
    # on a GPU (the CUDA kernels built); steps/s too. A GPU machine without DGL can read
    # the streams written here by --write-streams ids.npz:
    PYTHONPATH=. python benchmarks/bench_gpu_cache.py [--streams-file ids.npz]

Without a usable GPU and without ``--twin`` it exits, saying why.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import distemb  # noqa: E402
import results  # noqa: E402
from distemb.config import parse_cache_config  # noqa: E402
from distemb.context import DistContext  # noqa: E402
from distemb.kernels import cuda  # noqa: E402
from distemb.kvstore import LocalKVClient  # noqa: E402
from distemb.kvstore.caches.device import DeviceCachedKVClient  # noqa: E402

CONTENDERS = {"host": None,
              "lru-5%": {"policy": "lru", "fraction": 0.05},
              "lfu-5%": {"policy": "lfu", "fraction": 0.05},
              "lru-20%": {"policy": "lru", "fraction": 0.2},
              "lfu-20%": {"policy": "lfu", "fraction": 0.2}}


def load_streams(args):
    """{stream: (num_rows, [ids per step])}, sampled here or read from --streams-file."""
    if args.streams_file and os.path.exists(args.streams_file):
        with np.load(args.streams_file) as z:
            return {s: (int(z[f"{s}/rows"]), [z[f"{s}/{i}"] for i in range(int(z[f"{s}/n"]))])
                    for s in args.streams.split(",")}
    import id_streams
    from graph_examples.datasets import load_dataset

    ds = load_dataset("wordnet")
    n = ds.graph.num_nodes()
    total = args.steps
    out = {}
    for s in args.streams.split(","):
        if s == "sage":
            stream = id_streams.sage_stream(ds.graph, ds.train_idx, total, 0, 1)
        elif s == "zipf":
            stream = id_streams.zipf_stream(n, total, 0)
        else:
            sys.exit(f"--streams: expected sage and/or zipf, got {s!r}")
        out[s] = (n, [step["nodes"] for step in stream])
    if args.write_streams:
        arrays = {}
        for s, (rows, ids) in out.items():
            arrays.update({f"{s}/rows": np.int64(rows), f"{s}/n": np.int64(len(ids))})
            arrays.update({f"{s}/{i}": a for i, a in enumerate(ids)})
        np.savez(args.write_streams, **arrays)
    return out


def context(cache, device, ops):
    local = LocalKVClient(num_threads=1)
    if cache is None:
        return DistContext(local, backend="pytorch", num_threads=1)
    client = DeviceCachedKVClient(local, parse_cache_config(cache), device, ops=ops)
    return DistContext(client, backend="pytorch", num_threads=1)


def baseline_bytes(ids, dim):
    """Bytes the uncached host table moves per step: rows in; unique ids and sums out."""
    uniq = np.unique(ids).shape[0]
    return ids.shape[0] * 4 * dim, uniq * (8 + 4 * dim)


def run(name, cache, num_rows, stream, args, device, ops):
    ctx = context(cache, device, ops)
    try:
        emb = distemb.DistEmbedding(num_rows, args.dim, name="nodes", context=ctx,
                                    init_func=lambda s, d: torch.rand(s, dtype=d) - 0.5)
        opt = distemb.SparseAdagrad([emb], lr=0.01)
        batches = [torch.from_numpy(ids) for ids in stream]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def step(ids):
            (emb(ids, device=device) ** 2).sum().backward()
            opt.step()

        for ids in batches[:args.warmup]:
            step(ids)
        sync()
        before = ctx.client.stats() if cache else None
        measured = batches[args.warmup:]
        times = []
        per_round = max(1, len(measured) // args.rounds)
        for r in range(0, len(measured), per_round):
            start = time.perf_counter()
            for ids in measured[r:r + per_round]:
                step(ids)
            sync()
            times.append((time.perf_counter() - start) / len(measured[r:r + per_round]))
        n = len(measured)
        if cache is None:
            moved = np.array([baseline_bytes(ids.numpy(), args.dim) for ids in measured])
            h2d, d2h = moved.mean(axis=0)
            hit, rows_in = 0.0, float(np.mean([len(ids) for ids in measured]))
        else:
            after = ctx.client.stats()
            d = {k: after[k] - before[k] for k in after}
            h2d, d2h = d["h2d_bytes"] / n, d["d2h_bytes"] / n
            hit = d["hit_rows"] / max(1, d["unique_rows"])
            rows_in = d["miss_rows"] / n
        return dict(name=name, hit=hit, rows_in=rows_in, h2d=h2d, d2h=d2h,
                    step_s=statistics.median(times))
    finally:
        ctx.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--twin", action="store_true", help="run the cache on the CPU with "
                        "the tests' CUDA twin: hit rates and bytes only (no GPU needed)")
    parser.add_argument("--streams", default="sage,zipf")
    parser.add_argument("--steps", type=int, default=60, help="steps per stream, warm-up "
                        "included")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--streams-file", help="read the id streams from this .npz")
    parser.add_argument("--write-streams", help="write the sampled id streams to this .npz")
    results.add_arguments(parser, key=None)
    args = parser.parse_args()
    if args.result_key is None:  # a stand-in's run never takes the GPU's place
        args.result_key = "twin" if args.twin else "main"
    if args.warmup >= args.steps:
        sys.exit(f"--warmup: must be < --steps ({args.steps}), got {args.warmup}")
    if args.twin:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from cpu_cuda_twin import CpuCudaTwin  # the CUDA kernels' CPU stand-in (tests/)

        device, ops = torch.device("cpu"), CpuCudaTwin()
    else:
        try:
            cuda.require_cuda()
        except cuda.CudaUnavailableError as e:
            sys.exit(f"bench_gpu_cache: no usable GPU here, so no steps/s to measure ({e}). "
                     "Run with --twin for the hit rates and bytes per step, which do not "
                     "depend on the device.")
        device, ops = torch.device("cuda", torch.cuda.current_device()), None
    with results.Recorder("bench_gpu_cache", args) as rec:
        if not args.twin:
            rec.device(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        measure(args, device, ops, rec)


def measure(args, device, ops, rec):
    """Every contender on every stream; a table per stream."""
    torch.manual_seed(0)
    streams = load_streams(args)
    where = "CPU twin (times are not GPU times)" if args.twin else torch.cuda.get_device_name()
    print(f"# bench_gpu_cache: {where}; D={args.dim}, SparseAdagrad, {args.steps} steps "
          f"({args.warmup} warm-up)")
    for sname, (num_rows, stream) in streams.items():
        ids_per_step = np.mean([len(s) for s in stream])
        print(f"\n## {sname}: {num_rows} rows, {ids_per_step:.0f} ids per step")
        print(f"{'contender':>10} {'hit rate':>9} {'rows in/step':>13} {'MB in/step':>11} "
              f"{'MB out/step':>12} {'MB/step vs host':>16}" +
              ("" if args.twin else f" {'steps/s':>9} {'vs host':>8}"))
        base = None
        for name, cache in CONTENDERS.items():
            r = run(name, cache, num_rows, stream, args, device, ops)
            base = base or r
            ratio = (r["h2d"] + r["d2h"]) / (base["h2d"] + base["d2h"])
            line = (f"{name:>10} {r['hit']:9.1%} {r['rows_in']:13.0f} {r['h2d'] / 1e6:11.2f} "
                    f"{r['d2h'] / 1e6:12.2f} {ratio:16.2f}")
            if not args.twin:
                line += f" {1 / r['step_s']:9.1f} {base['step_s'] / r['step_s']:8.2f}x"
            print(line, flush=True)
            key = f"{sname}.{name.replace('%', '')}"
            rec.figure(f"hit_rate.{key}", 100 * r["hit"], "{:.1f}%",
                       f"{sname} ids, {name}: % of looked-up rows served by the GPU cache")
            rec.figure(f"bytes_vs_host.{key}", ratio, "{:.2f}",
                       f"{sname} ids, {name}: bytes moved per step over the host table's")
            if not args.twin:
                rec.figure(f"vs_host.{key}", base["step_s"] / r["step_s"], "{:.2f}x",
                           f"{sname} ids, {name}: steps/s over the uncached host table's")


if __name__ == "__main__":
    main()
