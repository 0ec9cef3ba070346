"""GraphSAGE whose input features are a learnable DistEmbedding (nodes have no features).

DGL's NeighborSampler + DataLoader yield blocks; the sampled input nodes are looked up in
a distemb table, which a sparse optimizer updates (only those rows), while the dense
SAGE layers use torch.optim.Adam. Node classification; reports accuracy.
``--backend torch`` runs the same model on ``torch.nn.Embedding(sparse=True)`` with
torch's optimizer of the same rule (the baseline of ``benchmarks/bench_graphsage.py``):
the same seed gives the same initial rows, batches and dropout on either backend (the
batches only with one DGL thread: its parallel neighbour sampling is not repeatable).
``--first-layer bag`` pools the first layer's input straight from the table: each
destination node's mean over its sampled neighbours is one pooled lookup,
``emb.bag(neighbours, offsets, mode="mean")`` (:mod:`distemb.bags`), beside its own row,
where DGL's ``SAGEConv`` takes every input node's row and averages them over the block's
edges (``--first-layer sage``, the default: the same model, unpooled).

Runs unchanged embedded (the default), under ``distemb-launch`` with several trainers,
and under ``torchrun`` (collective mode: each rank holds a shard of the table, no
servers): each trainer then takes its share of the training nodes and the dense layers
are wrapped in DistributedDataParallel (gloo) using the MASTER_ADDR/RANK/WORLD_SIZE the
launcher sets.

Example:
    python graph_examples/graphsage.py --dataset wordnet --epochs 3 --out out/graphsage-wordnet
    python graph_examples/graphsage.py --dataset wordnet --epochs 3 --first-layer bag
    torchrun --nproc-per-node 2 graph_examples/graphsage.py --dataset wordnet --out out/gs-c2
"""
import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch/DGL load OpenMP
os.environ.setdefault("DGLBACKEND", "pytorch")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import distemb  # noqa: E402
from distemb.integrations.dgl import dgl, lookup  # noqa: E402
from distemb.pipeline import Prefetcher  # noqa: E402
from graph_examples.datasets import load_dataset  # noqa: E402
from graph_examples.cli import data_option, format_table, job_mode  # noqa: E402
from graph_examples.plots import save_training_plot  # noqa: E402

OPTIMIZERS = {"adam": distemb.SparseAdam, "adagrad": distemb.SparseAdagrad,
              "rowwise_adagrad": distemb.SparseRowWiseAdagrad, "sgd": distemb.SparseSGD}
# torch's optimizer of the same rule on nn.Embedding(sparse=True) (row-wise Adagrad has none)
TORCH_OPTIMIZERS = {"adam": torch.optim.SparseAdam, "adagrad": torch.optim.Adagrad,
                    "sgd": torch.optim.SGD}
BACKENDS = ("distemb", "torch")
FIRST_LAYERS = ("sage", "bag")


class PooledSAGEConv(torch.nn.Module):
    """DGL's ``SAGEConv(in_dim, out_dim, "mean")`` whose input is already aggregated:
    ``(rows of the destination nodes, mean of each one's sampled neighbours' rows)``, as
    :func:`first_inputs` pools them from the table (the same parameters and initialiser
    as SAGEConv's: ``fc_self(h) + fc_neigh(mean)``, the bias in ``fc_self``)."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.fc_self = torch.nn.Linear(in_dim, out_dim)
        self.fc_neigh = torch.nn.Linear(in_dim, out_dim, bias=False)
        gain = torch.nn.init.calculate_gain("relu")
        torch.nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        torch.nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)

    def forward(self, block, x):
        h_self, h_neigh = x
        return self.fc_self(h_self) + self.fc_neigh(h_neigh)


class SAGE(torch.nn.Module):
    """Mean-aggregator GraphSAGE over DGL blocks; ``hidden`` returns the last hidden layer.

    ``pooled``: the first layer takes :func:`first_inputs`' pooled pair, not every input
    node's row."""

    def __init__(self, in_dim, hidden, num_classes, num_layers, dropout=0.2, pooled=False):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = torch.nn.ModuleList(
            (PooledSAGEConv(a, b) if pooled and i == 0 else dgl.nn.SAGEConv(a, b, "mean"))
            for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])))
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, blocks, x, return_hidden=False):
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            if i == len(self.layers) - 1 and return_hidden:
                return h[0] if isinstance(h, tuple) else h[:block.num_dst_nodes()]
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


