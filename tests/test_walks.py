"""Tests for graph_examples.walks: walks, skip-gram pairs, negatives, batches."""
import numpy as np
import pytest
import torch

from graph_examples.datasets import load_dataset, simple_bidirected_graph
from graph_examples.walks import (NegativeSampler, SkipGramBatches, random_walks,
                                  skipgram_pairs)


def brute_force_pairs(walks, window):
    # The definition, one pair at a time, to check the vectorized version against.
    pairs = []
    for walk in walks.tolist():
        for i, c in enumerate(walk):
            for j in range(max(0, i - window), min(len(walk), i + window + 1)):
                if j != i and c >= 0 and walk[j] >= 0:
                    pairs.append((c, walk[j]))
    return sorted(pairs)


def edge_set(graph):
    return set(zip(*(t.tolist() for t in graph.edges())))


@pytest.fixture(scope="module")
def karate():
    return load_dataset("karate")


@pytest.mark.parametrize("p, q", [(1.0, 1.0), (0.5, 2.0)])
def test_walks_follow_edges(karate, p, q):
    walks = random_walks(karate.graph, torch.arange(34), walk_length=12, p=p, q=q)
    assert walks.shape == (34, 12) and walks.dtype == torch.int64
    assert torch.equal(walks[:, 0], torch.arange(34))
    edges = edge_set(karate.graph)
    steps = zip(walks[:, :-1].flatten().tolist(), walks[:, 1:].flatten().tolist())
    assert all(step in edges for step in steps)


def test_walks_stop_with_padding_at_dead_ends():
    path = simple_bidirected_graph(np.array([0]), np.array([1]), 3)  # node 2 isolated
    walks = random_walks(path, torch.tensor([2, 0]), walk_length=4)
    assert walks[0].tolist() == [2, -1, -1, -1]
    assert walks[1].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(walk_length=1), "walk_length: must be >= 2"),
    (dict(walk_length=5, p=0.0), "p, q: node2vec parameters must be > 0"),
])
def test_walks_reject_bad_arguments(karate, kwargs, message):
    with pytest.raises(ValueError, match=message):
        random_walks(karate.graph, torch.arange(3), **kwargs)


@pytest.mark.parametrize("window", [1, 2, 5, 20])
def test_pairs_equal_the_window_definition(window):
    walks = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, -1, -1, -1], [3, 3, 4, 5, 6, 2]])
    centers, contexts = skipgram_pairs(walks, window)
    assert centers.dtype == contexts.dtype == torch.int64
    assert sorted(zip(centers.tolist(), contexts.tolist())) == brute_force_pairs(walks, window)


def test_pair_count_formula_and_real_walk_neighbours(karate):
    walks = random_walks(karate.graph, torch.arange(34).repeat(3), walk_length=10)
    centers, contexts = skipgram_pairs(walks, 3)
    assert len(centers) == 102 * 2 * (9 + 8 + 7)
    assert sorted(zip(centers.tolist(), contexts.tolist())) == brute_force_pairs(walks, 3)


def test_pairs_reject_bad_window():
    with pytest.raises(ValueError, match="window: must be >= 1, got 0"):
        skipgram_pairs(torch.zeros(2, 3, dtype=torch.int64), 0)


def test_negatives_follow_degree_power():
    degrees = torch.tensor([1, 16, 0, 81])
    sampler = NegativeSampler(degrees)
    expected = np.array([1.0, 8.0, 0.0, 27.0]) / 36.0  # degree ** 0.75
    assert np.allclose(sampler.probs.numpy(), expected)
    draws = sampler.sample((200_000,), torch.Generator().manual_seed(0))
    freq = np.bincount(draws.numpy(), minlength=4) / len(draws)
    assert freq[2] == 0.0, "a node without edges is never a negative"
    assert np.abs(freq - expected).max() < 0.005


def test_negatives_are_seeded():
    sampler = NegativeSampler(torch.arange(1, 50))
    a = sampler.sample((10, 5), torch.Generator().manual_seed(3))
    b = sampler.sample((10, 5), torch.Generator().manual_seed(3))
    assert a.shape == (10, 5) and torch.equal(a, b)


def test_negative_sampler_needs_an_edge():
    with pytest.raises(ValueError, match="degrees: need at least one node"):
        NegativeSampler(torch.zeros(5))


def test_batches_cover_an_epoch_and_repeat(karate):
    batches = SkipGramBatches(karate.graph, walk_length=8, window=2, num_walks=2,
                              negatives=4, batch_size=100, seed=7, walks_per_chunk=10)
    epoch = list(batches.epoch(0))
    sizes = [len(c) for c, _, _ in epoch]
    assert sum(sizes) == batches.pairs_per_epoch() == 34 * 2 * 2 * (7 + 6)
    assert all(s == 100 for s in sizes[:-1]) and 0 < sizes[-1] <= 100
    for centers, contexts, negatives in epoch:
        assert negatives.shape == (len(centers), 4)
        assert all(t.dtype == torch.int64 for t in (centers, contexts, negatives))
    # Every center is a start node as often as it appears in walks: each node walks twice.
    assert torch.cat([c for c, _, _ in epoch]).unique().tolist() == list(range(34))
    again = list(batches.epoch(0))
    assert all(torch.equal(x, y) for a, b in zip(epoch, again) for x, y in zip(a, b))
    other = next(iter(batches.epoch(1)))
    assert not torch.equal(epoch[0][0], other[0])


def test_batches_skip_isolated_nodes():
    graph = simple_bidirected_graph(np.array([0, 1]), np.array([1, 2]), 5)
    batches = SkipGramBatches(graph, walk_length=3, window=1, num_walks=1, negatives=1,
                              batch_size=1000)
    centers, contexts, negatives = next(iter(batches.epoch(0)))
    assert len(centers) == 3 * 2 * 2  # 3 walks of 3 nodes, window 1, both directions
    assert set(torch.cat([centers, contexts, negatives.flatten()]).tolist()) <= {0, 1, 2}


def test_batches_reject_bad_sizes(karate):
    with pytest.raises(ValueError, match="batch_size: must be >= 1, got 0"):
        SkipGramBatches(karate.graph, walk_length=5, window=2, num_walks=1, negatives=1,
                        batch_size=0)


def test_default_chunks_hold_a_few_batches(karate):
    # Big chunks made the loss jump at each chunk boundary (the model fit the chunk's
    # nodes); the default keeps a chunk to about 4 batches.
    batches = SkipGramBatches(karate.graph, walk_length=8, window=2, num_walks=3,
                              negatives=2, batch_size=50, seed=1)
    assert batches.pairs_per_walk() == 2 * (7 + 6)
    assert batches.walks_per_chunk == 8  # ceil(4 * 50 / 26)
    assert sum(len(c) for c, _, _ in batches.epoch(0)) == batches.pairs_per_epoch()
