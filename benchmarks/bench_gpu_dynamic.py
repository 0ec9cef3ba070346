"""A dynamic table's whole training step with its rows on the GPU, against the ways around it.

Each contender runs the user's step (a lookup of B int64 keys, the loss
``(rows * upstream).sum()``, ``backward()``, the optimizer's step) with Adagrad, on the
same batches of zipf(1.1) ids (duplicate-heavy), each id ``i`` standing for the key
``i * 3_000_000_000_019 - 2**62`` (keys spread over the int64 range):

- ``dynamic on GPU``: ``DynamicEmbedding(dim, device="cuda")``: rows and state on the
  GPU, the key index on the host (the new placement);
- ``dynamic on host, looked up onto GPU``: ``DynamicEmbedding(dim)`` with
  ``emb(keys, device="cuda")``: rows and state in host memory, gradients summed on the
  GPU and the sums copied back (how a GPU model trained a dynamic table before);
- ``dense on GPU``: ``DistEmbedding(N, dim, device="cuda")`` looked up by the ids
  themselves (what a fixed key set costs on the GPU: the ceiling);
- ``torch``: ``nn.Embedding(N, dim, sparse=True).cuda()`` with ``torch.optim.Adagrad``,
  used as its documentation says (``zero_grad()`` every step), looked up by the ids.

Every key is inserted before timing (one pass over all N keys), so the steps compare at
steady state. Rounds of steps synchronised once per round, the median round quoted, and
ratios against torch and against the host dynamic table. The two dynamic tables also
train a few steps from the same rows and are compared ("same": bit-identical rows).

Usage (needs a CUDA GPU and the CUDA kernels built)::

    python benchmarks/bench_gpu_dynamic.py [--keys 1000000] [--dim 128] [--batch 65536]
        [--rounds 7] [--per-round 10] [--dtype float32|bfloat16]
"""
import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import distemb  # noqa: E402
import results  # noqa: E402
from bench_gpu_step import time_rounds  # noqa: E402
from distemb.kernels import cuda  # noqa: E402
from distemb.stores import key_uniform  # noqa: E402

SCALE, BASE = 3_000_000_000_019, -2 ** 62


def dynamic(args, ctx, name, on_gpu):
    """A dynamic table holding every key, and its optimizer."""
    emb = distemb.DynamicEmbedding(args.dim, name=name, context=ctx, dtype=args.dtype,
                                   init_func=key_uniform(args.dim, -0.01, 0.01),
                                   device="cuda" if on_gpu else None)
    with torch.no_grad():  # every key inserted: the steps compare at steady state
        for chunk in (torch.arange(args.keys) * SCALE + BASE).split(1 << 20):
            emb(chunk)
    return emb, distemb.SparseAdagrad([emb], lr=0.01)


def contenders(args, device, upstream):
    """{name: (make() -> (step(ids, keys), close()))}: each made when it runs, alone."""
    def dyn(on_gpu):
        def make():
            ctx = distemb.DistContext.embedded(backend="pytorch")
            emb, opt = dynamic(args, ctx, "dyn", on_gpu)
            onto = None if on_gpu else device

            def step(ids, keys):
                (emb(keys, device=onto) * upstream).sum().backward()
                opt.step()
            return step, ctx.close
        return make

    def dense():
        ctx = distemb.DistContext.embedded(backend="pytorch")
        emb = distemb.DistEmbedding(args.keys, args.dim, name="dense", context=ctx,
                                    device="cuda", dtype=args.dtype)
        opt = distemb.SparseAdagrad([emb], lr=0.01)

        def step(ids, keys):
            (emb(ids) * upstream).sum().backward()
            opt.step()
        return step, ctx.close

    def torch_ref():
        ref = torch.nn.Embedding(args.keys, args.dim, sparse=True).to(device)
        opt = torch.optim.Adagrad(ref.parameters(), lr=0.01)

        def step(ids, keys):
            opt.zero_grad()
            (ref(ids) * upstream).sum().backward()
            opt.step()
        return step, lambda: None

    out = {"dynamic on GPU": dyn(True), "dynamic on host, looked up onto GPU": dyn(False),
           "dense on GPU": dense}
    if args.dtype == "float32":  # torch's sparse optimizers have no 16-bit rows
        out["torch"] = torch_ref
    return out


