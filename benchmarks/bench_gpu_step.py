"""Fused GPU Adagrad step against torch.nn.Embedding(sparse=True) + torch.optim.Adagrad.

One step of each, on the same id batches and output gradients:

- fused (distemb.kernels.cuda): gather_rows (the forward lookup), dedup_sum, then one
  in-place adagrad_update of the touched rows;
- baseline: ``emb(ids)``, ``backward`` (builds the sparse gradient), ``opt.step()``
  (coalesces it and updates weight and state).

Both tables are float32 on the GPU, measured one after the other so that only one pair of
(table, state) occupies GPU memory (10M x 128 is 5.1 GB each). Reports the median step
time over the repeats as rows/s and the fused/baseline ratio, for zipf and uniform ids.

Usage:
    python benchmarks/bench_gpu_step.py [--rows 10000000] [--dim 128] [--batch 65536]
"""
import argparse
import statistics
import sys

import numpy as np
import torch

from distemb.kernels import cuda

LR = 0.01
EPS = 1e-10


def make_batches(kind, rows, batch, count, seed, device):
    """Id batches on the GPU: zipf (duplicate-heavy, skewed) or uniform."""
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        ids = (rng.zipf(1.1, size=(count, batch)) - 1) % rows
    else:
        ids = rng.integers(0, rows, size=(count, batch))
    return [torch.from_numpy(b.astype(np.int64)).to(device) for b in ids]


def time_steps(step, batches, grads, warmup):
    """Median seconds per call of step(ids, grads), each call synchronised."""
    times = []
    for i, ids in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(ids, grads)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_fused(args, batches, grads, device):
    """Median step time of gather + dedup + fused Adagrad on a fresh table."""
    weight = torch.empty(args.rows, args.dim, device=device).uniform_(-0.01, 0.01)
    state = torch.zeros_like(weight)

    def step(ids, out_grads):
        cuda.gather_rows(weight, ids)
        uniq, summed = cuda.dedup_sum(ids, out_grads, num_rows=args.rows)
        cuda.adagrad_update(weight, state, uniq, summed, LR, EPS)

    try:
        return time_steps(step, batches, grads, args.warmup)
    finally:
        step = weight = state = None  # drop the table before the next benchmark allocates
        torch.cuda.empty_cache()


def bench_torch(args, batches, grads, device):
    """Median step time of torch.nn.Embedding(sparse=True) + torch.optim.Adagrad."""
    emb = torch.nn.Embedding(args.rows, args.dim, sparse=True).to(device)
    opt = torch.optim.Adagrad(emb.parameters(), lr=LR, eps=EPS)

    def step(ids, out_grads):
        opt.zero_grad()
        emb(ids).backward(out_grads)
        opt.step()

    try:
        return time_steps(step, batches, grads, args.warmup)
    finally:
        step = emb = opt = None
        torch.cuda.empty_cache()


def main(argv=None):
    """Run both steps on zipf and uniform ids and print rows/s and their ratio.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).

    Returns:
        0; exits with a message when no GPU or CUDA kernel library is usable.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=65_536)
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    args = parser.parse_args(argv)
    try:
        cuda.require_cuda()
    except cuda.CudaUnavailableError as exc:
        sys.exit(f"bench_gpu_step: cannot run: {exc}")
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(device)}: table {args.rows:,} x {args.dim} float32, "
          f"batch {args.batch:,}, median of {args.repeats} steps")
    grads = torch.randn(args.batch, args.dim, device=device)
    for seed, kind in enumerate(("zipf", "uniform")):
        batches = make_batches(kind, args.rows, args.batch, args.warmup + args.repeats, seed,
                               device)
        unique = statistics.mean(b.unique().numel() for b in batches) / args.batch
        fused = bench_fused(args, batches, grads, device)
        baseline = bench_torch(args, batches, grads, device)
        print(f"{kind:>8} ids ({unique:.0%} unique): fused {args.batch / fused / 1e6:7.2f} M rows/s"
              f" | torch Embedding+Adagrad {args.batch / baseline / 1e6:7.2f} M rows/s"
              f" | ratio {baseline / fused:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
