"""Tests for graph_examples.evaluate and graph_examples.plots."""
import numpy as np
import pytest
import torch

from graph_examples.datasets import load_dataset
from graph_examples.evaluate import (link_prediction_auc, node_classification,
                                     split_edges)
from graph_examples.plots import (f1_bar_order, largest_classes, project_2d,
                                  save_training_plot, shown_classes)


@pytest.fixture(scope="module")
def sbm():
    return load_dataset("sbm", num_nodes=2000, num_classes=5, avg_degree=8, homophily=0.9,
                        seed=0)


def test_one_hot_labels_classify_perfectly(sbm):
    one_hot = torch.nn.functional.one_hot(sbm.labels, sbm.num_classes).float()
    scores = node_classification(one_hot, sbm)
    assert scores.micro_f1 == pytest.approx(1.0)
    assert scores.macro_f1 == pytest.approx(1.0)


def test_random_embeddings_score_near_chance(sbm):
    noise = torch.randn(2000, 16, generator=torch.Generator().manual_seed(0))
    scores = node_classification(noise, sbm, split="val")
    assert 0.1 < scores.micro_f1 < 0.3  # chance is 0.2 for 5 balanced classes
    assert scores.macro_f1 < 0.3


def test_classification_rejects_bad_input(sbm):
    with pytest.raises(ValueError, match=r"embeddings: expected shape \(2000, D\), got \(5, 2\)"):
        node_classification(np.zeros((5, 2)), sbm)
    with pytest.raises(ValueError, match="split: expected 'val' or 'test', got 'train'"):
        node_classification(np.zeros((2000, 2)), sbm, split="train")


def test_split_edges_hides_edges_and_samples_non_edges(sbm):
    split = split_edges(sbm.graph, fraction=0.2, seed=1)
    full = set(zip(*(t.tolist() for t in sbm.graph.edges())))
    kept = set(zip(*(t.tolist() for t in split.train_graph.edges())))
    pos = [tuple(e) for e in split.pos_edges.tolist()]
    assert len(pos) == round(0.2 * len(full) / 2) == len(split.neg_edges)
    assert all(e in full and e not in kept and e[::-1] not in kept for e in pos)
    assert len(kept) == len(full) - 2 * len(pos)
    assert kept <= full
    for u, v in split.neg_edges.tolist():
        assert u != v and (u, v) not in full
    assert split.train_graph.num_nodes() == sbm.graph.num_nodes()
    again = split_edges(sbm.graph, fraction=0.2, seed=1)
    assert torch.equal(split.pos_edges, again.pos_edges)
    assert torch.equal(split.neg_edges, again.neg_edges)


def test_split_edges_rejects_bad_fraction(sbm):
    with pytest.raises(ValueError, match=r"fraction: must be in \(0, 1\), got 1.0"):
        split_edges(sbm.graph, fraction=1.0)


@pytest.mark.parametrize("score", ["dot", "cosine"])
def test_link_prediction_auc(sbm, score):
    split = split_edges(sbm.graph, fraction=0.1, seed=0)
    # Class one-hots score same-class pairs higher: hidden edges are 90% same-class,
    # random pairs 20%, so AUC is well above chance but not perfect.
    one_hot = torch.nn.functional.one_hot(sbm.labels, sbm.num_classes).float()
    auc = link_prediction_auc(one_hot, split.pos_edges, split.neg_edges, score)
    assert 0.8 < auc < 0.9
    noise = torch.randn(2000, 16, generator=torch.Generator().manual_seed(0))
    assert abs(link_prediction_auc(noise, split.pos_edges, split.neg_edges, score) - 0.5) < 0.05


def test_link_prediction_rejects_unknown_score():
    with pytest.raises(ValueError, match="score: expected 'dot' or 'cosine', got 'l2'"):
        link_prediction_auc(np.eye(3), np.array([[0, 1]]), np.array([[1, 2]]), "l2")


