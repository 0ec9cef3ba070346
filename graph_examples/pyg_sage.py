"""PyG GraphSAGE whose input is a learnable distemb table: featureless nodes.

PyG's NeighborLoader samples each mini-batch's subgraph (``batch.n_id``: its nodes, the
seeds first); the nodes' input rows are looked up in a :class:`distemb.DistEmbedding`,
which ``distemb.SparseAdam`` updates (only the rows a batch looked up), while PyG's
``GraphSAGE`` layers use ``torch.optim.Adam``. Node classification; reports accuracy on
the dataset's fixed validation and test split. The same script runs embedded (the
default) or as a trainer under distemb-launch (the table on the servers; each trainer
takes its share of the training nodes).

Example:
    python graph_examples/pyg_sage.py --dataset wordnet --epochs 3 --out out/pyg-sage-wordnet
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("DGLBACKEND", "pytorch")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch_geometric.data import Data  # noqa: E402
from torch_geometric.loader import NeighborLoader  # noqa: E402
from torch_geometric.nn import GraphSAGE  # noqa: E402

import distemb  # noqa: E402
from graph_examples.datasets import load_dataset  # noqa: E402
from graph_examples.cli import data_option  # noqa: E402


def parse_args(argv=None):
    """Parse the command line (see --help)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="wordnet", help="karate, wordnet or sbm")
    p.add_argument("--data-opt", action="append", type=data_option, default=[],
                   metavar="KEY=VALUE", help="extra loader argument, e.g. num_nodes=5000")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dim", type=int, default=64, help="width of the learnable input rows")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--fanout", default="10,5", help="neighbours sampled per layer")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.01, help="Adam on the SAGE layers")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="SparseAdam on the table")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for metrics.json")
    return p.parse_args(argv)


def accuracy(model, table, loader):
    """Accuracy on the seed nodes of every batch of ``loader`` (no tracing, no dropout)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            out = model(table(batch.n_id), batch.edge_index)[:batch.batch_size]
            correct += int((out.argmax(-1) == batch.y[:batch.batch_size]).sum())
            total += batch.batch_size
    model.train()
    return correct / max(total, 1)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ctx = distemb.initialize()
    ds = load_dataset(args.dataset, **dict(args.data_opt))
    src, dst = ds.graph.edges()
    data = Data(edge_index=torch.stack([src, dst]), y=ds.labels, num_nodes=ds.graph.num_nodes())
    fanout = [int(f) for f in args.fanout.split(",")]
    train = ds.train_idx[ctx.rank::ctx.num_trainers]  # this trainer's share
    loader = NeighborLoader(data, num_neighbors=fanout, batch_size=args.batch_size,
                            input_nodes=train, shuffle=True)

    table = distemb.DistEmbedding(data.num_nodes, args.dim, name="pyg-sage-input",
                                  init_func=lambda s, d: torch.randn(s, dtype=d) * 0.1)
    model = GraphSAGE(args.dim, args.hidden, num_layers=len(fanout),
                      out_channels=ds.num_classes, dropout=args.dropout)
    dense = torch.optim.Adam(model.parameters(), lr=args.lr)
    sparse = distemb.SparseAdam([table], lr=args.sparse_lr)

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        total, steps = 0.0, 0
        for batch in loader:
            dense.zero_grad()
            sparse.zero_grad()
            out = model(table(batch.n_id), batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            dense.step()
            sparse.step()
            total, steps = total + loss.item(), steps + 1
        print(f"epoch {epoch} loss {total / max(steps, 1):.4f}", flush=True)
    seconds = time.perf_counter() - start

    def evaluation(nodes):
        return NeighborLoader(data, num_neighbors=fanout, batch_size=4096, input_nodes=nodes)
    metrics = {"dataset": args.dataset, "val_acc": accuracy(model, table, evaluation(ds.val_idx)),
               "test_acc": accuracy(model, table, evaluation(ds.test_idx)),
               "train_seconds": seconds, "args": vars(args)}
    print(f"val accuracy {metrics['val_acc']:.4f} test accuracy {metrics['test_acc']:.4f} "
          f"({seconds:.0f} s of training)")
    if args.out and ctx.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    distemb.shutdown()


if __name__ == "__main__":
    main()
