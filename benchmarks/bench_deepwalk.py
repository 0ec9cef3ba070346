"""DeepWalk three ways on the same walks: distemb, torch sparse embeddings, gensim Word2Vec.

(a) distemb: DistEmbedding node and context tables + distemb.SparseAdam;
(b) torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam: what a user writes without
    distemb, the same batches (pairs and negatives) as (a);
(c) gensim Word2Vec (sg=1, negative sampling), the classic DeepWalk implementation, on the
    very same walks, with the same window (fixed, not shrunk), negatives and dimension.

Prints training wall time, pairs/s and node-classification Micro/Macro-F1 (logistic
regression on the frozen embeddings, the dataset's fixed split) side by side, with each
method's time as a ratio of (b)'s.

Example:
    .venv/bin/python benchmarks/bench_deepwalk.py --dataset wordnet
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


def main(argv=None):
    """Run the three methods; print the table (and return its rows)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="wordnet")
    p.add_argument("--threads", type=int, default=1, help="torch and gensim threads")
    p.add_argument("--methods", default="distemb,torch,gensim")
    p.add_argument("--max-steps", type=int, default=0, help="cap (a) and (b); 0: one epoch")
    p.add_argument("--lr", type=float, default=0.01)
    args, rest = p.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("DISTEMB_NUM_THREADS", str(args.threads))
    ds = load_dataset(args.dataset)
    # torch.optim.Optimizer's first construction imports torch._dynamo (~4 s): do it
    # before timing, so the method that happens to run first does not pay it alone.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    rows = []
    for method in args.methods.split(","):
        dw_args = deepwalk.parse_args(["--dataset", args.dataset, "--quiet", "--lr", str(args.lr),
                                       "--max-steps", str(args.max_steps), *rest,
                                       "--backend", "torch" if method == "torch" else "distemb",
                                       *(["--loss", "torch"] if method == "torch" else [])])
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
        scores = node_classification(emb, ds, "test", dw_args.eval_max_iter, dw_args.seed)
        rows.append((method, seconds, pairs, scores.micro_f1, scores.macro_f1))
        print(f"{method}: {seconds:.1f} s, Micro-F1 {scores.micro_f1:.4f}", flush=True)
    base = dict((r[0], r[1]) for r in rows).get("torch")
    print(f"\nDeepWalk on {args.dataset} ({ds.graph.num_nodes():,} nodes), threads={args.threads}")
    print(f"{'method':<10} {'train s':>9} {'pairs/s':>11} {'Micro-F1':>9} {'Macro-F1':>9}"
          f" {'time / torch':>13}")
    for method, seconds, pairs, micro, macro in rows:
        rate = f"{pairs / seconds:,.0f}" if pairs else "-"
        ratio = f"{seconds / base:.2f}x" if base else "-"
        print(f"{method:<10} {seconds:>9.1f} {rate:>11} {micro:>9.4f} {macro:>9.4f} {ratio:>13}")
    return rows


if __name__ == "__main__":
    main()
