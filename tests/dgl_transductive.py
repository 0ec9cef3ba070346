"""DGL 1.1.3's examples/pytorch/graphsage/dist/train_dist_transductive.py, ``--standalone
--dgl_sparse``, on a small offline graph; ``python tests/dgl_transductive.py dgl|distemb OUT``.

``dgl`` runs DGL's own dgl.distributed (standalone mode: one partition, DistGraph, its
DistEmbedding and SparseAdam); ``distemb`` runs the same file with the import swapped to
``import distemb.dgl as dist``, which gives DGL's own ``partition_graph``, ``DistGraph``
and ``node_split`` beside distemb's tables. The training loop is the example's, call for
call: ``DistGraph``, ``node_split`` of its ``train_mask``, a ``DistNodeDataLoader``,
forward, ``emb_optimizer.zero_grad()``, ``optimizer.zero_grad()``, ``loss.backward()``,
``emb_optimizer.step()``, ``optimizer.step()``. The graph is a seeded planted partition
(graph_examples/datasets.py); evaluation is the example's layer-wise full-graph
inference. Writes a JSON with the test accuracy and how many looked-up rows changed.
"""
import json
import os
import sys

os.environ.setdefault("DGLBACKEND", "pytorch")

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402

import dgl  # noqa: E402
import dgl.nn.pytorch as dglnn  # noqa: E402

from graph_examples.datasets import load_sbm  # noqa: E402

WHICH, OUT = sys.argv[1], sys.argv[2]
if WHICH == "dgl":
    import dgl.distributed as dist  # noqa: E402
else:
    import distemb.dgl as dist  # noqa: E402

NUM_HIDDEN, EPOCHS, BATCH, FAN_OUT, LR, SPARSE_LR = 16, 8, 100, [10, 25], 0.01, 0.05


def initializer(shape, dtype):
    arr = th.zeros(shape, dtype=dtype)
    arr.uniform_(-1, 1)
    return arr


class DistEmb(nn.Module):
    def __init__(self, num_nodes, emb_size):
        super().__init__()
        self.emb_size = emb_size
        self.sparse_emb = dist.DistEmbedding(num_nodes, emb_size, name="sage",
                                             init_func=initializer)

    def forward(self, idx):
        return self.sparse_emb(idx.cpu(), device="cpu")


class DistSAGE(nn.Module):
    def __init__(self, in_feats, n_hidden, n_classes, n_layers, activation, dropout):
        super().__init__()
        self.layers = nn.ModuleList([dglnn.SAGEConv(in_feats, n_hidden, "mean")])
        for _ in range(1, n_layers - 1):
            self.layers.append(dglnn.SAGEConv(n_hidden, n_hidden, "mean"))
        self.layers.append(dglnn.SAGEConv(n_hidden, n_classes, "mean"))
        self.dropout, self.activation = nn.Dropout(dropout), activation

    def forward(self, blocks, x):
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self.dropout(self.activation(h))
        return h

    def inference(self, g, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(g, h)
            if i != len(self.layers) - 1:
                h = self.activation(h)
        return h


def main():
    th.manual_seed(0)
    ds = load_sbm(num_nodes=1500, num_classes=3, avg_degree=8.0, seed=3)
    g, labels = ds.graph, ds.labels
    g.ndata["labels"] = labels  # as the example's graph (DGL registers policies from ndata)
    g.ndata["train_mask"] = th.zeros(g.num_nodes(), dtype=th.bool)
    g.ndata["train_mask"][ds.train_idx] = True
    part_dir = os.path.join(OUT, WHICH, "parts")
    os.makedirs(part_dir, exist_ok=True)
    dist.partition_graph(g, "sbm", 1, part_dir)
    ip = os.path.join(OUT, WHICH, "ip.txt")
    with open(ip, "w") as f:
        f.write("127.0.0.1\n")
    # From here on, the example's own calls (through ``dist``, DGL's or distemb's):
    dist.initialize(ip)
    # the DistGraph registers the node policy DistEmbedding finds by its size
    dist_graph = dist.DistGraph("sbm", part_config=os.path.join(part_dir, "sbm.json"))
    pb = dist_graph.get_partition_book()
    train_nid = dist.node_split(dist_graph.ndata["train_mask"], pb, force_even=True)
    assert sorted(train_nid.tolist()) == ds.train_idx.tolist()  # one partition: all of them
    th.manual_seed(0)
    sampler = dgl.dataloading.NeighborSampler(FAN_OUT)
    dataloader = dgl.dataloading.DistNodeDataLoader(dist_graph, train_nid, sampler,
                                                    batch_size=BATCH, shuffle=True,
                                                    drop_last=False)
    emb_layer = DistEmb(dist_graph.num_nodes(), NUM_HIDDEN)
    model = DistSAGE(NUM_HIDDEN, NUM_HIDDEN, ds.num_classes, 2, F.relu, 0.5)
    loss_fcn = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=LR)
    emb_optimizer = dist.optim.SparseAdam([emb_layer.sparse_emb], lr=SPARSE_LR)
    all_nodes = th.arange(g.num_nodes())
    with th.no_grad():
        start = emb_layer(all_nodes).clone()
    looked_up = th.zeros(g.num_nodes(), dtype=th.bool)
    for epoch in range(EPOCHS):
        for step, (input_nodes, seeds, blocks) in enumerate(dataloader):
            looked_up[input_nodes] = True
            batch_labels = labels[seeds].long()
            batch_inputs = emb_layer(input_nodes)
            batch_pred = model(blocks, batch_inputs)
            loss = loss_fcn(batch_pred, batch_labels)
            emb_optimizer.zero_grad()
            optimizer.zero_grad()
            loss.backward()
            emb_optimizer.step()
            optimizer.step()
    model.eval()
    with th.no_grad():
        x = emb_layer(all_nodes)
        pred = model.inference(g, x).argmax(1)
    acc = lambda idx: float((pred[idx] == labels[idx]).float().mean())  # noqa: E731
    changed = (x != start).any(dim=1)
    result = {"test_acc": acc(ds.test_idx), "val_acc": acc(ds.val_idx),
              "looked_up": int(looked_up.sum()),
              "looked_up_trained": int((changed & looked_up).sum()),
              "trained_not_looked_up": int((changed & ~looked_up).sum())}
    with open(os.path.join(OUT, f"{WHICH}.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    dist.exit_client()


if __name__ == "__main__":
    main()
