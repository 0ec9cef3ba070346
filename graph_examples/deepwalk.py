"""DeepWalk / node2vec: skip-gram with negative sampling over random walks, on distemb tables.

Each step looks up B center rows in the node table and B * (1 + negatives) rows in the
context table, minimises -log s(u.v) - sum log s(-u.n), and lets a sparse Adam update
only those rows. `--backend torch` runs the same model on torch.nn.Embedding(sparse=True)
with torch.optim.SparseAdam, the baseline distemb is measured against.

Under ``distemb-launch`` (``$DISTEMB_CONFIG`` set) the tables live on the job's servers;
under ``torchrun`` they are sharded across the ranks (collective mode, no servers). Either
way trainer r of T trains on batches r, r + T, ... of the same seeded stream (every
trainer draws the whole stream and keeps its share; see shard()); after a barrier, every
trainer reads the node table (past any trainer cache) and rank 0 evaluates it. In
collective mode a step of T ranks is the step of one process on the T batches together.

Example:
    python graph_examples/deepwalk.py --dataset karate --epochs 5 --out out/karate
    python graph_examples/deepwalk.py --dataset wordnet --out out/deepwalk-wordnet
    distemb-launch --ip-config ip.txt --num-servers 2 --num-trainers 2 --cache-fraction 0.1 \
        -- python graph_examples/deepwalk.py --dataset wordnet --out out/dw-2x2
    torchrun --nproc-per-node 2 graph_examples/deepwalk.py --dataset wordnet --out out/dw-c2
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

# OpenMP threads that spin while idle (the default) slow every process sharing a small
# machine tens of times over; this must be set before torch and DGL load OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("DGLBACKEND", "pytorch")
if __package__ in (None, ""):
    # Run as a script (`python graph_examples/deepwalk.py`): make the package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import distemb  # noqa: E402
from distemb.pipeline import Prefetcher  # noqa: E402
from graph_examples.cli import data_option, format_table, job_mode  # noqa: E402
from graph_examples.datasets import DATASET_NAMES, GraphDataset, load_dataset  # noqa: E402
from graph_examples.evaluate import (link_prediction_auc, node_classification,  # noqa: E402
                                     split_edges)
from graph_examples.plots import save_training_plot  # noqa: E402
from graph_examples.stream import overlapped, shard  # noqa: E402
from graph_examples.tables import BACKENDS, OPTIMIZERS, make_tables  # noqa: E402
from graph_examples.walks import SkipGramBatches, pairs_per_epoch  # noqa: E402


def skipgram_loss(u: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Return the mean negative-sampling loss of a batch.

    Args:
        u: (B, D) center rows.
        v: (B, D) context rows.
        n: (B, K, D) negative rows.

    Returns:
        Scalar: mean over the batch of -log s(u.v) - sum_k log s(-u.n_k).
    """
    positive = F.logsigmoid((u * v).sum(-1))
    # A broadcast product, not bmm: B tiny (K x D)(D x 1) products are slower through
    # batched GEMM (14.4 ms vs 9.3 ms forward+backward at B=4096, K=5, D=128, 1 thread).
    negative = F.logsigmoid(-(n * u.unsqueeze(1)).sum(-1)).sum(-1)
    return -(positive + negative).mean()


def plain_loss(tables, batch) -> torch.Tensor:
    """Look up the batch's rows and return skipgram_loss() written with torch ops."""
    centers, contexts, negatives = batch
    b, k = negatives.shape
    u = tables.node(centers)
    # One context lookup for positives and negatives: one pull, one trace entry.
    ctx = tables.context(torch.cat([contexts, negatives.reshape(-1)]))
    return skipgram_loss(u, ctx[:b], ctx[b:].reshape(b, k, -1))


def unique_batch(batch):
    """A batch as unique ids and indices into them: what fused_loss() takes.

    Returns (center ids, center index (B,), context ids, positive index (B,), negative
    index (B, K)); made by the sampler, off the training step's path when prefetching.
    """
    centers, contexts, negatives = batch
    b, k = negatives.shape
    u_ids, u_idx = torch.unique(centers, return_inverse=True)
    c_ids, c_idx = torch.unique(torch.cat([contexts, negatives.reshape(-1)]),
                                return_inverse=True)
    return u_ids, u_idx, c_ids, c_idx[:b], c_idx[b:].view(b, k)