def parse_args(argv=None):
    """Parse the command line (see --help)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="wordnet", help="karate, wordnet or sbm")
    p.add_argument("--data-opt", action="append", type=data_option, default=[],
                   metavar="KEY=VALUE", help="extra loader argument, e.g. num_nodes=5000")
    p.add_argument("--dim", type=int, default=64, help="width of the learnable input table")
    p.add_argument("--hidden", type=int, default=128, help="hidden width")
    p.add_argument("--fanouts", default="10,10", help="neighbours sampled per layer")
    p.add_argument("--batch-size", type=int, default=1024, help="output nodes per step")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training nodes")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no cap)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam",
                   help="distemb sparse optimizer of the input table")
    p.add_argument("--first-layer", choices=FIRST_LAYERS, default="sage",
                   help="sage: DGL's SAGEConv over every input node's row; bag: each "
                   "destination's neighbour mean pooled from the table by emb.bag")
    p.add_argument("--backend", choices=BACKENDS, default="distemb",
                   help="input table: a DistEmbedding, or torch.nn.Embedding(sparse=True) "
                   "with torch's optimizer of the same rule (one process only)")
    p.add_argument("--prefetch-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="read each next batch's input rows while the current batch trains "
                   "(distemb.pipeline.Prefetcher: a table on servers or other ranks; an "
                   "embedded table has nothing to read ahead)")
    p.add_argument("--emb-lr", type=float, default=0.01, help="sparse optimizer learning rate")
    p.add_argument("--lr", type=float, default=0.005, help="Adam learning rate of the SAGE layers")
    p.add_argument("--seed", type=int, default=0, help="seed of init, sampling and shuffling")
    p.add_argument("--threads", type=int, help="torch's and DGL's threads (default: their "
                   "choice); sampling repeats exactly only with 1")
    p.add_argument("--out", default="out/graphsage", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        args.fanouts = [int(f) for f in args.fanouts.split(",")]
    except ValueError:
        p.error(f"--fanouts: expected comma-separated integers, got {args.fanouts!r}")
    for name in ("dim", "hidden", "batch_size", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if not args.fanouts or min(args.fanouts) < 1:
        p.error(f"--fanouts: each must be >= 1, got {args.fanouts}")
    if args.backend == "torch" and args.first_layer == "bag":
        p.error("--first-layer bag: pooled lookups are a DistEmbedding's (emb.bag); "
                "--backend torch takes --first-layer sage")
    if args.backend == "torch" and args.optimizer not in TORCH_OPTIMIZERS:
        p.error(f"--optimizer {args.optimizer}: torch has no such optimizer for "
                f"--backend torch; expected one of {sorted(TORCH_OPTIMIZERS)}")
    return args


def _loader(graph, nodes, fanouts, batch_size, shuffle, seed):
    # DGL suggests CPU affinity for worker processes; we use none (num_workers=0).
    warnings.filterwarnings("ignore", message="Dataloader CPU affinity opt")
    sampler = dgl.dataloading.NeighborSampler(fanouts)
    # The same seed, the same batches: DGL shuffles with numpy's global generator and
    # samples neighbours with its own; the dropout masks that follow come from torch's.
    np.random.seed(seed)
    dgl.seed(seed)
    torch.manual_seed(seed)
    return dgl.dataloading.DataLoader(graph, nodes, sampler, batch_size=batch_size,
                                      shuffle=shuffle, drop_last=False)


@torch.no_grad()
def evaluate(model, emb, graph, labels, nodes, args):
    """Accuracy on ``nodes`` and their last hidden layer (sampled neighbourhoods)."""
    model.eval()
    correct, hidden = 0, []
    for input_nodes, output_nodes, blocks in _loader(graph, nodes, args.fanouts, 4096,
                                                     False, args.seed):
        x = first_inputs(emb, emb, input_nodes, blocks[0], args.first_layer == "bag")
        correct += int((model(blocks, x).argmax(1) == labels[output_nodes]).sum())
        hidden.append(model(blocks, x, return_hidden=True))
    model.train()
    return correct / max(1, len(nodes)), torch.cat(hidden)


def first_inputs(emb, rows_of, input_nodes, block, pooled):
    """The first layer's input: every input node's row (``rows_of(input_nodes)``), or,
    ``pooled``, the destination nodes' rows and each one's mean over its sampled
    neighbours in ``block``, pooled from table ``emb`` (one ``emb.bag`` of the block's
    in-edges: no row per edge is made)."""
    if not pooled:
        return rows_of(input_nodes)
    indptr, neighbours, _ = block.adj_tensors("csc")  # in-edges grouped by destination
    return (emb(input_nodes[:block.num_dst_nodes()]),
            emb.bag(input_nodes[neighbours], indptr, mode="mean", include_last_offset=True))


def _shard(nodes, ctx):
    """This trainer's share of the training nodes (all of them when alone).

    Shares are equal in size so every trainer takes the same number of steps: DDP's
    gradient all-reduce needs every trainer at every step.
    """
    if ctx.num_trainers == 1:
        return nodes
    return nodes[ctx.rank::ctx.num_trainers][:len(nodes) // ctx.num_trainers]


def input_table(backend, num_nodes, dim, optimizer, lr, seed, name):
    """The learnable input features on ``backend``: (table, lookup, sparse optimizer).

    Both backends start from the same rows for the same seed (``randn * 0.1`` from one
    generator) and update them by the same rule; ``table(ids)`` reads rows, ``lookup``
    takes a DataLoader's ``input_nodes``.
    """
    gen = torch.Generator().manual_seed(seed)

    def init(shape, dtype):
        return (torch.randn(shape, generator=gen) * 0.1).to(dtype)

    if backend == "torch":
        table = torch.nn.Embedding(num_nodes, dim, sparse=True,
                                   _weight=init((num_nodes, dim), torch.float32))
        return table, table, TORCH_OPTIMIZERS[optimizer]([table.weight], lr=lr)
    if backend != "distemb":
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    table = distemb.DistEmbedding(num_nodes, dim, name=name, init_func=init)
    return table, lambda ids: lookup(table, ids), OPTIMIZERS[optimizer]([table], lr=lr)


class Learner:
    """The input table, the SAGE layers and their two optimizers, seeded from ``args``.

    Two learners built from the same ``args`` (whatever their ``backend``) start equal.
    """

    def __init__(self, ds, args, ctx):
        if args.backend == "torch" and ctx.num_trainers > 1:
            raise SystemExit("--backend torch: a torch.nn.Embedding lives in one process; "
                             "a distemb-launch job trains distemb tables")
        torch.manual_seed(args.seed)  # the SAGE layers' initial weights
        self.emb, self.rows_of, self.sparse_opt = input_table(
            args.backend, ds.graph.num_nodes(), args.dim, args.optimizer, args.emb_lr,
            args.seed, f"sage-{ds.name}")
        self.pooled = args.first_layer == "bag"
        self.model = SAGE(args.dim, args.hidden, ds.num_classes, len(args.fanouts),
                          pooled=self.pooled)
        self.dense = self.model
        if ctx.num_trainers > 1:
            if not torch.distributed.is_initialized():  # collective mode made it already
                torch.distributed.init_process_group("gloo")
            self.dense = torch.nn.parallel.DistributedDataParallel(self.model)
        self.dense_opt = torch.optim.Adam(self.dense.parameters(), lr=args.lr)

    def step(self, input_nodes, blocks, labels):
        """One training step on a DataLoader batch.

        Returns:
            (loss, seconds of the table's lookup, seconds of the table's optimizer step).
        """
        t1 = time.perf_counter()
        x = first_inputs(self.emb, self.rows_of, input_nodes, blocks[0], self.pooled)
        t2 = time.perf_counter()
        loss = F.cross_entropy(self.dense(blocks, x), labels)
        loss.backward()
        t3 = time.perf_counter()
        self.sparse_opt.step()
        t4 = time.perf_counter()
        self.dense_opt.step()
        self.sparse_opt.zero_grad()  # torch's optimizers accumulate into .grad otherwise
        self.dense_opt.zero_grad()
        return loss.item(), t2 - t1, t4 - t3


def train(ds, args, ctx):
    """Train the table and the SAGE layers; return metrics, losses and the model.

    The result also has lists of per-step seconds: ``sample_seconds`` (waiting for DGL's
    sampler), ``step_seconds`` (lookup, forward, backward and both optimizers' steps) and
    two parts of it, ``lookup_seconds`` and ``sparse_step_seconds`` (the table's optimizer).
    """
    learner = Learner(ds, args, ctx)
    nodes = _shard(ds.train_idx, ctx)
    steps_per_epoch = -(-len(nodes) // args.batch_size)
    total = steps_per_epoch * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    losses, seen, step, times = [], 0, 0, []
    bar = tqdm(total=total, disable=args.quiet, unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    # Each next batch's input rows are read while the current one trains (the torch
    # backend's table has nothing to prefetch).
    ahead = args.prefetch_rows and args.backend == "distemb"
    for epoch in range(args.epochs):
        batches = iter(Prefetcher(_loader(ds.graph, nodes, args.fanouts, args.batch_size,
                                          True, args.seed + epoch),
                                  lambda b: [(learner.emb, b[0])], ahead))
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            input_nodes, output_nodes, blocks = batch
            t1 = time.perf_counter()
            loss, lookup_s, sparse_s = learner.step(input_nodes, blocks,
                                                    ds.labels[output_nodes])
            losses.append(loss)
            times.append((t1 - t0, time.perf_counter() - t1, lookup_s, sparse_s))
            seen += len(output_nodes)
            step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{np.mean(losses[-20:]):.3f}",
                            nodes_s=f"{seen / (time.perf_counter() - start):,.0f}")
            if step >= total:
                break
        if step >= total:
            break
    bar.close()
    seconds = time.perf_counter() - start
    sample_s, step_s, lookup_s, sparse_s = (list(t) for t in zip(*times)) if times else [[]] * 4
    return dict(emb=learner.emb, model=learner.model, losses=losses, steps=step,
                seconds=seconds, seen=seen, sample_seconds=sample_s, step_seconds=step_s,
                lookup_seconds=lookup_s, sparse_step_seconds=sparse_s)


def main(argv=None):
    """Run GraphSAGE from the command line; return the metrics written to metrics.json."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        dgl.utils.set_num_threads(args.threads)  # DGL's sampler has its own OpenMP threads
    ctx = distemb.initialize(mode=job_mode() or None)
    try:
        ds = load_dataset(args.dataset, **dict(args.data_opt))
        if ds.num_classes < 2:
            raise SystemExit(f"--dataset {args.dataset}: needs node labels for classification")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = train(ds, args, ctx)
        emb, model = result["emb"], result["model"]
        val_acc, _ = evaluate(model, emb, ds.graph, ds.labels, ds.val_idx, args)
        test_acc, hidden = evaluate(model, emb, ds.graph, ds.labels, ds.test_idx, args)
        metrics = dict(dataset=ds.name, nodes=ds.graph.num_nodes(), classes=ds.num_classes,
                       trainers=ctx.num_trainers, rank=ctx.rank, backend=args.backend,
                       optimizer=args.optimizer, first_layer=args.first_layer,
                       steps=result["steps"], train_seconds=round(result["seconds"], 2),
                       nodes_per_second=round(result["seen"] / result["seconds"]),
                       final_loss=round(float(np.mean(result["losses"][-20:])), 4),
                       val_accuracy=round(val_acc, 4), test_accuracy=round(test_acc, 4))
        with torch.no_grad():  # every trainer reads: in collective mode reads take all
            table = torch.cat([emb(torch.arange(s, min(s + 65536, ds.graph.num_nodes())))
                               for s in range(0, ds.graph.num_nodes(), 65536)])
        if ctx.rank == 0:
            np.save(out / "embeddings.npy", table.numpy())
            np.save(out / "node_ids.npy", ds.node_ids)
            (out / "metrics.json").write_text(json.dumps(dict(metrics, args=vars(args)),
                                                         indent=2, default=str) + "\n")
            save_training_plot(out / "report.png", result["losses"], hidden,
                               ds.labels[ds.test_idx],
                               title=f"GraphSAGE on {ds.name}: test nodes' last hidden layer")
        print(format_table([(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else v)
                            for k, v in metrics.items()]))
        if ctx.rank == 0:
            print(f"wrote {out}/embeddings.npy, node_ids.npy, metrics.json, report.png")
        return metrics
    finally:
        distemb.shutdown()


if __name__ == "__main__":
    main()
