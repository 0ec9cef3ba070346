"""Node2Vec on WordNet: distemb.pyg.Node2Vec vs PyG's own Node2Vec, one thread each.

The graph is graph_examples' WordNet (``--dataset``, another of graph_examples' datasets
for a quick run): 117,659 synsets, every pointer as one undirected edge (183,789), both
directions given to the models.

The baseline is PyG 2.8's ``torch_geometric.nn.Node2Vec`` used as its own example
(examples/node2vec.py) uses it: ``sparse=True``, ``torch.optim.SparseAdam(list(
model.parameters()), lr=0.01)``, ``embedding_dim=128, walk_length=20, context_size=10,
walks_per_node=10, num_negative_samples=1``, batches of 128 start nodes, and
``optimizer.zero_grad(); loss = model.loss(pos_rw, neg_rw); loss.backward();
optimizer.step()`` per batch. distemb's model is the same call with
``distemb.SparseAdam([model.embedding], lr=0.01)``.

PyG's model walks with pyg-lib's compiled ``random_walk``, which is not on PyPI and
cannot be installed here: distemb's plain-torch walker stands in for it (and the script
says so). Both models train on the very same batches (the windows PyG's ``sample``
draws), so the step ratio compares the steps alone; the sampling time (the same walker
for both) is timed once and added to each for the epoch estimate.

Method: both start from the same rows; the timed batches are cycled in turns of
``--turn`` steps per model, so load from other jobs hits both alike; a model's step time
is the median over its turns of the turn's mean. The epoch estimate is
``ceil(N / batch) * (step + sample)``.

Example:
    .venv/bin/python benchmarks/bench_node2vec.py --batches 40
"""
import argparse
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["DISTEMB_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import distemb  # noqa: E402
import results  # noqa: E402
from distemb.pyg import Node2Vec, RandomWalker  # noqa: E402
from graph_examples.datasets import load_dataset  # noqa: E402
from torch_geometric.nn import Node2Vec as PygNode2Vec  # noqa: E402
from torch_geometric.nn.models import node2vec as pyg_node2vec  # noqa: E402

EXAMPLE = dict(embedding_dim=128, walk_length=20, context_size=10, walks_per_node=10,
               num_negative_samples=1, p=1.0, q=1.0)


def _stand_in_walker():
    """pyg-lib's ``torch.ops.pyg.random_walk`` is not installable: distemb's walker in its
    place, for PyG's model only (PyG's code is otherwise as installed)."""
    if pyg_node2vec.WITH_PYG_LIB:
        return "pyg-lib"

    def random_walk(rowptr, col, start, walk_length, p, q):
        return RandomWalker(rowptr, col)(start, walk_length, p, q)
    pyg_node2vec.WITH_PYG_LIB = True
    torch.ops.pyg.random_walk = random_walk
    return "distemb.pyg.RandomWalker standing in for pyg-lib's random_walk"


def _cpu():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=40, help="batches timed per model")
    ap.add_argument("--turn", type=int, default=4, help="steps per model per turn")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="wordnet", help="graph_examples' dataset")
    results.add_arguments(ap)
    args = ap.parse_args(argv)
    with results.Recorder("bench_node2vec", args, argv) as rec:
        measure(args, rec)


def measure(args, rec):
    """Both models on the same batches, in turns; the table."""
    torch.set_num_threads(1)
    walker = _stand_in_walker()
    graph = load_dataset(args.dataset).graph  # simple, bidirected (docs/graph-examples.md)
    edge_index = torch.stack(graph.edges())
    num_nodes = graph.num_nodes()

    torch.manual_seed(args.seed)
    pyg = PygNode2Vec(edge_index, sparse=True, **EXAMPLE)
    ours = Node2Vec(edge_index, name="bench-node2vec", **EXAMPLE)
    ours.embedding.weight[slice(0, num_nodes)] = pyg.embedding.weight.detach()
    pyg_opt = torch.optim.SparseAdam(list(pyg.parameters()), lr=0.01)
    our_opt = distemb.SparseAdam([ours.embedding], lr=0.01)

    order = torch.randperm(num_nodes)
    starts = [order[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.batches)]
    t0 = time.perf_counter()
    batches = [pyg.sample(b) for b in starts]
    sample_s = (time.perf_counter() - t0) / len(batches)

    def pyg_step(pos, neg):
        pyg_opt.zero_grad()
        loss = pyg.loss(pos, neg)
        loss.backward()
        pyg_opt.step()
        return loss.item()

    def our_step(pos, neg):
        our_opt.zero_grad()
        loss = ours.loss(pos, neg)
        loss.backward()
        our_opt.step()
        return loss.item()

    models = {"PyG Node2Vec + torch SparseAdam": pyg_step,
              "distemb.pyg.Node2Vec + distemb SparseAdam": our_step}
    for step in models.values():  # warm-up: first-touch of the tables and state
        step(*batches[0])
    turns = {name: [] for name in models}
    losses = {name: [] for name in models}
    for at in range(0, len(batches), args.turn):
        chunk = batches[at:at + args.turn]
        for name, step in models.items():
            t0 = time.perf_counter()
            losses[name] += [step(pos, neg) for pos, neg in chunk]
            turns[name].append((time.perf_counter() - t0) / len(chunk))

    per_epoch = math.ceil(num_nodes / args.batch_size)
    print(f"Node2Vec on {args.dataset} ({num_nodes} nodes, {edge_index.size(1)} directed edges), "
          f"PyG's example settings {EXAMPLE}, batch {args.batch_size}, 1 thread")
    print(f"CPU: {_cpu()}; torch {torch.__version__}; walker: {walker}")
    print(f"{args.batches} batches per model, in turns of {args.turn}; sampling "
          f"{sample_s * 1e3:.0f} ms per batch (same walker for both)")
    base = float(np.median(turns[next(iter(models))]))
    print(f"{'model':45s} {'step ms':>9s} {'epoch s (est.)':>15s} {'step x':>7s} "
          f"{'epoch x':>8s}")
    for name in models:
        step_s = float(np.median(turns[name]))
        epoch = per_epoch * (step_s + sample_s)
        print(f"{name:45s} {step_s * 1e3:9.0f} {epoch:15.0f} {base / step_s:7.2f} "
              f"{(base + sample_s) / (step_s + sample_s):8.2f}")
        key = "pyg" if name.startswith("PyG") else "distemb"
        rec.figure(f"step_ms.{key}", step_s * 1e3, "{:.0f} ms", f"{name}: a step")
        rec.figure(f"step_speedup.{key}", base / step_s, "{:.2f}x",
                   f"{name}: PyG's step time over this one's")
        rec.figure(f"epoch_speedup.{key}", (base + sample_s) / (step_s + sample_s), "{:.2f}x",
                   f"{name}: PyG's estimated epoch time over this one's (sampling included)")
    diff = max(abs(a - b) for a, b in zip(*losses.values()))
    print(f"largest difference between the two models' losses over the run: {diff:.2e}")
    rec.figure("max_loss_diff", diff, "{:.1e}", "largest difference between the two models' "
               "losses over the run")


if __name__ == "__main__":
    main()
