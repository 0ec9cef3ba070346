"""Downstream scores of frozen node embeddings: node classification and link prediction.

Node classification fits a scikit-learn logistic regression on the dataset's training
nodes and reports Micro-/Macro-F1 on another split. Link prediction hides a fraction of
the edges before training (split_edges) and scores hidden edges against sampled
non-edges by ROC-AUC.
"""
import os
from typing import Dict, NamedTuple, Optional

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.preprocessing import StandardScaler

os.environ.setdefault("DGLBACKEND", "pytorch")  # before dgl: silences its config warning
import dgl  # noqa: E402

from graph_examples.datasets import GraphDataset  # noqa: E402


class ClassificationScores(NamedTuple):
    """F1 scores of a node classifier on one split.

    Attributes:
        micro_f1, macro_f1: the averages.
        per_class_f1: class -> F1 of that class on the split (classes present in the
            training or scored nodes).
        support: class -> number of scored nodes of that class.
    """

    micro_f1: float
    macro_f1: float
    per_class_f1: Optional[Dict[int, float]] = None
    support: Optional[Dict[int, int]] = None


class EdgeSplit(NamedTuple):
    """A graph with some edges hidden, for link prediction.

    Attributes:
        train_graph: the graph without the hidden edges (both directions removed).
        pos_edges: int64 (M, 2) hidden edges, one row per undirected edge.
        neg_edges: int64 (M, 2) node pairs that are not edges of the full graph.
    """

    train_graph: dgl.DGLGraph
    pos_edges: torch.Tensor
    neg_edges: torch.Tensor


def _as_numpy(embeddings) -> np.ndarray:
    if isinstance(embeddings, torch.Tensor):
        return embeddings.detach().cpu().numpy()
    return np.asarray(embeddings)


def node_classification(embeddings, dataset: GraphDataset, split: str = "test",
                        max_iter: int = 1000, seed: int = 0) -> ClassificationScores:
    """Fit logistic regression on the training nodes; score F1 on `split`.

    Features are standardized first, since raw skip-gram embeddings have scales that
    slow LBFGS down badly.

    Args:
        embeddings: (N, D) tensor or array, row i for node i.
        dataset: supplies labels and the fixed split.
        split: 'val' or 'test'.
        max_iter: LBFGS iterations.
        seed: classifier seed.

    Returns:
        ClassificationScores(micro_f1, macro_f1); macro averages over classes present
        in the training or scored nodes.

    Raises:
        ValueError: embeddings have the wrong row count, split is unknown, or the
            training split holds fewer than two classes.
    """
    x = _as_numpy(embeddings)
    n = dataset.graph.num_nodes()
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"embeddings: expected shape ({n}, D), got {x.shape}")
    if split not in ("val", "test"):
        raise ValueError(f"split: expected 'val' or 'test', got {split!r}")
    train = dataset.train_idx.numpy()
    scored = getattr(dataset, f"{split}_idx").numpy()
    y = dataset.labels.numpy()
    if len(np.unique(y[train])) < 2:
        raise ValueError(f"dataset {dataset.name!r}: training split needs >= 2 classes")
    scaler = StandardScaler().fit(x[train])
    clf = LogisticRegression(max_iter=max_iter, random_state=seed)
    clf.fit(scaler.transform(x[train]), y[train])
    pred = clf.predict(scaler.transform(x[scored]))
    classes = np.union1d(y[train], y[scored])
    per_class = f1_score(y[scored], pred, labels=classes, average=None, zero_division=0)
    return ClassificationScores(
        float(f1_score(y[scored], pred, average="micro")),
        float(f1_score(y[scored], pred, average="macro")),
        {int(c): float(f) for c, f in zip(classes, per_class)},
        {int(c): int((y[scored] == c).sum()) for c in classes})


def split_edges(graph: dgl.DGLGraph, fraction: float = 0.1, seed: int = 0) -> EdgeSplit:
    """Hide a seeded fraction of a bidirected graph's edges and sample as many non-edges.

    Nodes keep their ids; a node may lose all its edges. Negatives are uniform pairs
    (u != v) that are not edges of the full graph, so no hidden edge is a negative.

    Args:
        graph: simple bidirected graph (as the dataset loaders return).
        fraction: share of undirected edges to hide, in (0, 1).
        seed: seed for the choice of edges and of negatives.

    Returns:
        EdgeSplit.

    Raises:
        ValueError: fraction out of range, or the graph too dense to find negatives.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction: must be in (0, 1), got {fraction}")
    n = graph.num_nodes()
    src, dst = (t.numpy() for t in graph.edges())
    upper = src < dst  # one row per undirected edge
    u, v = src[upper], dst[upper]
    rng = np.random.default_rng(seed)
    hidden = rng.permutation(len(u))[:max(1, int(round(fraction * len(u))))]
    pos = np.stack([u[hidden], v[hidden]], axis=1)
    hidden_keys = np.concatenate([pos[:, 0] * n + pos[:, 1], pos[:, 1] * n + pos[:, 0]])
    keys = src * n + dst
    keep = ~np.isin(keys, hidden_keys)
    train_graph = dgl.graph((torch.from_numpy(src[keep]), torch.from_numpy(dst[keep])),
                            num_nodes=n)
    neg = _non_edges(np.sort(keys), n, len(pos), rng)
    return EdgeSplit(train_graph, torch.from_numpy(pos), torch.from_numpy(neg))


def _non_edges(sorted_keys, n, count, rng, max_rounds=20):
    # Rejection sampling in whole rounds: a sparse graph accepts nearly every draw.
    found = np.empty((0, 2), dtype=np.int64)
    for _ in range(max_rounds):
        pairs = rng.integers(0, n, size=(2 * (count - len(found)) + 16, 2))
        keys = pairs[:, 0] * n + pairs[:, 1]
        ok = (pairs[:, 0] != pairs[:, 1]) & ~np.isin(keys, sorted_keys, assume_unique=False)
        found = np.concatenate([found, pairs[ok]])[:count]
        if len(found) == count:
            return found
    raise ValueError(f"graph: too dense to sample {count} non-edges among {n} nodes")


def link_prediction_auc(embeddings, pos_edges: torch.Tensor, neg_edges: torch.Tensor,
                        score: str = "dot") -> float:
    """Return the ROC-AUC of scoring hidden edges above non-edges.

    Args:
        embeddings: (N, D) tensor or array.
        pos_edges: (M, 2) node pairs labelled 1.
        neg_edges: (K, 2) node pairs labelled 0.
        score: 'dot' (inner product) or 'cosine'.

    Returns:
        ROC-AUC in [0, 1]; 0.5 is chance.

    Raises:
        ValueError: score is unknown.
    """
    x = _as_numpy(embeddings).astype(np.float64)
    if score == "cosine":
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    elif score != "dot":
        raise ValueError(f"score: expected 'dot' or 'cosine', got {score!r}")
    pairs = np.concatenate([np.asarray(pos_edges), np.asarray(neg_edges)])
    truth = np.concatenate([np.ones(len(pos_edges)), np.zeros(len(neg_edges))])
    return float(roc_auc_score(truth, np.einsum("ij,ij->i", x[pairs[:, 0]], x[pairs[:, 1]])))