def test_pca_projection_keeps_the_main_axis():
    x = np.zeros((100, 5))
    x[:, 3] = np.linspace(-10, 10, 100)
    x[:, 1] = np.random.default_rng(0).normal(scale=0.1, size=100)
    xy = project_2d(x)
    assert xy.shape == (100, 2)
    # The spread-out column becomes the first axis, the small noise the second.
    assert abs(np.corrcoef(xy[:, 0], x[:, 3])[0, 1]) > 0.9999
    assert abs(np.corrcoef(xy[:, 1], x[:, 1])[0, 1]) > 0.99


def test_tsne_projection_separates_clusters():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (30, 8)), rng.normal(20, 1, (30, 8))])
    xy = project_2d(x, "tsne", seed=0)
    assert xy.shape == (60, 2)
    gap = np.linalg.norm(xy[:30].mean(0) - xy[30:].mean(0))
    assert gap > 3 * max(xy[:30].std(0).max(), xy[30:].std(0).max())


def test_projection_rejects_unknown_method():
    with pytest.raises(ValueError, match="method: expected 'pca' or 'tsne', got 'umap'"):
        project_2d(np.zeros((5, 3)), "umap")


def test_training_plot_writes_a_png(tmp_path, sbm):
    emb = torch.nn.functional.one_hot(sbm.labels, 5).float() + 0.1 * torch.randn(2000, 5)
    path = save_training_plot(tmp_path / "sub" / "report.png", [3.0, 2.0, 1.5], emb,
                              sbm.labels, max_points=500, title="sbm")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="labels: expected 2000 entries"):
        save_training_plot(tmp_path / "x.png", [1.0], emb, sbm.labels[:10])


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_per_class_f1_agrees_with_the_averages(sbm):
    emb = torch.nn.functional.one_hot(sbm.labels, 5).float() + 0.8 * torch.randn(2000, 5)
    scores = node_classification(emb, sbm, "test")
    assert sorted(scores.per_class_f1) == [0, 1, 2, 3, 4]
    assert np.mean(list(scores.per_class_f1.values())) == pytest.approx(scores.macro_f1)
    y = sbm.labels[sbm.test_idx].numpy()
    assert scores.support == {c: int((y == c).sum()) for c in range(5)}


def test_largest_classes_and_bar_order():
    labels = np.array([3] * 5 + [1] * 9 + [7] * 5 + [0] * 2 + [-1] * 20)
    assert largest_classes(labels, 3).tolist() == [1, 3, 7]   # by count, ties by id
    assert largest_classes(labels, 10).tolist() == [1, 3, 7, 0]
    assert f1_bar_order({0: 0.5, 1: 0.9, 2: 0.1}, {0: 4, 1: 9, 2: 4}) == [1, 0, 2]


def test_the_projection_shows_the_best_scored_of_the_largest_classes():
    # sizes 10, 9, ..., 1 for classes 0..9; -1 unlabelled
    labels = np.concatenate([np.full(10 - c, c) for c in range(10)] + [np.full(5, -1)])
    f1 = {c: 0.1 for c in range(10)}
    f1.update({9: 1.0, 4: 0.9, 1: 0.8})  # class 9 is the smallest: not among the 6 largest
    assert shown_classes(labels, 2, f1).tolist() == [1, 4]  # largest first
    assert shown_classes(labels, 2).tolist() == [0, 1]  # without F1: the largest


def test_report_shows_largest_classes_and_f1_bars(tmp_path):
    """45 classes (WordNet-like): the scatter keeps a few classes, a third panel has
    the per-class F1 bars; the loss curve stays."""
    rng = np.random.default_rng(0)
    labels = torch.from_numpy(rng.zipf(1.5, 1500) % 45)
    emb = torch.randn(1500, 8) + torch.nn.functional.one_hot(labels, 45).float()[:, :8] * 3
    f1 = {c: float(rng.random()) for c in range(45)}
    support = {c: int((labels == c).sum()) for c in range(45)}
    plain = save_training_plot(tmp_path / "plain.png", [3.0, 2.0], emb, labels,
                               method="pca")
    full = save_training_plot(tmp_path / "full.png", [3.0, 2.0], emb, labels,
                              method="pca", per_class_f1=f1, support=support,
                              class_names=[f"c{i}" for i in range(45)])
    assert _png_size(full)[0] > 1.4 * _png_size(plain)[0]  # three panels, not two
