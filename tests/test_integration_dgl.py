"""DGL integration: real DGL graphs, partitions and DataLoaders feeding DistEmbedding."""
import sys

import pytest
import torch

pytest.importorskip("dgl", reason="DGL is an optional extra: pip install .[dgl]")

from distemb.context import DistContext  # noqa: E402
from distemb.errors import DistEmbError  # noqa: E402
from distemb.integrations.dgl import dgl, lookup, node_embeddings, partition  # noqa: E402
from distemb.optim import SparseAdam  # noqa: E402


def test_core_does_not_import_dgl():
    import subprocess

    code = ("import sys, distemb, distemb.embedding, distemb.optim; "
            "assert 'dgl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_dataloader_minibatches_train_through_dist_embedding(tmp_path):
    """A NeighborSampler DataLoader's input_nodes feed the table; only they are updated."""
    ctx = DistContext.embedded(num_threads=1)
    g = dgl.rand_graph(200, 1000)
    policies = partition(g, "g", 2, str(tmp_path))
    emb = node_embeddings(g, 8, prefix="feat", policies=policies, context=ctx,
                          init_func=lambda s, d: torch.randn(s, dtype=d))["_N"]
    assert emb.part_policy.num_partitions == 2
    sage = dgl.nn.SAGEConv(8, 3, "mean")
    opt = SparseAdam([emb], lr=0.05)
    dense_opt = torch.optim.Adam(sage.parameters(), lr=0.01)
    sampler = dgl.dataloading.NeighborSampler([4])
    loader = dgl.dataloading.DataLoader(g, torch.arange(50), sampler, batch_size=25)
    before = emb.weight[torch.arange(200)]
    touched = torch.zeros(200, dtype=torch.bool)
    for input_nodes, output_nodes, blocks in loader:
        touched[input_nodes] = True
        h = sage(blocks[0], lookup(emb, input_nodes))
        loss = torch.nn.functional.cross_entropy(h, output_nodes % 3)
        loss.backward()
        opt.step()
        dense_opt.step()
        dense_opt.zero_grad()
    changed = (emb.weight[torch.arange(200)] != before).any(dim=1)
    assert changed.any() and not changed[~touched].any()


def test_heterograph_lookup_and_errors():
    ctx = DistContext.embedded(num_threads=1)
    g = dgl.heterograph({("u", "r", "i"): ([0, 1, 2], [1, 2, 0])}, {"u": 3, "i": 4})
    embs = node_embeddings(g, 5, prefix="h", context=ctx)
    out = lookup(embs, {"u": torch.tensor([0, 2]), "i": torch.tensor([], dtype=torch.int64)})
    assert set(out) == {"u"} and out["u"].shape == (2, 5)
    with pytest.raises(DistEmbError, match="no table for node type"):
        lookup(embs, {"x": torch.tensor([0])})
    with pytest.raises(DistEmbError, match="one tensor but there are 2 tables"):
        lookup(embs, torch.tensor([0]))
    with pytest.raises(DistEmbError, match="policies: no policy 'node~i' \\(have \\[\\]\\)"):
        node_embeddings(g, 5, prefix="h2", policies={}, context=ctx)
