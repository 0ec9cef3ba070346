"""Host time of a GPU table's step, part by part: where a launch-bound step spends it.

Times, on the host and without waiting for the device (a sync every 10 calls keeps the
queue short), each CUDA entry point distemb calls in a step, beside torch's
``index_select`` and ``empty`` as the host cost of a plain torch op, then the parts of the
user's step on ``DistEmbedding(10M, 128, device="cuda")`` with SparseAdagrad on zipf(1.1)
ids, batch 65,536: ``emb(ids)``, the loss, ``backward()``, ``opt.step()``; and a cProfile
of 50 steps by cumulative time. Medians. Host timings on a shared VM move between
processes: compare parts within one run.

Usage (needs a CUDA GPU and the CUDA kernels built)::

    PYTHONPATH=. python benchmarks/gpu_host_parts.py [--rows 10000000] [--batch 65536]
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import distemb  # noqa: E402
import results  # noqa: E402
from distemb.kernels import cuda  # noqa: E402

DIM = 128


def host_us(fn, batches, calls=200):
    """Median host microseconds of ``fn(ids)``, a device sync every 10 calls."""
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(batches[i % len(batches)])
        times.append(time.perf_counter() - start)
        if i % 10 == 9:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main(argv=None):
    """Print the host microseconds of each entry point and of each part of a step."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--calls", type=int, default=200, help="timed calls of each part")
    results.add_arguments(p)
    args = p.parse_args(argv)
    try:
        cuda.require_cuda()
    except cuda.CudaUnavailableError as exc:
        sys.exit(f"gpu_host_parts: cannot run without a usable GPU: {exc}")
    with results.Recorder("gpu_host_parts", args, argv) as rec:
        rec.device(f"{torch.cuda.get_device_name(torch.cuda.current_device())}, "
                   f"torch {torch.__version__}")
        return measure(args, rec)


def measure(args, rec):
    """Each entry point alone, then the parts of the user's step, then a cProfile."""
    num_rows, batch = args.rows, args.batch
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.rand(num_rows, DIM, device=dev)
    state = torch.zeros_like(w)
    upstream = torch.randn(batch, DIM, device=dev)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(((rng.zipf(1.1, batch) - 1) % num_rows).astype(np.int64))
               .to(dev) for _ in range(20)]
    flags = torch.tensor(cuda.CLEAN_ID_FLAGS, dtype=torch.int64, device=dev)
    uniq, summed = cuda.dedup_sum_padded(batches[0], upstream, num_rows)
    print(f"{torch.cuda.get_device_name(dev)}: host us per call (median, no wait)")
    for name, fn in [
            ("torch index_select", lambda ids: w.index_select(0, ids)),
            ("torch empty", lambda ids: torch.empty(10, device=dev)),
            ("gather_rows_checked", lambda ids: cuda.gather_rows_checked(w, ids, flags)),
            ("dedup_sum_padded", lambda ids: cuda.dedup_sum_padded(ids, upstream, num_rows)),
            ("adagrad_update", lambda ids: cuda.adagrad_update(w, state, uniq, summed, 0.01,
                                                               1e-10))]:
        us = host_us(fn, batches, args.calls)
        print(f"  {name:22s} {us:8.1f}")
        rec.figure(f"us.{name.replace(' ', '_')}", us, "{:.0f} us",
                   f"{name}: host time per call")
    del w, state
    ctx = distemb.DistContext.embedded(backend="pytorch")
    emb = distemb.DistEmbedding(num_rows, DIM, name="parts", context=ctx, device="cuda")
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    parts = {"lookup": [], "loss": [], "backward": [], "step": []}
    for i in range(args.calls):
        t0 = time.perf_counter()
        rows = emb(batches[i % 20])
        t1 = time.perf_counter()
        loss = (rows * upstream).sum()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for key, a, b in (("lookup", t0, t1), ("loss", t1, t2), ("backward", t2, t3),
                          ("step", t3, t4)):
            parts[key].append(b - a)
        if i % 10 == 9:
            torch.cuda.synchronize()
    print("step parts, host us (median): " + ", ".join(
        f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in parts.items()))
    for k, v in parts.items():
        rec.figure(f"us.step_{k}", statistics.median(v) * 1e6, "{:.0f} us",
                   f"the step's {k}: host time per step, no wait for the device")
    prof = cProfile.Profile()
    prof.enable()
    for i in range(50):
        (emb(batches[i % 20]) * upstream).sum().backward()
        opt.step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
