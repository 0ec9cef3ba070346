"""The user's whole GPU training step: distemb on a GPU table against torch, with the floor.

For each optimizer (SGD, Adagrad, row-wise Adagrad, Adam) and each id distribution
(zipf(1.1): skewed, duplicate-heavy; uniform), one step of each contender is:

- distemb: ``rows = emb(ids)`` on ``DistEmbedding(rows, dim, device="cuda")``, a loss
  ``(rows * upstream).sum()``, ``loss.backward()``, ``opt.step()`` (SparseSGD,
  SparseAdagrad, SparseRowWiseAdagrad, SparseAdam);
- torch (the baseline, used as its documentation says): ``opt.zero_grad()``, the same
  loss on ``nn.Embedding(rows, dim, sparse=True).cuda()``, ``backward()``, ``opt.step()``
  with torch.optim.SGD, Adagrad, Adagrad (torch has no row-wise Adagrad: the nearest
  rule) and SparseAdam.

Both use the same id batches, upstream gradients and initial weights; each runs alone on
the GPU (the other's tables freed), rounds of steps synchronised once per round, the
median round quoted. Also measured in the same run: the kernels alone (gather; and
dedup_sum_padded + the update, as a GPU table's step runs them: ``distemb.kernels.cuda``;
target: at most 3x the gather), and the device copy bandwidth, from which the floor
of a step is the bytes it must move (gather B rows in and out, read B gradient rows,
read and write the U touched rows of the table and of each per-element state) over that
bandwidth. Prints every time, the ratios torch/distemb and "% of floor" (floor / time).

With ``--dtypes float32,bfloat16`` distemb also runs on 16-bit rows (the lookups and
gradients stay float32), timed in the same run; "vs f32" is the float32 table's step
time over this one's. Every distemb case also trains a few steps twice from the same
weights and says whether the two tables are bit-identical ("det": yes/NO).

``--profile`` prints each GPU kernel's share of the device time of 5 steps (user
annotations such as torch's ``Optimizer.step#...`` ranges are not kernels and are left
out) and the host time per step beside it; ``--host-profile`` prints the Python functions
that take the host time of 20 steps (cProfile), for steps bound by launches, not kernels.

Usage (needs a CUDA GPU and the CUDA kernels built: ``python setup.py build_ext
--inplace`` with nvcc on PATH):
    python benchmarks/bench_gpu_step.py [--rows 10000000] [--dim 128] [--batch 65536]
        [--optimizers sgd,adagrad,rowwise_adagrad,adam] [--ids zipf,uniform]
        [--dtypes float32,bfloat16] [--profile] [--host-profile]
"""
import argparse
import cProfile
import io
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

OPTIMIZERS = {
    # name: (distemb optimizer, torch optimizer, per-element state tensors, per-row state)
    "sgd": (lambda e: distemb.SparseSGD([e], lr=0.01),
            lambda p: torch.optim.SGD(p, lr=0.01), 0, 0),
    "adagrad": (lambda e: distemb.SparseAdagrad([e], lr=0.01),
                lambda p: torch.optim.Adagrad(p, lr=0.01), 1, 0),
    "rowwise_adagrad": (lambda e: distemb.SparseRowWiseAdagrad([e], lr=0.01),
                        lambda p: torch.optim.Adagrad(p, lr=0.01), 0, 1),
    "adam": (lambda e: distemb.SparseAdam([e], lr=0.001),
             lambda p: torch.optim.SparseAdam(p, lr=0.001), 2, 0),
}


def make_batches(kind, rows, batch, count, seed, device):
    """Id batches on the GPU: zipf(1.1) (duplicate-heavy, skewed) or uniform."""
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        ids = (rng.zipf(1.1, size=(count, batch)) - 1) % rows
    else:
        ids = rng.integers(0, rows, size=(count, batch))
    return [torch.from_numpy(b.astype(np.int64)).to(device) for b in ids]


