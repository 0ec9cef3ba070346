"""Node2Vec as PyG writes it, its table a distemb table: Zachary's karate club.

The loop is PyG's example (examples/node2vec.py) with one change: the optimizer is
distemb's SparseAdam over the model's table (PyG's: torch.optim.SparseAdam over
model.parameters()). Under distemb-launch the same script trains a table on the servers.
"""
import networkx as nx
import torch

import distemb
from distemb.pyg import Node2Vec

karate = nx.karate_club_graph()
edges = torch.tensor(list(karate.edges())).t()
edge_index = torch.cat([edges, edges.flip(0)], dim=1)
club = torch.tensor([karate.nodes[i]["club"] == "Officer" for i in karate], dtype=torch.long)

torch.manual_seed(0)
model = Node2Vec(edge_index, embedding_dim=16, walk_length=10, context_size=5,
                 walks_per_node=10, num_negative_samples=1, p=1.0, q=1.0,
                 name="karate-node2vec")
loader = model.loader(batch_size=8, shuffle=True)
optimizer = distemb.SparseAdam([model.embedding], lr=0.05)

train, test = torch.arange(0, 34, 2), torch.arange(1, 34, 2)
for epoch in range(1, 31):
    total = 0.0
    for pos_rw, neg_rw in loader:
        optimizer.zero_grad()
        loss = model.loss(pos_rw, neg_rw)
        loss.backward()
        optimizer.step()
        total += loss.item()
    if epoch % 10 == 0:
        with torch.no_grad():
            z = model()
        acc = model.test(z[train], club[train], z[test], club[test], max_iter=200)
        print(f"epoch {epoch} loss {total / len(loader):.4f} club accuracy {acc:.2f}")