def fused_loss(tables, batch) -> torch.Tensor:
    """The same loss by distemb.skipgram_loss on a unique_batch(): one fused pass.

    Each row is looked up once and its gradient comes out of the pass already summed,
    so the optimizer's sum per id has nothing to add (see distemb/losses.py).
    """
    u_ids, u_idx, c_ids, pos_idx, neg_idx = batch
    return distemb.skipgram_loss(tables.node(u_ids), tables.context(c_ids), u_idx, pos_idx,
                                 neg_idx)


#: --loss: (how the sampler prepares a batch, how a step computes the loss from it); the
#: same value and gradients either way.
LOSSES = dict(fused=(unique_batch, fused_loss), torch=(lambda batch: batch, plain_loss))


def batch_lookups(tables, loss: str, batch):
    """The ``(DistEmbedding, ids)`` a prepared batch of ``--loss loss`` looks up (what
    :class:`~distemb.pipeline.Prefetcher` prefetches)."""
    if loss == "fused":
        u_ids, _, c_ids, _, _ = batch
        return [(tables.node_table, u_ids), (tables.context_table, c_ids)]
    centers, contexts, negatives = batch
    return [(tables.node_table, centers),
            (tables.context_table, torch.cat([contexts, negatives.reshape(-1)]))]


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line (see --help)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="karate", choices=DATASET_NAMES,
                   help="graph to embed (see graph_examples/datasets.py)")
    p.add_argument("--edges", help="edge list file, for --dataset edgelist")
    p.add_argument("--labels", help="node label file, for --dataset edgelist")
    p.add_argument("--data-opt", action="append", type=data_option, default=[],
                   metavar="KEY=VALUE", help="extra loader argument, e.g. num_nodes=100000")
    p.add_argument("--backend", choices=BACKENDS, default="distemb",
                   help="embedding tables and optimizer")
    p.add_argument("--device", default="cpu",
                   help="where the tables live and the step runs: 'cpu' or a CUDA device "
                   "('cuda', 'cuda:1'), for either backend")
    p.add_argument("--dim", type=int, default=128, help="embedding width")
    p.add_argument("--walk-length", type=int, default=20, help="nodes per walk")
    p.add_argument("--window", type=int, default=3, help="skip-gram window")
    p.add_argument("--num-walks", type=int, default=2, help="walks per node per epoch")
    p.add_argument("--p", type=float, default=1.0, help="node2vec return parameter")
    p.add_argument("--q", type=float, default=1.0, help="node2vec in-out parameter")
    p.add_argument("--negatives", type=int, default=5, help="negatives per pair")
    p.add_argument("--loss", choices=sorted(LOSSES), default="fused",
                   help="'fused': distemb.skipgram_loss on unique ids (forward and backward "
                   "in one compiled pass); 'torch': the same loss written with torch ops")
    p.add_argument("--prefetch", type=int, default=2,
                   help="batches the sampler keeps ready while a second thread trains "
                   "(0: sample and train in turn, in one thread)")
    p.add_argument("--prefetch-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="read each next batch's rows while the current batch trains "
                   "(distemb.pipeline.Prefetcher: tables on servers or other ranks; an "
                   "embedded table has nothing to read ahead)")
    p.add_argument("--prefetch-every-batch", action="store_true",
                   help="with --prefetch-rows: prefetch every batch, also where the "
                   "Prefetcher's own timing finds it no faster (idle_when_slower=False)")
    p.add_argument("--batch-size", type=int,
                   help=f"pairs per step (default: {DEFAULT_BATCH_SIZE:,}, or fewer on a "
                   f"small graph, so that an epoch has at least {MIN_STEPS_PER_EPOCH} "
                   "steps)")
    p.add_argument("--epochs", type=int, default=1, help="passes of fresh walks")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam",
                   help="sparse optimizer of both tables (torch's class of the same name "
                   "for --backend torch)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps (0: run every epoch to the end)")
    p.add_argument("--seed", type=int, default=0, help="seed for walks, negatives, init")
    p.add_argument("--link-prediction", type=float, default=0.0, metavar="FRACTION",
                   help="hide this fraction of edges before training and report ROC-AUC")
    p.add_argument("--eval-max-iter", type=int, default=300,
                   help="logistic regression iterations for node classification")
    p.add_argument("--table-name", help="distemb table-name prefix, the same in every "
                   "trainer of one job (default: fresh tables for this run)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="out/deepwalk", help="output directory")
    p.add_argument("--train-only", action="store_true",
                   help="train, then write this trainer's timing to OUT/train-rank<R>.json "
                   "(steps, seconds, phases, the end of each step); no evaluation, no plot "
                   "(benchmarks/bench_deepwalk_cluster.py)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("dim", "walk_length", "window", "num_walks", "negatives", "batch_size",
                 "epochs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.prefetch < 0:
        p.error(f"--prefetch: must be >= 0, got {args.prefetch}")
    if args.max_steps < 0:
        p.error(f"--max-steps: must be >= 0, got {args.max_steps}")
    if not 0.0 <= args.link_prediction < 1.0:
        p.error(f"--link-prediction: must be in [0, 1), got {args.link_prediction}")
    if args.dataset == "edgelist" and not args.edges:
        p.error("--dataset edgelist needs --edges PATH")
    return args


#: --batch-size's default on a large graph. 16,384: Micro-F1 0.5925 on WordNet against
#: 0.5762 with 4,096 and 0.5892 with 32,768 (lr 0.01; lr 0.02 gave 0.5416), and a quarter
#: of the steps' fixed costs per pair; at 32,768 the fused pass's rows outgrow the L3 cache
#: (benchmarks/README.md).
DEFAULT_BATCH_SIZE = 16384
#: The default batch shrinks on a small graph so that an epoch has at least this many
#: steps: the karate club's 7,344 pairs an epoch are less than one batch of 16,384.
MIN_STEPS_PER_EPOCH = 100
#: Fewer steps than this in a whole run, and the run says it will learn little.
FEW_STEPS = 100


def resolve_batch_size(args, graph) -> int:
    """Set ``args.batch_size`` where the command line left it out (see --batch-size) and
    return it."""
    if args.batch_size is None:
        pairs = pairs_per_epoch(graph, args.walk_length, args.window, args.num_walks)
        args.batch_size = max(1, min(DEFAULT_BATCH_SIZE, pairs // MIN_STEPS_PER_EPOCH))
    return args.batch_size


def load(args) -> GraphDataset:
    """Load the dataset named on the command line."""
    kwargs = dict(args.data_opt)
    if args.dataset == "edgelist":
        kwargs.update(path=args.edges, labels_path=args.labels)
    return load_dataset(args.dataset, **kwargs)


def train(graph, args, rank: int = 0, num_trainers: int = 1) -> dict:
    """Train skip-gram tables on walks over graph.

    Args:
        graph: the (possibly edge-reduced) training graph.
        args: parsed command line.
        rank, num_trainers: this trainer takes batches rank, rank + num_trainers, ...

    Returns:
        dict with 'embeddings' (N, dim) float32, 'losses' (per step), 'steps',
        'pairs', 'seconds', 'cpu_seconds' (of every thread of the process),
        'phase_seconds' (sample, forward_backward, step), 'step_ends' (seconds from
        the start of training to the end of each step) and 'prefetch_stats' (the
        client's prefetch counters; None without any).
    """
    resolve_batch_size(args, graph)
    tables = make_tables(args.backend, graph.num_nodes(), args.dim, args.lr, args.seed,
                         args.table_name, args.device, args.optimizer)
    batches = SkipGramBatches(graph, args.walk_length, args.window, args.num_walks,
                              args.negatives, args.batch_size, args.p, args.q, args.seed)
    total = -(-batches.pairs_per_epoch() // args.batch_size) * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    if rank == 0:
        say(f"training {total // num_trainers:,} steps of {args.batch_size:,} pairs "
            f"({args.epochs} epoch(s) of {batches.pairs_per_epoch():,} pairs"
            + (f", {num_trainers} trainers" if num_trainers > 1 else "") + ")")
        if total < FEW_STEPS:
            say(f"note: {total} steps learn little; for more, raise --epochs (now "
                f"{args.epochs}) or --num-walks, or lower --batch-size")
    losses, ends, pairs = [], [], 0
    # Where the time goes: waiting for a batch (walks, pairs, negatives; while
    # prefetching, only what the sampler thread did not hide), lookups with forward and
    # backward, and the optimizer step; 'sampler' is the sampler's own time.
    phase = dict(sample=0.0, forward_backward=0.0, step=0.0, sampler=0.0)
    prepare, loss_fn = LOSSES[args.loss]

    def made():  # (epoch, pairs, prepared batch), timed
        stream = ((epoch, batch) for epoch in range(args.epochs)
                  for batch in batches.epoch(epoch))
        it = shard(stream, rank, num_trainers, total)
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            if item is None:
                return
            epoch, batch = item
            item = (epoch, len(batch[0]), prepare(batch))
            phase["sampler"] += time.perf_counter() - t0
            yield item

    bar = tqdm(total=total // num_trainers, disable=args.quiet, unit="step",
               dynamic_ncols=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    tick = [start]

    def train_step(item):
        nonlocal pairs
        epoch, b, batch = item
        t1 = time.perf_counter()
        tables.zero_grad()
        loss = loss_fn(tables, batch)
        loss.backward()
        t2 = time.perf_counter()
        tables.step()
        losses.append(loss.item())
        tock = time.perf_counter()
        ends.append(tock - start)
        phase["sample"] += t1 - tick[0]
        phase["forward_backward"] += t2 - t1
        phase["step"] += tock - t2
        tick[0] = tock
        pairs += b
        bar.update(1)
        if len(losses) % 50 == 0:
            bar.set_postfix(epoch=epoch, loss=f"{np.mean(losses[-50:]):.4f}",
                            pairs_s=f"{pairs / (tock - start):,.0f}")

    # Each next batch's rows are read while the current one trains (in the thread that
    # trains: a client serves one thread); the torch backend has nothing to prefetch.
    rows_ahead = args.prefetch_rows and hasattr(tables, "node_table")
    overlapped(made(), train_step, args.prefetch, lambda items: Prefetcher(
        items, lambda item: batch_lookups(tables, args.loss, item[2]), rows_ahead,
        idle_when_slower=not args.prefetch_every_batch))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    bar.close()
    # rows read ahead, taken by lookups, patched by updates, read again (a client that
    # prefetches: on servers, collective, behind a cache)
    stats = getattr(distemb.current_context().client, "prefetch_stats", None) \
        if rows_ahead else None
    return dict(embeddings=export(tables, rank, num_trainers), losses=losses,
                steps=len(losses), pairs=pairs, seconds=seconds, cpu_seconds=cpu_seconds,
                phase_seconds=phase, step_ends=ends, prefetch_stats=stats and stats())


def export(tables, rank: int, num_trainers: int):
    """The trained node table (rank 0 of a job; None on other ranks).

    In a job, every trainer waits for the others to finish their steps, and rank 0 reads
    the table from the servers: a bounded-staleness trainer cache may still hold rows
    without other trainers' last updates, so it is emptied first.
    """
    if num_trainers == 1:
        return tables.export()
    client = distemb.current_context().client
    client.barrier()
    if hasattr(client, "invalidate"):  # a trainer cache (distemb.kvstore.caches.trainer)
        client.invalidate()
    # every trainer reads: in collective mode a read takes every rank
    emb = tables.export()
    client.barrier()  # the servers stay up until every trainer has read the table
    return emb if rank == 0 else None


def say(message: str) -> None:
    """Print one line of what the run is doing now (flushed: under a launcher too)."""
    print(f"deepwalk: {message}", flush=True)


def main(argv=None) -> dict:
    """Run DeepWalk from the command line; return the metrics written to metrics.json."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = job_mode()
    if mode is not None:  # a trainer of a distemb-launch job, or a rank under torchrun
        if args.backend != "distemb":
            raise SystemExit("--backend torch: a job of several trainers trains distemb "
                             "tables")
        ctx = distemb.initialize(mode=mode or None)
        try:
            return run(args, ctx.rank, ctx.num_trainers)
        finally:
            distemb.shutdown()
    return run(args)


def run(args, rank: int = 0, num_trainers: int = 1) -> dict:
    """Load, train (as trainer ``rank`` of ``num_trainers``), evaluate on rank 0."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if rank == 0:
        say(f"loading {args.edges if args.dataset == 'edgelist' else args.dataset}")
    dataset = load(args)
    load_s = time.perf_counter() - t0
    if rank == 0:
        say(f"loaded {dataset.graph.num_nodes():,} nodes, {dataset.graph.num_edges() // 2:,} "
            f"edges, {dataset.num_classes} classes in {load_s:.1f} s")
    graph, edges = dataset.graph, None
    if args.link_prediction:
        edges = split_edges(graph, args.link_prediction, args.seed)
        graph = edges.train_graph
    if num_trainers > 1 and not args.table_name:
        args.table_name = "deepwalk"  # every trainer of the job trains the same tables
    result = train(graph, args, rank, num_trainers)
    if args.train_only:
        timing = dict(rank=rank, trainers=num_trainers, load_seconds=load_s,
                      **{k: v for k, v in result.items() if k != "embeddings"})
        (out / f"train-rank{rank}.json").write_text(json.dumps(timing) + "\n")
        return timing
    emb = result["embeddings"]
    if rank != 0:
        print(f"trainer {rank}: {result['steps']} steps in {result['seconds']:.1f} s, "
              f"final loss {np.mean(result['losses'][-50:]):.4f}")
        return dict(rank=rank, steps=result["steps"], train_seconds=result["seconds"])

    metrics = dict(dataset=dataset.name, backend=args.backend, device=args.device,
                   trainers=num_trainers, nodes=graph.num_nodes(),
                   edges=dataset.graph.num_edges() // 2, dim=args.dim, epochs=args.epochs,
                   steps=result["steps"], pairs=result["pairs"],
                   train_seconds=round(result["seconds"], 2),
                   train_cpu_seconds=round(result["cpu_seconds"], 2),
                   load_seconds=round(load_s, 2),
                   pairs_per_second=round(result["pairs"] / result["seconds"]),
                   steps_per_second=round(result["steps"] / result["seconds"], 1),
                   **{f"{name}_seconds": round(sec, 2)
                      for name, sec in result["phase_seconds"].items()},
                   final_loss=round(float(np.mean(result["losses"][-50:])), 4))
    say(f"trained {result['steps']:,} steps in {result['seconds']:.1f} s")
    scores, per_class = None, {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    if dataset.num_classes >= 2 and len(dataset.train_idx):
        say(f"evaluating: logistic regression on {len(dataset.train_idx):,} training "
            f"nodes' embeddings, {dataset.num_classes} classes, F1 on "
            f"{len(dataset.test_idx):,} test nodes")
        scores = node_classification(emb, dataset, "test", args.eval_max_iter, args.seed)
        metrics.update(test_micro_f1=round(scores.micro_f1, 4),
                       test_macro_f1=round(scores.macro_f1, 4))
        per_class = {dataset.class_name(c): round(f, 4)
                     for c, f in scores.per_class_f1.items()}
    if edges is not None:
        say(f"evaluating: link prediction on {len(edges.pos_edges):,} hidden edges")
        metrics["link_auc"] = round(
            link_prediction_auc(emb, edges.pos_edges, edges.neg_edges, "dot"), 4)
    metrics.update(eval_seconds=round(time.perf_counter() - t0, 2),
                   eval_cpu_seconds=round(time.process_time() - cpu0, 2))

    np.save(out / "embeddings.npy", emb)
    np.save(out / "node_ids.npy", dataset.node_ids)
    (out / "metrics.json").write_text(json.dumps(dict(metrics, args=vars(args),
                                                      test_f1_per_class=per_class), indent=2,
                                                 default=str) + "\n")
    f1 = {} if scores is None else dict(per_class_f1=scores.per_class_f1,
                                          support=scores.support)
    labels = dataset.labels if dataset.num_classes else None  # no labels: one colour
    say(f"plotting {out}/report.png")
    save_training_plot(out / "report.png", result["losses"], emb, labels,
                       title=f"DeepWalk on {dataset.name} ({args.backend})",
                       class_names=dataset.class_names, **f1)
    print(format_table([(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else v)
                        for k, v in metrics.items()]))
    print(f"wrote {out}/embeddings.npy, node_ids.npy, metrics.json, report.png")
    return metrics


if __name__ == "__main__":
    main()