def time_rounds(step, batches, rounds, per_round):
    """Median seconds per step: rounds of ``per_round`` steps, synchronised per round."""
    step(batches[0])  # warm-up: allocations, lazy imports, library load
    torch.cuda.synchronize()
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        for i in range(per_round):
            step(batches[(r * per_round + i) % len(batches)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def copy_bandwidth(device, nbytes=1 << 30, repeats=20):
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def floor_seconds(batch, unique, dim, elem_states, row_states, bandwidth):
    """Time to move the bytes every implementation of the step must move."""
    row = dim * 4
    gather = 2 * batch * row                   # read the looked-up rows, write the output
    grads = batch * row                        # read every gradient row once
    update = 2 * unique * (row * (1 + elem_states) + 4 * row_states)  # read + write
    return (gather + grads + update) / bandwidth


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def make_table(args, name, w0, dtype, ctx):
    """A GPU DistEmbedding holding ``w0`` (rounded to ``dtype``) and its optimizer."""
    emb = distemb.DistEmbedding(args.rows, args.dim, name=f"bench-{name}-{dtype}",
                                context=ctx, device="cuda", dtype=dtype,
                                init_func=lambda shape, dt: w0.to(dt))
    return emb, OPTIMIZERS[name][0](emb)


def bench_distemb(args, name, batches, upstream, w0, dtype="float32"):
    """Median seconds of a distemb step; with --profile/--host-profile, where it goes."""
    ctx = distemb.DistContext.embedded(backend="pytorch")
    try:
        emb, opt = make_table(args, name, w0, dtype, ctx)

        def step(ids):
            loss = (emb(ids) * upstream).sum()
            loss.backward()
            opt.step()

        seconds = time_rounds(step, batches, args.rounds, args.per_round)
        if args.profile:
            profile_steps(step, batches[:5])
        if args.host_profile:
            host_profile(step, batches[:20])
        return seconds
    finally:
        ctx.close()
        free()


def deterministic(args, name, batches, upstream, w0, dtype="float32", steps=5):
    """Whether two runs of ``steps`` steps from the same weights give identical tables."""
    finals = []
    for _ in range(2):
        ctx = distemb.DistContext.embedded(backend="pytorch")
        try:
            emb, opt = make_table(args, name, w0, dtype, ctx)
            for ids in batches[:steps]:
                (emb(ids) * upstream).sum().backward()
                opt.step()
            finals.append(emb.weight[torch.arange(args.rows, device=w0.device)].float())
        finally:
            ctx.close()
    same = torch.equal(finals[0].view(torch.int32), finals[1].view(torch.int32))
    del finals
    free()
    return same


def profile_steps(step, batches):
    """Print each GPU kernel's share of the device time of a few distemb steps."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for ids in batches:
            step(ids)
        host = time.perf_counter() - start  # enqueueing alone: no wait for the device yet
        torch.cuda.synchronize()

    def device_us(evt):
        return getattr(evt, "self_device_time_total", None) or \
            getattr(evt, "self_cuda_time_total", 0)

    def annotation(evt):  # ranges such as torch's "Optimizer.step#SparseAdam.step"
        return getattr(evt, "is_user_annotation", False) or "#" in evt.key

    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and device_us(e) > 0
               and not annotation(e)]
    total = sum(device_us(e) for e in kernels)
    if not total:
        print("    profile: no GPU kernel recorded")
        return
    print(f"    profile of {len(batches)} steps: {total / len(batches):.0f} us of kernel time "
          f"per step, {host * 1e6 / len(batches):.0f} us of host time to enqueue it "
          f"(profiled); {sum(e.count for e in kernels) / len(batches):.0f} kernels per "
          "step; kernels by share:")
    for evt in sorted(kernels, key=device_us, reverse=True)[:10]:
        print(f"    {device_us(evt) / total:6.1%} {device_us(evt) / len(batches):8.1f} us "
              f"x{evt.count // len(batches):<3d} {evt.key[:80]}")


def host_profile(step, batches, top=25):
    """Print the Python functions that take the host time of a few distemb steps."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for ids in batches:
        step(ids)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"    host profile of {len(batches)} steps (cProfile, by own time):")
    print("\n".join("    " + line for line in out.getvalue().splitlines()[:top + 12]))


def bench_torch(args, name, batches, upstream, w0, device):
    ref = torch.nn.Embedding(args.rows, args.dim, sparse=True).to(device)
    with torch.no_grad():
        ref.weight.copy_(w0)
    opt = OPTIMIZERS[name][1](ref.parameters())

    def step(ids):
        opt.zero_grad()
        loss = (ref(ids) * upstream).sum()
        loss.backward()
        opt.step()

    try:
        return time_rounds(step, batches, args.rounds, args.per_round)
    finally:
        del ref, opt
        free()


def bench_kernels(args, name, batches, upstream, w0):
    """Gather alone, and gather + dedup + update, straight on distemb.kernels.cuda."""
    weight = w0.clone()
    elem_states, row_states = OPTIMIZERS[name][2:]
    states = [torch.zeros_like(weight) for _ in range(elem_states)]
    row_state = torch.zeros(args.rows, device=weight.device) if row_states else None
    num_rows = args.rows

    def gather(ids):
        cuda.gather_rows(weight, ids)

    def update(ids):
        uniq, summed = cuda.dedup_sum_padded(ids, upstream, num_rows=num_rows)  # no wait
        if name == "sgd":
            cuda.sgd_update(weight, uniq, summed, 0.01)
        elif name == "adagrad":
            cuda.adagrad_update(weight, states[0], uniq, summed, 0.01, 1e-10)
        elif name == "rowwise_adagrad":
            cuda.rowwise_adagrad_update(weight, row_state, uniq, summed, 0.01, 1e-10)
        else:
            cuda.adam_update(weight, states[0], states[1], uniq, summed, 0.001, 0.9, 0.999,
                             1e-8, 1)

    try:
        t_gather = time_rounds(gather, batches, args.rounds, args.per_round)
        t_update = time_rounds(update, batches, args.rounds, args.per_round)
        return t_gather, t_update
    finally:
        del weight, states, row_state
        free()


def gpu():
    """The current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


def main(argv=None):
    """Run every (optimizer, ids) case and print times, ratios and % of floor.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).

    Returns:
        0; exits with a message when no GPU or CUDA kernel library is usable.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=65_536)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--ids", default="zipf,uniform")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--per-round", type=int, default=10, help="steps per round")
    parser.add_argument("--dtypes", default="float32",
                        help="row dtypes of the distemb table: float32,bfloat16,float16")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 5 distemb steps per case: each kernel's share")
    parser.add_argument("--host-profile", action="store_true",
                        help="also cProfile 20 distemb steps per case: the host's share")
    results.add_arguments(parser, key=None)
    args = parser.parse_args(argv)
    if args.result_key is None:
        args.result_key = "profile" if args.profile or args.host_profile else "main"

    names = [n for n in args.optimizers.split(",") if n]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}, expected some of {sorted(OPTIMIZERS)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = sorted(set(dtypes) - {"float32", "bfloat16", "float16"})
    if bad or not dtypes:
        parser.error(f"--dtypes: expected some of float32,bfloat16,float16, got {args.dtypes!r}")
    try:
        cuda.require_cuda()
    except cuda.CudaUnavailableError as exc:
        sys.exit(f"bench_gpu_step: cannot run without a usable GPU: {exc}")
    with results.Recorder("bench_gpu_step", args, argv) as rec:
        rec.device(f"{torch.cuda.get_device_name(gpu())}, torch {torch.__version__}")
        measure(args, names, dtypes, rec)
    return 0


def measure(args, names, dtypes, rec):
    """Every (ids, optimizer, dtype) case: a line each."""
    device = gpu()
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: table "
          f"{args.rows:,} x {args.dim}, batch {args.batch:,}; median of "
          f"{args.rounds} rounds of {args.per_round} steps; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s")
    print(f"{'optimizer':>16} {'ids':>8} {'rows':>8} {'uniq':>5} | {'distemb':>9} "
          f"{'torch':>9} {'ratio':>6} {'vs f32':>6} {'det':>4} {'floor':>8} {'%floor':>6} | "
          f"{'gather':>8} {'dedup+upd':>9} {'x gather':>8}")
    gen = torch.Generator(device=device).manual_seed(0)
    w0 = torch.empty(args.rows, args.dim, device=device).uniform_(-0.01, 0.01, generator=gen)
    upstream = torch.randn(args.batch, args.dim, device=device, generator=gen)
    for seed, kind in enumerate(k for k in args.ids.split(",") if k):
        batches = make_batches(kind, args.rows, args.batch, args.rounds * args.per_round + 1,
                               seed, device)
        unique = statistics.mean(b.unique().numel() for b in batches)
        for name in names:
            base = bench_torch(args, name, batches, upstream, w0, device)
            t_gather, t_update = bench_kernels(args, name, batches, upstream, w0)
            floor = floor_seconds(args.batch, unique, args.dim, *OPTIMIZERS[name][2:],
                                  bandwidth)
            f32 = None
            for dtype in dtypes:
                ours = bench_distemb(args, name, batches, upstream, w0, dtype)
                f32 = ours if dtype == "float32" else f32
                det = deterministic(args, name, batches, upstream, w0, dtype)
                vs = f"{f32 / ours:5.2f}x" if f32 else "     -"
                print(f"{name:>16} {kind:>8} {dtype:>8} {unique / args.batch:5.0%} | "
                      f"{ours * 1e6:7.0f}us {base * 1e6:7.0f}us {base / ours:5.2f}x {vs} "
                      f"{'yes' if det else 'NO':>4} {floor * 1e6:6.0f}us {floor / ours:6.1%} | "
                      f"{t_gather * 1e6:6.0f}us {t_update * 1e6:7.0f}us "
                      f"{t_update / t_gather:7.2f}x", flush=True)
                case = f"{name}.{kind}.{dtype}"
                rec.figure(f"us.{case}", ours * 1e6, "{:.0f} us", f"distemb's step, {case}")
                rec.figure(f"vs_torch.{case}", base / ours, "{:.2f}x",
                           f"torch's step time over distemb's, {case}")
                rec.figure(f"deterministic.{case}", float(det), "{:.0f}",
                           f"1: two runs from the same weights gave identical tables, {case}")
            rec.figure(f"dedup_update_vs_gather.{name}.{kind}", t_update / t_gather, "{:.2f}x",
                       f"dedup + update kernels' time over the gather's, {name}, {kind} ids")


if __name__ == "__main__":
    sys.exit(main())
