"""DeepWalk three ways on the same walks: distemb, torch sparse embeddings, gensim Word2Vec.

(a) distemb: DistEmbedding node and context tables + distemb.SparseAdam;
(b) torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam: what a user writes without
    distemb, the same batches (pairs and negatives) as (a);
(c) gensim Word2Vec (sg=1, negative sampling), the classic DeepWalk implementation, on the
    very same walks, with the same window (fixed, not shrunk), negatives and dimension.

Prints training wall time, the process's CPU time over training (every thread: distemb's
sampler, gensim's job producer), pairs/s and node-classification Micro/Macro-F1 (logistic
regression on the frozen embeddings, the dataset's fixed split) side by side, with each
method's time as a ratio of (b)'s and of (c)'s where they ran. Options this script does
not know (``--optimizer``, ``--batch-size``, ...) go to graph_examples/deepwalk.py's
parser for (a) and (b), and the walk options to (c).

``--profile STEPS`` instead times the parts of distemb's own training step (one thread,
no prefetch) over STEPS steps and prints milliseconds per step for each.

Example:
    .venv/bin/python benchmarks/bench_deepwalk.py --dataset wordnet
    .venv/bin/python benchmarks/bench_deepwalk.py --dataset wordnet --profile 600
"""
import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("DGLBACKEND", "pytorch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import results  # noqa: E402
from graph_examples import deepwalk  # noqa: E402
from graph_examples.datasets import load_dataset  # noqa: E402
from graph_examples.evaluate import node_classification  # noqa: E402
from graph_examples.walks import SkipGramBatches  # noqa: E402


def gensim_embeddings(graph, args, threads):
    """Train gensim Word2Vec on the walks of epoch 0..epochs-1; (embeddings, seconds)."""
    from gensim.models import Word2Vec  # optional: only this baseline needs it

    batches = SkipGramBatches(graph, args.walk_length, args.window, args.num_walks,
                              args.negatives, args.batch_size, args.p, args.q, args.seed)
    sentences = []
    for epoch in range(args.epochs):
        for walks in batches.walk_chunks(epoch, batches.generator(epoch)):
            for walk in walks.tolist():
                sentences.append([str(n) for n in walk if n >= 0])
    start = time.perf_counter()
    model = Word2Vec(sentences, vector_size=args.dim, window=args.window, sg=1, hs=0,
                     negative=args.negatives, min_count=0, sample=0, shrink_windows=False,
                     workers=threads, epochs=1, seed=args.seed)
    seconds = time.perf_counter() - start
    emb = np.zeros((graph.num_nodes(), args.dim), np.float32)
    for key, i in model.wv.key_to_index.items():
        emb[int(key)] = model.wv.vectors[i]
    return emb, seconds


class _Timer:
    """Seconds per named part, wall (perf_counter) and this process's CPU time."""

    def __init__(self):
        self.wall, self.cpu = {}, {}

    def wrap(self, name, fn):
        def timed(*a, **kw):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - w, time.process_time() - c)
        return timed

    def add(self, name, wall, cpu):
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu


def profile_step(graph, dw_args, steps, warmup=50):
    """Time the parts of graph_examples/deepwalk.py's distemb step, in one thread.

    The parts: drawing a batch (walks, pairs, negatives), preparing it (unique ids),
    the two lookups, the loss's forward, backward, the optimizer's coalescing of the
    traced gradients and its update kernel (the client's ``coalesce`` and
    ``push_update``, timed by wrapping them), and what is left of the step (Python,
    autograd, hooks). Returns {part: (wall ms, CPU ms) per step} over ``steps`` steps
    after ``warmup``.
    """
    from graph_examples.tables import make_tables

    tables = make_tables("distemb", graph.num_nodes(), dw_args.dim, dw_args.lr,
                         dw_args.seed, optimizer=dw_args.optimizer)
    batches = SkipGramBatches(graph, dw_args.walk_length, dw_args.window, dw_args.num_walks,
                              dw_args.negatives, dw_args.batch_size, dw_args.p, dw_args.q,
                              dw_args.seed)
    prepare, loss_fn = deepwalk.LOSSES[dw_args.loss]
    t = _Timer()
    # The parts inside the tables' calls, timed by wrapping the public objects they use.
    for emb in (tables.node_table, tables.context_table):
        client = emb.kvstore
        for name in ("coalesce", "push_update", "pull"):
            if not hasattr(client, f"_prof_{name}"):
                setattr(client, f"_prof_{name}", getattr(client, name))
                setattr(client, name, t.wrap({"pull": "lookup: pull"}.get(name, f"step: {name}"),
                                             getattr(client, f"_prof_{name}")))
    it = batches.epoch(0)
    hidden = {}
    for i in range(warmup + steps):
        if i == warmup:
            hidden = dict(t.wall), dict(t.cpu)
        batch = t.wrap("sample", lambda: next(it))()
        batch = t.wrap("prepare (unique ids)", prepare)(batch)
        w0, c0 = time.perf_counter(), time.process_time()
        tables.zero_grad()
        loss = loss_fn(tables, batch)
        w1, c1 = time.perf_counter(), time.process_time()
        loss.backward()
        w2, c2 = time.perf_counter(), time.process_time()
        tables.step()
        loss.item()
        w3, c3 = time.perf_counter(), time.process_time()
        t.add("lookups + loss forward", w1 - w0, c1 - c0)
        t.add("backward", w2 - w1, c2 - c1)
        t.add("step", w3 - w2, c3 - c2)
    out = {}
    for name in t.wall:
        wall = t.wall[name] - hidden[0].get(name, 0.0)
        cpu = t.cpu[name] - hidden[1].get(name, 0.0)
        out[name] = (1e3 * wall / steps, 1e3 * cpu / steps)
    # Nested parts are inside their enclosing part: report the enclosing part's rest.
    for outer, prefix in (("lookups + loss forward", "lookup: "), ("step", "step: ")):
        for name in [n for n in out if n.startswith(prefix)]:
            out[outer] = tuple(a - b for a, b in zip(out[outer], out[name]))
    return out


