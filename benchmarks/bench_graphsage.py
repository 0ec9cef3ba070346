"""GraphSAGE with a learnable input table: distemb vs torch.nn.Embedding(sparse=True).

Both contenders are ``graph_examples/graphsage.py``'s own ``Learner`` (its training step):
a mean-aggregator SAGE model over DGL ``NeighborSampler`` blocks whose input features are
a learnable table, cross-entropy, the dense layers on ``torch.optim.Adam``, the table on a
sparse optimizer of one rule:

- ``distemb``: ``distemb.DistEmbedding`` (embedded) with distemb's optimizer of the rule;
- ``torch`` (the baseline): ``torch.nn.Embedding(sparse=True)`` with torch's optimizer of
  the same rule, as torch's docs pair them (``SparseAdam``; ``Adagrad`` and ``SGD``
  accept sparse gradients), ``zero_grad()`` every step.

They train in lockstep on the SAME batches: each batch DGL samples once is one step of
each contender, taken in turns (which goes first alternates), so load from other jobs on
this shared machine hits both alike. Each keeps its own torch random state (dropout), and
both start from the same rows and weights, so they train the same model: the run prints
the largest loss difference (float32 rounding apart, the losses are equal) and each
contender's validation accuracy after the first round. Per round, the median over steps
(after ``--warmup``) of the step (lookup, forward, backward, both optimizers) and of two
parts of it (the table's lookup, the table's optimizer step); ``vs torch`` is the median
over steps of torch's step / this contender's step on the same batch; the table shows the
median over rounds. Sampling is timed once per batch and paid by both.

Usage::

    PYTHONPATH=. python benchmarks/bench_graphsage.py [--dataset wordnet] [--steps 60]
        [--warmup 5] [--rounds 3] [--optimizers adam,adagrad,sgd] [--dim 64]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import distemb  # noqa: E402
import results  # noqa: E402
from graph_examples import graphsage  # noqa: E402
from graph_examples.datasets import load_dataset  # noqa: E402

BACKENDS = ("distemb", "torch")
NAMES = {"distemb": "distemb.DistEmbedding", "torch": "nn.Embedding(sparse=True)"}


def sage_args(args, backend, optimizer):
    return graphsage.parse_args([
        "--dataset", args.dataset, "--dim", str(args.dim), "--hidden", str(args.hidden),
        "--fanouts", args.fanouts, "--batch-size", str(args.batch_size),
        "--optimizer", optimizer, "--backend", backend, "--emb-lr", str(args.emb_lr),
        "--seed", str(args.seed), "--quiet"])


def lockstep(ds, args, optimizer, seed, evaluate=False):
    """Both contenders, ``warmup + steps`` steps on the same batches; per contender the
    median ms of step, lookup and optimizer step, the paired ratio, losses (and accuracy)."""
    ctx = distemb.initialize()
    try:
        learners, rng = {}, {}
        for b in BACKENDS:
            learners[b] = graphsage.Learner(ds, sage_args(args, b, optimizer), ctx)
            rng[b] = torch.get_rng_state()  # equal: Learner seeds torch first
        times = {b: [] for b in BACKENDS}
        losses = {b: [] for b in BACKENDS}
        sample = []
        total = args.warmup + args.steps
        fanouts = sage_args(args, "torch", optimizer).fanouts
        loader = iter(graphsage._loader(ds.graph, ds.train_idx, fanouts, args.batch_size,
                                        True, seed))
        for i in range(total):
            t0 = time.perf_counter()
            batch = next(loader, None)
            if batch is None:  # an epoch ended: the next one
                loader = iter(graphsage._loader(ds.graph, ds.train_idx, fanouts,
                                                args.batch_size, True, seed + i))
                batch = next(loader)
            input_nodes, output_nodes, blocks = batch
            sample.append(time.perf_counter() - t0)
            labels = ds.labels[output_nodes]
            for b in (BACKENDS if i % 2 == 0 else BACKENDS[::-1]):
                torch.set_rng_state(rng[b])  # its own dropout masks, as if alone
                t1 = time.perf_counter()
                loss, lookup_s, sparse_s = learners[b].step(input_nodes, blocks, labels)
                times[b].append((time.perf_counter() - t1, lookup_s, sparse_s))
                rng[b] = torch.get_rng_state()
                losses[b].append(loss)
        out = {}
        for b in BACKENDS:
            t = np.asarray(times[b][args.warmup:])
            mine = dict(zip(("step", "lookup", "sparse_step"), 1e3 * np.median(t, axis=0)))
            mine["vs_torch"] = float(np.median(np.asarray(times["torch"][args.warmup:])[:, 0]
                                               / t[:, 0]))
            mine["sample"] = 1e3 * float(np.median(sample[args.warmup:]))
            mine["losses"] = np.asarray(losses[b])
            if evaluate:
                learner = learners[b]
                mine["val_accuracy"], _ = graphsage.evaluate(
                    learner.model, learner.emb, ds.graph, ds.labels, ds.val_idx,
                    sage_args(args, b, optimizer))
            out[b] = mine
        return out
    finally:
        distemb.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="wordnet")
    p.add_argument("--steps", type=int, default=60, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=5, help="steps before timing")
    p.add_argument("--rounds", type=int, default=3, help="rounds, fresh models (medians)")
    p.add_argument("--optimizers", default="adam,adagrad,sgd",
                   help="rules, each run on both backends")
    p.add_argument("--dim", type=int, default=64, help="width of the learnable input table")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--fanouts", default="10,10")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--emb-lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    results.add_arguments(p)
    args = p.parse_args()
    optimizers = args.optimizers.split(",")
    for name in optimizers:
        if name not in graphsage.TORCH_OPTIMIZERS:
            p.error(f"--optimizers: {name!r} has no torch counterpart; expected some of "
                    f"{sorted(graphsage.TORCH_OPTIMIZERS)}")
    with results.Recorder("bench_graphsage", args) as rec:
        measure(args, optimizers, rec)


def measure(args, optimizers, rec):
    """Both contenders in lockstep, every rule, ``args.rounds`` rounds; the table."""
    torch.set_num_threads(1)
    graphsage.dgl.utils.set_num_threads(1)
    ds = load_dataset(args.dataset)
    print(f"# bench_graphsage: {args.dataset} ({ds.graph.num_nodes()} nodes, "
          f"{len(ds.train_idx)} training), dim={args.dim} hidden={args.hidden} fanouts="
          f"{args.fanouts} batch={args.batch_size}, {args.steps} timed steps after "
          f"{args.warmup} per round, lockstep on the same batches, {args.rounds} rounds, "
          f"1 torch and DGL thread, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
          flush=True)
    runs = {o: [] for o in optimizers}
    for r in range(args.rounds):
        for o in optimizers:
            got = lockstep(ds, args, o, args.seed + 1000 * r, evaluate=(r == 0))
            runs[o].append(got)
            d, t = got["distemb"], got["torch"]
            print(f"round {r + 1}/{args.rounds} {o}: step distemb {d['step']:.1f} ms, torch "
                  f"{t['step']:.1f} ms, paired ratio {d['vs_torch']:.2f}x; largest loss "
                  f"difference {np.abs(d['losses'] - t['losses']).max():.2e}; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    print("\nms per step: medians over steps, then over rounds; vs torch: median over steps of "
          "torch's step / this step on the same batch, then over rounds\n")
    print("| optimizer | table | step | lookup | table's optimizer step | vs torch "
          "| sampling (each batch, both) | val. accuracy (round 1) | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for o in optimizers:
        diff = max(np.abs(x["distemb"]["losses"] - x["torch"]["losses"]).max()
                   for x in runs[o])
        for b in BACKENDS:
            def med(key, b=b):
                return float(np.median([x[b][key] for x in runs[o]]))

            opt = (graphsage.OPTIMIZERS if b == "distemb" else graphsage.TORCH_OPTIMIZERS)[o]
            print(f"| {o} | {NAMES[b]} + {opt.__module__.split('.')[0]}.{opt.__name__} | "
                  f"{med('step'):.1f} | {med('lookup'):.1f} | {med('sparse_step'):.1f} | "
                  f"{med('vs_torch'):.2f}x | {med('sample'):.1f} | "
                  f"{runs[o][0][b]['val_accuracy']:.3f} | {diff:.1e} |")
            rec.figure(f"step_ms.{o}.{b}", med("step"), "{:.1f} ms", f"{NAMES[b]}, {o}: step")
            if b == "distemb":
                rec.figure(f"vs_torch.{o}", med("vs_torch"), "{:.2f}x",
                           f"{o}: torch's step over distemb's on the same batch (paired)")
                rec.figure(f"max_loss_diff.{o}", diff, "{:.1e}",
                           f"{o}: largest loss difference between the two, any step")


if __name__ == "__main__":
    main()
