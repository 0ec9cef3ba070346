"""graph_examples/pyg_sage.py: PyG's GraphSAGE on featureless nodes (a learnable
distemb table as input) learns a planted-partition graph, embedded."""
import json
import os
import sys

import pytest

from mp_helper import ROOT, ProcessGroup, child_env

tg = pytest.importorskip("torch_geometric")
from torch_geometric.typing import WITH_PYG_LIB, WITH_TORCH_SPARSE  # noqa: E402

SCRIPT = os.path.join(ROOT, "graph_examples", "pyg_sage.py")


@pytest.mark.skipif(not (WITH_PYG_LIB or WITH_TORCH_SPARSE),
                    reason="no neighbour sampler: make installs torch-sparse")
@pytest.mark.timeout(400)
def test_featureless_graphsage_learns_a_planted_partition(tmp_path):
    argv = [sys.executable, SCRIPT, "--dataset", "sbm", "--data-opt", "num_nodes=3000",
            "--data-opt", "num_classes=4", "--data-opt", "avg_degree=10.0",
            "--epochs", "4", "--batch-size", "256", "--out", str(tmp_path)]
    with ProcessGroup() as group:
        group.spawn(argv, env=child_env(), cwd=str(tmp_path))
        (out,) = group.wait_all(timeout=380).values()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # the rows start random: only training (table and layers together) separates classes
    assert metrics["test_acc"] > 0.7 and metrics["val_acc"] > 0.7, (metrics, out[-2000:])
