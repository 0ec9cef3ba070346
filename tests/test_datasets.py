"""Tests for graph_examples.datasets and graph_examples.wordnet."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from graph_examples import wordnet
from graph_examples.datasets import (GraphDataset, load_dataset, make_split,
                                     simple_bidirected_graph)
from graph_examples.errors import DatasetError, DatasetNotFoundError

WORDNET_ROOT = Path(wordnet.DEFAULT_ROOT)
# Measured on Debian's wordnet-base (WordNet 3.0): 377,592 pointers, 19 of them from a
# synset to itself; merged both ways they give 183,789 undirected edges.
WORDNET_NODES = 117_659
WORDNET_DIRECTED_EDGES = 367_578


def assert_simple_bidirected(ds: GraphDataset):
    src, dst = (t.numpy() for t in ds.graph.edges())
    n = ds.graph.num_nodes()
    assert not (src == dst).any(), "self loop"
    keys = src * n + dst
    assert len(np.unique(keys)) == len(keys), "duplicate edge"
    assert np.array_equal(np.sort(keys), np.sort(dst * n + src)), "missing reverse edge"


def assert_split_ok(ds: GraphDataset):
    parts = [ds.train_idx, ds.val_idx, ds.test_idx]
    joined = torch.cat(parts)
    assert len(joined.unique()) == len(joined), "splits overlap"
    labelled = torch.nonzero(ds.labels >= 0).flatten()
    assert torch.equal(joined.sort().values, labelled), "splits must cover labelled nodes"
    for p in parts:
        assert p.dtype == torch.int64


def assert_same(a: GraphDataset, b: GraphDataset):
    for x, y in zip(a.graph.edges(), b.graph.edges()):
        assert torch.equal(x, y)
    for field in ("labels", "train_idx", "val_idx", "test_idx"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert np.array_equal(a.node_ids, b.node_ids)
    assert a.num_classes == b.num_classes


# --- splits and graph construction -----------------------------------------------------

def test_make_split_sizes_disjoint_and_seeded():
    labels = np.arange(100) % 3
    train, val, test = make_split(labels, (0.6, 0.2, 0.2), seed=5)
    assert (len(train), len(val), len(test)) == (60, 20, 20)
    assert len(torch.cat([train, val, test]).unique()) == 100
    again = make_split(labels, (0.6, 0.2, 0.2), seed=5)
    other = make_split(labels, (0.6, 0.2, 0.2), seed=6)
    assert all(torch.equal(a, b) for a, b in zip((train, val, test), again))
    assert not torch.equal(train, other[0])


def test_make_split_leaves_out_unlabelled():
    labels = np.array([0, -1, 1, -1, 0, 1, 1, 0, -1, 0])
    parts = make_split(labels, (0.5, 0.25, 0.25), seed=0)
    assert sorted(torch.cat(parts).tolist()) == [0, 2, 4, 5, 6, 7, 9]


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.6, 0.3, 0.3), (1.2, -0.1, -0.1)])
def test_make_split_rejects_bad_fractions(fractions):
    with pytest.raises(DatasetError, match="split: expected 3 non-negative fractions"):
        make_split(np.zeros(10), fractions)


def test_simple_bidirected_graph_drops_loops_and_duplicates():
    g = simple_bidirected_graph(np.array([0, 1, 1, 2, 3]), np.array([1, 0, 1, 0, 3]), 5)
    pairs = sorted(zip(*(t.tolist() for t in g.edges())))
    assert pairs == [(0, 1), (0, 2), (1, 0), (2, 0)]
    assert g.num_nodes() == 5


# --- karate ---------------------------------------------------------------------------

def test_karate():
    ds = load_dataset("karate")
    assert ds.graph.num_nodes() == 34
    assert ds.graph.num_edges() == 2 * 78
    assert ds.num_classes == 2
    assert ds.labels.bincount().tolist() == [17, 17]
    assert (len(ds.train_idx), len(ds.val_idx), len(ds.test_idx)) == (20, 7, 7)
    assert ds.labels[0] == 0 and ds.labels[33] == 1  # Mr. Hi and the officer
    assert_simple_bidirected(ds)
    assert_split_ok(ds)
    assert_same(ds, load_dataset("karate"))


# --- sbm ------------------------------------------------------------------------------

def test_sbm_shapes_labels_and_homophily():
    ds = load_dataset("sbm", num_nodes=3000, num_classes=3, avg_degree=8, homophily=0.9,
                      seed=3)
    assert ds.graph.num_nodes() == 3000
    assert ds.labels.bincount().tolist() == [1000, 1000, 1000]
    # 12,000 drawn edges, doubled; a few repeats and loops are dropped.
    assert 0.97 * 24_000 < ds.graph.num_edges() <= 24_000
    src, dst = ds.graph.edges()
    assert abs((ds.labels[src] == ds.labels[dst]).double().mean().item() - 0.9) < 0.02
    assert_simple_bidirected(ds)
    assert_split_ok(ds)


def test_sbm_is_deterministic_per_seed():
    kwargs = dict(num_nodes=500, num_classes=4, avg_degree=6)
    a = load_dataset("sbm", seed=1, **kwargs)
    assert_same(a, load_dataset("sbm", seed=1, **kwargs))
    b = load_dataset("sbm", seed=2, **kwargs)
    assert not torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_classes=1), "num_classes: must be >= 2, got 1"),
    (dict(num_nodes=3, num_classes=5), "num_nodes: must be >= num_classes"),
    (dict(avg_degree=0), "avg_degree: must be > 0, got 0"),
    (dict(homophily=1.5), r"homophily: must be in \[0, 1\], got 1.5"),
])
def test_sbm_rejects_bad_parameters(kwargs, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset("sbm", **kwargs)


# --- dispatcher -----------------------------------------------------------------------

def test_unknown_dataset_lists_known_names():
    with pytest.raises(DatasetError, match=r"unknown name 'cora'; expected one of \["):
        load_dataset("cora")


def test_unknown_loader_argument_is_named():
    with pytest.raises(DatasetError, match="unexpected keyword argument 'nodes'"):
        load_dataset("sbm", nodes=10)


# --- edgelist -------------------------------------------------------------------------

def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_edgelist_remaps_ids_and_reads_labels(tmp_path):
    edges = write(tmp_path / "e.txt", "# a comment\n10 20\n20,30  # trailing\n\n30\t10\n40 40\n")
    labels = write(tmp_path / "l.txt", "10 1\n20 0\n30 1\n50 2\n")
    ds = load_dataset("edgelist", path=edges, labels_path=labels)
    assert ds.node_ids.tolist() == [10, 20, 30, 40, 50]  # 50 only has a label: isolated
    assert ds.labels.tolist() == [1, 0, 1, -1, 2]
    assert ds.num_classes == 3
    pairs = sorted(zip(*(t.tolist() for t in ds.graph.edges())))
    assert pairs == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]  # loop 40-40 dropped
    assert_split_ok(ds)
    assert_same(ds, load_dataset("edgelist", path=edges, labels_path=labels))


def test_edgelist_string_ids_and_labels(tmp_path):
    edges = write(tmp_path / "e.csv", "alice,bob\nbob,carol\n")
    labels = write(tmp_path / "l.csv", "alice,red\nbob,blue\ncarol,red\n")
    ds = load_dataset("edgelist", path=edges, labels_path=labels)
    assert ds.node_ids.tolist() == ["alice", "bob", "carol"]
    assert ds.labels.tolist() == [1, 0, 1]  # classes numbered in sorted order: blue, red
    assert ds.num_classes == 2


def test_edgelist_without_labels_has_empty_splits(tmp_path):
    ds = load_dataset("edgelist", path=write(tmp_path / "e.txt", "1 2\n2 3\n"))
    assert ds.labels.tolist() == [-1, -1, -1] and ds.num_classes == 0
    assert len(ds.train_idx) == len(ds.val_idx) == len(ds.test_idx) == 0


@pytest.mark.parametrize("edges, labels, message", [
    ("1 2\n3\n", None, r"e.txt:2: expected 2 fields `src dst`.*got 1: '3'"),
    ("1 2\n3 4 0.5\n", None, r"e.txt:2: expected 2 fields `src dst`.*got 3"),
    ("# only a comment\n", None, r"e.txt: no edges found"),
    ("1 2\n", "1 0\n2 1\n1 1\n", r"l.txt:3: node '1' labelled '1', but earlier '0'"),
    ("1 2\n", "1 0\n2 -1\n", r"l.txt: labels must be >= 0"),
    ("1 2\n", "1\n", r"l.txt:1: expected 2 fields `node label`"),
])
def test_edgelist_errors_name_file_and_line(tmp_path, edges, labels, message):
    edges_path = write(tmp_path / "e.txt", edges)
    labels_path = write(tmp_path / "l.txt", labels) if labels is not None else None
    with pytest.raises(DatasetError, match=message):
        load_dataset("edgelist", path=edges_path, labels_path=labels_path)


def test_edgelist_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_dataset("edgelist", path=tmp_path / "nope.txt")


# --- wordnet: a tiny synthetic database (runs everywhere) -----------------------------

LICENSE = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
MINI = {
    # offset lex pos w_cnt word lex_id p_cnt ptrs... | gloss
    "noun": ["00000100 03 n 01 entity 0 002 ~ 00000200 n 0000 + 00000100 v 0101 | a thing",
             "00000200 05 n 02 animal 0 beast 0 001 @ 00000100 n 0000 | a living being"],
    "verb": ["00000100 29 v 01 be 0 001 + 00000100 n 0101 01 + 02 00 | exist"],
    "adj": ["00000100 00 a 01 able 0 001 & 00000300 a 0000 | can",
            "00000300 00 s 01 capable 0 001 & 00000100 s 0000 | can well"],
    "adv": ["00000100 02 r 01 ably 0 001 \\ 00000100 a 0101 | in an able way"],
}


def write_mini_wordnet(root: Path, files=MINI) -> Path:
    root.mkdir(exist_ok=True)
    for name, lines in files.items():
        write(root / f"data.{name}", LICENSE + "".join(f"{ln}  \n" for ln in lines))
    return root


def test_mini_wordnet_parse(tmp_path):
    ds = load_dataset("wordnet", root=write_mini_wordnet(tmp_path / "wn"), use_cache=False)
    assert ds.node_ids.tolist() == ["00000100-n", "00000200-n", "00000100-v",
                                    "00000100-a", "00000300-a", "00000100-r"]
    assert ds.labels.tolist() == [3, 5, 29, 0, 0, 2]
    assert ds.num_classes == 45
    undirected = sorted((u, v) for u, v in zip(*(t.tolist() for t in ds.graph.edges()))
                        if u < v)
    # noun 0-1 twice (merged), noun-verb 0-2 twice, adj 3-4 (satellite 's' -> data.adj),
    # adv 5 -> adj 3.
    assert undirected == [(0, 1), (0, 2), (3, 4), (3, 5)]


def test_mini_wordnet_cache_hit_and_invalidation(tmp_path):
    root = write_mini_wordnet(tmp_path / "wn")
    cache = tmp_path / "cache"
    first = load_dataset("wordnet", root=root, cache_dir=cache)
    assert len(list(cache.glob("wordnet-*.npz"))) == 1
    assert_same(first, load_dataset("wordnet", root=root, cache_dir=cache))
    grown = dict(MINI, adv=MINI["adv"] + ["00000200 02 r 01 well 0 000 | fine"])
    write_mini_wordnet(root, grown)
    second = load_dataset("wordnet", root=root, cache_dir=cache)
    assert second.graph.num_nodes() == first.graph.num_nodes() + 1
    assert len(list(cache.glob("wordnet-*.npz"))) == 2


def test_unwritable_cache_warns_and_still_loads(tmp_path):
    root = write_mini_wordnet(tmp_path / "wn")
    not_a_dir = write(tmp_path / "file", "")
    with pytest.warns(RuntimeWarning, match="WordNet cache not written"):
        ds = load_dataset("wordnet", root=root, cache_dir=not_a_dir / "cache")
    assert ds.graph.num_nodes() == 6


def test_corrupt_cache_is_replaced(tmp_path):
    root = write_mini_wordnet(tmp_path / "wn")
    cache = tmp_path / "cache"
    load_dataset("wordnet", root=root, cache_dir=cache)
    (path,) = cache.glob("wordnet-*.npz")
    path.write_bytes(b"not an npz")
    assert load_dataset("wordnet", root=root, cache_dir=cache).graph.num_nodes() == 6
    assert path.read_bytes()[:2] == b"PK"  # rewritten as a zip (npz) file


def test_mini_wordnet_bad_pointer_target(tmp_path):
    files = dict(MINI, verb=["00000100 29 v 01 be 0 001 + 00009999 n 0101 | exist"])
    with pytest.raises(DatasetError, match="1 pointers target unknown synsets.*00009999"):
        load_dataset("wordnet", root=write_mini_wordnet(tmp_path / "wn", files),
                     use_cache=False)


def test_mini_wordnet_malformed_line_names_file_and_line(tmp_path):
    files = dict(MINI, noun=MINI["noun"] + ["00000300 77 n 01 oops 0 000 | bad lex"])
    with pytest.raises(DatasetError, match=r"data.noun:4: malformed.*lex_filenum 77"):
        load_dataset("wordnet", root=write_mini_wordnet(tmp_path / "wn", files),
                     use_cache=False)


def test_missing_wordnet_says_how_to_install(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"apt-get install wordnet-base.*make data"):
        load_dataset("wordnet", root=tmp_path / "absent")


# --- wordnet: the real database -------------------------------------------------------

needs_wordnet = pytest.mark.skipif(
    not (WORDNET_ROOT / "data.noun").is_file(),
    reason=f"WordNet is not installed at {WORDNET_ROOT} (apt-get install wordnet-base)")


@needs_wordnet
def test_wordnet_counts(tmp_path):
    ds = load_dataset("wordnet", cache_dir=tmp_path)
    print(f"wordnet: {ds.graph.num_nodes()} nodes, {ds.graph.num_edges()} directed edges")
    assert ds.graph.num_nodes() == WORDNET_NODES
    assert ds.graph.num_edges() == WORDNET_DIRECTED_EDGES
    assert ds.num_classes == 45
    counts = ds.labels.bincount(minlength=45)
    assert len(counts) == 45 and (counts > 0).all(), "every lexicographer file has synsets"
    # adv.all holds every adverb (3,621 lines in data.adv); noun.Tops is tiny.
    assert counts[2] == 3621 and counts[3] == 51
    assert_simple_bidirected(ds)
    assert_split_ok(ds)
    assert (len(ds.train_idx), len(ds.val_idx)) == (70_595, 23_532)
    assert_same(ds, load_dataset("wordnet", cache_dir=tmp_path))  # cache hit
    assert_same(ds, load_dataset("wordnet", use_cache=False))


@needs_wordnet
def test_wordnet_node_ids_match_file_offsets():
    arrays = wordnet.load_wordnet_arrays(use_cache=False)
    names = wordnet.node_names(arrays)
    with open(WORDNET_ROOT / "data.verb", "rb") as fh:
        fh.seek(int(names[arrays.pos == 1][0].split("-")[0]))
        assert fh.readline().startswith(b"00001740 29 v 04 breathe")
    assert os.path.getsize(WORDNET_ROOT / "data.adj") > arrays.offset[arrays.pos == 2].max()
