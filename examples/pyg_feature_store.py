"""PyG's NeighborLoader reading node features from distemb tables (a DistFeatureStore).

The graph's structure is in PyG's own graph store; the node features and labels are
distemb tables, so they live wherever distemb's tables do (here: this process; under
distemb-launch: the servers). The loader asks the store for every feature of a
mini-batch with one multi_get_tensor call.
"""
import torch
import torch.nn.functional as F
from torch_geometric.distributed import LocalGraphStore
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GraphSAGE

from distemb.pyg import DistFeatureStore

torch.manual_seed(0)
num_nodes, num_classes = 1000, 4
y = torch.arange(num_nodes) % num_classes                 # node i is of class i % 4
x = F.one_hot(y, num_classes).float() + 0.5 * torch.randn(num_nodes, num_classes)
src = torch.randint(num_nodes, (8000,))
same = (src + num_classes * torch.randint(1, 250, (8000,))) % num_nodes  # same class
dst = torch.where(torch.rand(8000) < 0.8, same, torch.randint(num_nodes, (8000,)))
edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])

features = DistFeatureStore(prefix="example")        # one distemb table per attribute
features.put_tensor(x, group_name=None, attr_name="x", index=None)
features.put_tensor(y, group_name=None, attr_name="y", index=None)
graph = LocalGraphStore.from_data(torch.arange(edge_index.size(1)), edge_index, num_nodes)

loader = NeighborLoader((features, graph), num_neighbors=[10, 5], batch_size=128,
                        input_nodes=torch.arange(num_nodes), shuffle=True)
model = GraphSAGE(num_classes, 32, num_layers=2, out_channels=num_classes)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for epoch in range(1, 6):
    correct = total = 0
    for batch in loader:
        optimizer.zero_grad()
        out = model(batch.x, batch.edge_index)[:batch.batch_size]
        loss = F.cross_entropy(out, batch.y[:batch.batch_size])
        loss.backward()
        optimizer.step()
        correct += int((out.argmax(-1) == batch.y[:batch.batch_size]).sum())
        total += batch.batch_size
    print(f"epoch {epoch} loss {loss.item():.4f} train accuracy {correct / total:.3f}")
print("tables:", [features.table(a.group_name, a.attr_name).name
                  for a in features.get_all_tensor_attrs()])