def same_training(args, device, upstream, batches, steps=5):
    """Whether the GPU and the host dynamic table give bit-identical rows after
    ``steps`` steps from the same rows (gradients summed on the GPU in both)."""
    ctx = distemb.DistContext.embedded(backend="pytorch")
    try:
        (gpu, opt_g), (host, opt_h) = (dynamic(args, ctx, "same-gpu", True),
                                       dynamic(args, ctx, "same-host", False))
        for _, keys in batches[:steps]:
            for emb, opt, onto in ((gpu, opt_g, None), (host, opt_h, device)):
                (emb(keys, device=onto) * upstream).sum().backward()
                opt.step()
        a, b = gpu.export(), host.export()
        return all(np.array_equal(a[c], b[c]) for c in b)
    finally:
        ctx.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    results.add_arguments(p)
    args = p.parse_args(argv)
    try:
        cuda.require_cuda()
    except cuda.CudaUnavailableError as exc:
        sys.exit(f"bench_gpu_dynamic: cannot run without a usable GPU: {exc}")
    with results.Recorder("bench_gpu_dynamic", args, argv) as rec:
        rec.device(f"{torch.cuda.get_device_name(torch.cuda.current_device())}, "
                   f"torch {torch.__version__}")
        return measure(args, rec)


def measure(args, rec):
    """Every contender's step in rounds; the table; whether both dynamic tables agree."""
    device = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(0)
    ids = (rng.zipf(1.1, size=(args.rounds * args.per_round + 1, args.batch)) - 1) % args.keys
    batches = [(torch.from_numpy(b).to(device), torch.from_numpy(b * SCALE + BASE))
               for b in ids.astype(np.int64)]
    gen = torch.Generator(device=device).manual_seed(0)
    upstream = torch.randn(args.batch, args.dim, device=device, generator=gen)
    unique = statistics.mean(len(np.unique(b)) for b in ids)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: {args.keys:,} "
          f"keys x {args.dim} {args.dtype}, batch {args.batch:,} zipf(1.1) ids "
          f"({unique / args.batch:.0%} unique), Adagrad; median of {args.rounds} rounds "
          f"of {args.per_round} steps")
    times = {}
    for name, make in contenders(args, device, upstream).items():
        step, close = make()
        try:
            times[name] = time_rounds(lambda b: step(*b), batches, args.rounds,
                                      args.per_round)
        finally:
            close()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    host = times["dynamic on host, looked up onto GPU"]
    print("| contender | ms/step | steps/s | vs host dynamic |"
          + (" vs torch |" if "torch" in times else ""))
    print("|---|---|---|---|" + ("---|" if "torch" in times else ""))
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.2f} | {1 / t:.1f} | {host / t:.2f}x |"
              + (f" {times['torch'] / t:.2f}x |" if "torch" in times else ""))
        key = name.split(",")[0].replace(" ", "_")
        rec.figure(f"ms.{key}", t * 1e3, "{:.2f} ms", f"{name}: the step")
        rec.figure(f"vs_host_dynamic.{key}", host / t, "{:.2f}x",
                   f"{name}: the host dynamic table's step time over this one's")
        if "torch" in times:
            rec.figure(f"vs_torch.{key}", times["torch"] / t, "{:.2f}x",
                       f"{name}: torch's step time over this one's")
    same = same_training(args, device, upstream, batches)
    print(f"GPU and host dynamic tables after 5 steps: {'same' if same else 'DIFFERENT'} rows")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
