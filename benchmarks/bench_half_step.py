"""bf16 / fp16 rows vs fp32 rows: the training step on bench_step.py's uniform case.

Block 1, the target: the user-level step of bench_step.py (``zero_grad``, lookup,
``(rows * upstream).sum().backward()``, ``step``) on the dense
``DistEmbedding(dtype=...)``, 1M x 128 table, batch 4096, uniform ids from a pool of 64
batches, one thread, timed in rounds (see run_rounds); medians, same-run ratios against
the float32 table, and the median of the per-round (paired) ratios.
SparseAdagrad (float32 state of D floats per row: half rows save a quarter of the update's
bytes) and SparseRowWiseAdagrad (one float per row: half rows save nearly half).
``--store`` adds ``StoreEmbedding`` on a ``DenseStore`` of each dtype (the row-store path).

Block 2, where the time goes: the same batches through the kernels alone (the fused
gather to float32 rows, the gradient sum, the Adagrad update), float32 vs bfloat16 rows,
and ``torch``'s share (the user's forward and backward on the looked-up rows), so the
bound on the whole step's ratio can be read off: the step's unchanged parts divided into
the parts half rows can shrink.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/bench_half_step.py --repeats 5
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch

import bench_step as bstep
import bench_systems as bs
import distemb
import results
from distemb import kernels
from distemb.kernels import half
from distemb.stores import DenseStore, key_uniform

OPTIMIZERS = {"Adagrad": distemb.SparseAdagrad, "RowWiseAdagrad": distemb.SparseRowWiseAdagrad}
DTYPES = ("float32", "bfloat16", "float16")
SMALL_ROWS = 16_384  # 8 MiB of float32 rows + 8 MiB of state: in this machine's caches


def _init(shape, dtype):
    return torch.empty(shape, dtype=dtype).uniform_(-0.01, 0.01)


def dense_step(dtype, opt_name, rows, batches, upstream):
    ctx = distemb.DistContext.embedded(num_threads=1)
    emb = distemb.DistEmbedding(rows, upstream.shape[1], name=f"half-{opt_name}-{dtype}",
                                init_func=_init, context=ctx, dtype=getattr(torch, dtype))
    opt = OPTIMIZERS[opt_name]([emb], lr=0.01)
    return bs.Contender(f"{opt_name} DistEmbedding {dtype}", "step",
                        bs._user_step(emb, opt, batches, upstream), upstream.shape[0],
                        ctx.close, threads=1)


def store_step(dtype, opt_name, rows, batches, upstream):
    ctx = distemb.DistContext.embedded(num_threads=1)
    store = DenseStore(rows, upstream.shape[1], dtype=dtype,
                       init=key_uniform(upstream.shape[1], -0.01, 0.01))
    emb = distemb.StoreEmbedding(store, context=ctx)
    opt = OPTIMIZERS[opt_name]([emb], lr=0.01)
    for name in store.columns():
        if name != "weight":
            store.column(name)[...] = 0  # touch the state's pages, as a trained table
    return bs.Contender(f"{opt_name} StoreEmbedding {dtype}", "step",
                        bs._user_step(emb, opt, batches, upstream), upstream.shape[0],
                        ctx.close, threads=1)


def part_contenders(rows, batches, upstream):
    """The step's parts on their own: kernels on float32 and bfloat16 rows, torch's share."""
    dim = upstream.shape[1]
    rng = np.random.default_rng(1)
    w32 = rng.uniform(-0.01, 0.01, (rows, dim)).astype(np.float32)
    w16 = half.encode(w32, "bfloat16")
    s32, s16 = np.zeros_like(w32), np.zeros_like(w32)
    ids = [b.numpy() for b in batches]
    grads = upstream.numpy()
    summed = [kernels.dedup_sum(i, grads) for i in ids]
    out = np.empty_like(grads)
    sums = np.empty_like(grads)
    nb = len(ids)
    looked = torch.zeros_like(upstream)

    def torch_share(k):  # what the user's code does with the rows, whatever their storage
        x = looked.detach().requires_grad_()
        (x * upstream).sum().backward()

    parts = {
        "gather float32": lambda k: kernels.gather_rows(w32, ids[k % nb], out),
        "gather bfloat16": lambda k: half.gather_rows(w16, ids[k % nb], out),
        "dedup_sum (either)": lambda k: kernels.dedup_sum(ids[k % nb], grads, out=sums),
        "adagrad_update float32": lambda k: kernels.adagrad_update(
            w32, s32, summed[k % nb][0], summed[k % nb][1], 1e-6, 1e-10),
        "adagrad_update bfloat16": lambda k: half.adagrad_update(
            w16, s16, summed[k % nb][0], summed[k % nb][1], 1e-6, 1e-10),
        "torch fwd+bwd (either)": torch_share,
    }
    # The same updates on a table that fits in the caches: what is left is arithmetic
    # (float32 sqrt and divide per element, the same for either row format).
    small = min(rows, SMALL_ROWS)
    c32, c16 = w32[:small].copy(), w16[:small].copy()
    cs32, cs16 = s32[:small].copy(), s16[:small].copy()
    csummed = [kernels.dedup_sum(i % small, grads) for i in ids]
    parts[f"adagrad_update float32, {small} rows"] = lambda k: kernels.adagrad_update(
        c32, cs32, csummed[k % nb][0], csummed[k % nb][1], 1e-6, 1e-10)
    parts[f"adagrad_update bfloat16, {small} rows"] = lambda k: half.adagrad_update(
        c16, cs16, csummed[k % nb][0], csummed[k % nb][1], 1e-6, 1e-10)
    return [bs.Contender(name, "kernel", run, upstream.shape[0], threads=1)
            for name, run in parts.items()]


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def run_rounds(args, contenders):
    """Time the contenders in rounds: each round runs every contender once on the same
    batch, in an order rotated from round to round, so load from other jobs (this machine
    is shared) hits each alike; ``--clock cpu`` counts this thread's CPU time only (not
    the time spent waiting for a core; memory stalls count). torch and the kernels run
    one thread, this one.

    Returns:
        {name: (calls/s from the median call time, rows per call, kind, [per-round
        time of the first contender / this one's])}: the ratio's median over rounds is
        the paired estimate of the speed-up.
    """
    clock = CLOCKS[args.clock]
    for c in contenders:
        for k in range(args.warmup):
            c.run(k)
    n = len(contenders)
    times = [[] for _ in contenders]
    for r in range(args.repeats * args.steps):
        for i in [(r + j) % n for j in range(n)]:
            t0 = clock()
            contenders[i].run(args.warmup + r)
            times[i].append(clock() - t0)
    res = {c.name: (1.0 / statistics.median(t), c.rows_per_call, c.kind,
                    [a / b for a, b in zip(times[0], t)])
           for c, t in zip(contenders, times)}
    for c in contenders:
        c.close()
    return res


def print_block(title, res, base):
    print(f"\n## {title}")
    print(f"| {'contender':<38} | {'calls/s':>8} | {'ms/call':>8} | {'vs fp32':>8} "
          f"| {'paired vs fp32 (IQR)':>22} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 24}|")
    for name, (rate, _, _, ratios) in res.items():
        rel = f"{rate / res[base][0]:.2f}x" if base else ""
        q = np.percentile(ratios, [25, 50, 75])
        paired = f"{q[1]:.2f}x ({q[0]:.2f}-{q[2]:.2f})" if base else ""
        print(f"| {name:<38} | {rate:>8.1f} | {1e3 / rate:>8.3f} | {rel:>8} | {paired:>22} |")
    sys.stdout.flush()


def print_bound(res):
    """What the kernels' own speed-ups allow the whole step (same run's medians)."""
    ms = {name: 1e3 / v[0] for name, v in res.items()}
    fixed = ms["dedup_sum (either)"] + ms["torch fwd+bwd (either)"]
    k32 = ms["gather float32"] + ms["adagrad_update float32"]
    k16 = ms["gather bfloat16"] + ms["adagrad_update bfloat16"]
    print(f"\nkernels that half rows shrink: {k32:.3f} ms (fp32) -> {k16:.3f} ms (bf16), "
          f"{k32 / k16:.2f}x; unchanged parts {fixed:.3f} ms; the step (these parts only) "
          f"{(k32 + fixed) / (k16 + fixed):.2f}x; with bf16 kernels taking no time at all "
          f"{(k32 + fixed) / fixed:.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dist", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--store", action="store_true", help="also StoreEmbedding on DenseStore")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="time calls by wall clock or by this thread's CPU time")
    results.add_arguments(p)
    args = p.parse_args(argv)
    with results.Recorder("bench_half_step", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Each rule's step per row dtype in rounds, then the step's parts alone."""
    torch.set_num_threads(1)
    print(f"# bench_half_step: rows={args.rows} dim={args.dim} batch={args.batch} "
          f"dist={args.dist} 1 thread kernels={kernels.IMPL_NAME} repeats={args.repeats} "
          f"clock={args.clock}")
    batches, upstream = bstep.inputs(args, args.dist)
    for opt_name in args.optimizers:
        contenders = [dense_step(d, opt_name, args.rows, batches, upstream) for d in DTYPES]
        if args.store:
            contenders += [store_step(d, opt_name, args.rows, batches, upstream)
                           for d in DTYPES]
        res = run_rounds(args, contenders)
        base = f"{opt_name} DistEmbedding float32"
        print_block(f"{opt_name}: the step", res, base)
        for name, (_, _, _, ratios) in res.items():
            if name != base and name.startswith(f"{opt_name} DistEmbedding "):
                dtype = name.split()[-1]
                rec.figure(f"paired_vs_fp32.{opt_name.lower()}.{dtype}",
                           float(np.median(ratios)), "{:.2f}x",
                           f"{opt_name}: the float32 table's step time over the {dtype} "
                           "table's, paired by round (median)")
    res = run_rounds(args, part_contenders(args.rows, batches, upstream))
    print_block("the step's parts (Adagrad), each alone", res, None)
    print_bound(res)


if __name__ == "__main__":
    main()