def main(argv=None):
    """Run the three methods; print the table (and return its rows)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="wordnet")
    p.add_argument("--threads", type=int, default=1, help="torch and gensim threads")
    p.add_argument("--methods", default="distemb,torch,gensim")
    p.add_argument("--max-steps", type=int, default=0, help="cap (a) and (b); 0: one epoch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="time the parts of distemb's step over STEPS steps instead")
    results.add_arguments(p, key=None)
    args, rest = p.parse_known_args(argv)
    if args.result_key is None:
        args.result_key = "profile" if args.profile else "main"
    with results.Recorder("bench_deepwalk", args, argv) as rec:
        return run(args, rest, rec)


def run(args, rest, rec):
    """The methods (or the profile) of one invocation, printed and named as figures."""
    torch.set_num_threads(args.threads)
    os.environ.setdefault("DISTEMB_NUM_THREADS", str(args.threads))
    ds = load_dataset(args.dataset)
    # torch.optim.Optimizer's first construction imports torch._dynamo (~4 s): do it
    # before timing, so the method that happens to run first does not pay it alone.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    if args.profile:
        dw_args = deepwalk.parse_args(["--dataset", args.dataset, "--quiet", "--lr",
                                       str(args.lr), *rest])
        deepwalk.resolve_batch_size(dw_args, ds.graph)
        parts = profile_step(ds.graph, dw_args, args.profile)
        print(f"distemb step parts on {args.dataset}, {args.profile} steps of "
              f"{dw_args.batch_size} pairs, loss {dw_args.loss}, threads={args.threads}:")
        print(f"{'part':<28} {'wall ms':>8} {'CPU ms':>8}")
        for name, (wall, cpu) in parts.items():
            print(f"{name:<28} {wall:>8.2f} {cpu:>8.2f}")
            rec.figure(f"cpu_ms.{slug(name)}", cpu, "{:.2f} ms",
                       f"CPU ms per step of distemb's step part '{name}'")
        total = [sum(v[i] for v in parts.values()) for i in (0, 1)]
        print(f"{'total':<28} {total[0]:>8.2f} {total[1]:>8.2f}")
        return parts
    rows = []
    for method in args.methods.split(","):
        dw_args = deepwalk.parse_args(["--dataset", args.dataset, "--quiet", "--lr", str(args.lr),
                                       "--max-steps", str(args.max_steps), *rest,
                                       "--backend", "torch" if method == "torch" else "distemb",
                                       *(["--loss", "torch"] if method == "torch" else [])])
        deepwalk.resolve_batch_size(dw_args, ds.graph)  # gensim's walks: the same batches
        cpu = time.process_time()  # every thread of the process: sampler, gensim's producer
        if method == "gensim":
            emb, seconds = gensim_embeddings(ds.graph, dw_args, args.threads)
            pairs = None
        else:
            result = deepwalk.train(ds.graph, dw_args)
            emb, seconds, pairs = result["embeddings"], result["seconds"], result["pairs"]
            print(f"{method} step parts (s, sample = waiting for a batch; sampler = the "
                  "sampler's own time, overlapped when prefetching): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in result["phase_seconds"].items()),
                  flush=True)
        cpu = time.process_time() - cpu
        scores = node_classification(emb, ds, "test", dw_args.eval_max_iter, dw_args.seed)
        rows.append((method, seconds, cpu, pairs, scores.micro_f1, scores.macro_f1))
        print(f"{method}: {seconds:.1f} s ({cpu:.1f} s CPU), Micro-F1 {scores.micro_f1:.4f}",
              flush=True)
    times = {r[0]: r[1] for r in rows}
    bases = [b for b in ("torch", "gensim") if b in times]
    print(f"\nDeepWalk on {args.dataset} ({ds.graph.num_nodes():,} nodes), threads={args.threads}"
          f", distemb: {' '.join(rest) or 'defaults'}")
    print(f"{'method':<10} {'train s':>9} {'CPU s':>8} {'pairs/s':>11} {'Micro-F1':>9} "
          f"{'Macro-F1':>9}" + "".join(f" {'time / ' + b:>14}" for b in bases))
    for method, seconds, cpu, pairs, micro, macro in rows:
        rate = f"{pairs / seconds:,.0f}" if pairs else "-"
        ratios = "".join(f" {seconds / times[b]:>13.2f}x" for b in bases)
        print(f"{method:<10} {seconds:>9.1f} {cpu:>8.1f} {rate:>11} {micro:>9.4f} {macro:>9.4f}"
              + ratios)
        rec.figure(f"train_s.{method}", seconds, "{:.1f} s", f"{method}: training time")
        rec.figure(f"cpu_s.{method}", cpu, "{:.1f} s", f"{method}: CPU time of the process")
        rec.figure(f"micro_f1.{method}", micro, "{:.4f}", f"{method}: test Micro-F1")
        rec.figure(f"macro_f1.{method}", macro, "{:.4f}", f"{method}: test Macro-F1")
        for b in bases:
            rec.figure(f"time_vs_{b}.{method}", seconds / times[b], "{:.2f}x",
                       f"{method}'s training time over {b}'s, same run")
    return rows


def slug(name):
    """A name as part of a figure name: 'step: coalesce' -> 'step_coalesce'."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


if __name__ == "__main__":
    main()
