"""Labelled graph datasets with fixed splits: karate, WordNet, planted partition, edge lists.

Every loader returns the same shape of graph: a DGL graph that is simple (no duplicate
edges, no self loops) and bidirected (u->v exists iff v->u does), because random-walk
embeddings treat edges as undirected. Splits are a seeded permutation of the labelled
nodes, cut 60/20/20 by default.

Example:
    >>> ds = load_dataset("karate")
    >>> ds.graph.num_nodes(), ds.num_classes, len(ds.train_idx)
    (34, 2, 20)
"""
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

os.environ.setdefault("DGLBACKEND", "pytorch")  # before dgl: silences its config warning
import dgl  # noqa: E402

from graph_examples import wordnet  # noqa: E402
from graph_examples.errors import DatasetError  # noqa: E402

DEFAULT_SPLIT = (0.6, 0.2, 0.2)


@dataclass(frozen=True, eq=False)  # tensors have no single truth value to compare
class GraphDataset:
    """A graph with node labels and a fixed train/validation/test split.

    Attributes:
        name: dataset name as given to load_dataset.
        graph: simple, bidirected DGL graph on nodes 0..N-1.
        labels: int64 (N,) class per node; -1 marks an unlabelled node.
        num_classes: number of classes (0 when the graph has no labels).
        train_idx, val_idx, test_idx: int64 node ids; disjoint, together all labelled nodes.
        node_ids: numpy (N,) original id of each node (file ids, WordNet 'offset-pos').
        class_names: the name of each class by id (a labels file's own labels, WordNet's
            lexicographer files, karate's clubs), or None where the ids are the names.

    Example:
        >>> ds = load_dataset("sbm", num_nodes=1000, num_classes=4, seed=1)
        >>> ds.labels[ds.train_idx].unique().tolist()
        [0, 1, 2, 3]
    """

    name: str
    graph: dgl.DGLGraph
    labels: torch.Tensor
    num_classes: int
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    node_ids: np.ndarray
    class_names: Optional[Tuple[str, ...]] = None

    def class_name(self, c: int) -> str:
        """The name of class ``c`` (its id as text where the classes have no names)."""
        names = self.class_names
        return names[c] if names is not None and 0 <= c < len(names) else str(c)


def make_split(labels: np.ndarray, fractions: Sequence[float] = DEFAULT_SPLIT,
               seed: int = 0):
    """Split the labelled nodes by a seeded permutation.

    Args:
        labels: (N,) class per node, -1 for unlabelled (left out of every split).
        fractions: (train, val, test) fractions, each >= 0, summing to 1.
        seed: permutation seed; the same seed gives the same split.

    Returns:
        (train_idx, val_idx, test_idx) int64 tensors, each sorted ascending.

    Raises:
        DatasetError: fractions are not three non-negative numbers summing to 1.
    """
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.shape != (3,) or (fr < 0).any() or abs(fr.sum() - 1.0) > 1e-6:
        raise DatasetError(
            f"split: expected 3 non-negative fractions summing to 1, got {tuple(fractions)}")
    labelled = np.flatnonzero(np.asarray(labels) >= 0)
    perm = labelled[np.random.default_rng(seed).permutation(len(labelled))]
    n_train = int(round(fr[0] * len(perm)))
    n_val = int(round(fr[1] * len(perm)))
    parts = np.split(perm, [n_train, n_train + n_val])
    return tuple(torch.from_numpy(np.sort(p)).long() for p in parts)


def simple_bidirected_graph(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> dgl.DGLGraph:
    """Build a DGL graph with both directions of every edge, without loops or duplicates.

    Args:
        src, dst: int arrays of edge endpoints in 0..num_nodes-1.
        num_nodes: node count (isolated nodes allowed).

    Returns:
        DGL graph whose edges are sorted by (src, dst).
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    both_src = np.concatenate([src, dst])
    both_dst = np.concatenate([dst, src])
    keep = both_src != both_dst
    # One int64 key per edge makes dedup a single np.unique (exact below 3e9 nodes).
    keys = np.unique(both_src[keep] * num_nodes + both_dst[keep])
    return dgl.graph((torch.from_numpy(keys // num_nodes), torch.from_numpy(keys % num_nodes)),
                     num_nodes=num_nodes)


def _dataset(name, src, dst, labels, num_classes, node_ids, split, split_seed,
             class_names=None):
    labels = np.asarray(labels, dtype=np.int64)
    train, val, test = make_split(labels, split, split_seed)
    return GraphDataset(name, simple_bidirected_graph(src, dst, len(labels)),
                        torch.from_numpy(labels), num_classes, train, val, test,
                        np.asarray(node_ids),
                        None if class_names is None else tuple(map(str, class_names)))


def load_karate(split: Sequence[float] = DEFAULT_SPLIT, split_seed: int = 0) -> GraphDataset:
    """Load Zachary's karate club (34 nodes, 78 edges) from networkx.

    Args:
        split: (train, val, test) fractions.
        split_seed: split permutation seed.

    Returns:
        GraphDataset with labels 0 = 'Mr. Hi', 1 = 'Officer' (the 'club' attribute).
    """
    import networkx as nx  # optional dependency: only this loader needs it

    g = nx.karate_club_graph()
    clubs = ["Mr. Hi", "Officer"]
    labels = [clubs.index(g.nodes[v]["club"]) for v in range(g.number_of_nodes())]
    edges = np.asarray(list(g.edges()), dtype=np.int64)
    return _dataset("karate", edges[:, 0], edges[:, 1], labels, 2,
                    np.arange(len(labels)), split, split_seed, clubs)


def load_wordnet(root: Union[str, Path] = wordnet.DEFAULT_ROOT,
                 cache_dir: Optional[Union[str, Path]] = None, use_cache: bool = True,
                 split: Sequence[float] = DEFAULT_SPLIT, split_seed: int = 0) -> GraphDataset:
    """Load the WordNet 3.0 synset graph: 117,659 synsets, 45 lexicographer-file classes.

    Every pointer becomes an undirected edge; the 19 pointers from a synset to itself
    are dropped and parallel pointers merged (see simple_bidirected_graph).

    Args:
        root: directory holding data.noun, data.verb, data.adj, data.adv.
        cache_dir: .npz cache directory; default $DISTEMB_CACHE_DIR or ~/.cache/distemb.
        use_cache: False re-parses and writes no cache.
        split: (train, val, test) fractions.
        split_seed: split permutation seed.

    Returns:
        GraphDataset; node_ids holds WordNet ids such as '00001740-n'.

    Raises:
        DatasetNotFoundError: WordNet is not installed at root (says how to install it).
        DatasetError: a data file is malformed.
    """
    arr = wordnet.load_wordnet_arrays(root, cache_dir, use_cache)
    return _dataset("wordnet", arr.src, arr.dst, arr.labels, wordnet.NUM_LEX_FILES,
                    wordnet.node_names(arr), split, split_seed, wordnet.LEX_NAMES)


def load_sbm(num_nodes: int = 10000, num_classes: int = 5, avg_degree: float = 10.0,
             homophily: float = 0.8, seed: int = 0,
             split: Sequence[float] = DEFAULT_SPLIT, split_seed: Optional[int] = None
             ) -> GraphDataset:
    """Sample a planted-partition graph (a stochastic block model with equal blocks).

    Draws num_nodes * avg_degree / 2 edges: each picks a uniform source, then, with
    probability homophily, a uniform target in the source's class, else a uniform
    target in another class. With k equal classes this is an SBM with
    p_in / p_out = homophily * (k - 1) / (1 - homophily); self loops and repeats are
    then dropped, so the realised degree is slightly below avg_degree.

    Args:
        num_nodes: node count, >= num_classes.
        num_classes: number of blocks, >= 2.
        avg_degree: expected undirected degree, > 0.
        homophily: fraction of edges inside a class, in [0, 1].
        seed: graph and label seed.
        split: (train, val, test) fractions.
        split_seed: split seed; default: seed.

    Returns:
        GraphDataset with balanced classes assigned in random order.

    Raises:
        DatasetError: a parameter is out of range.
    """
    if num_classes < 2:
        raise DatasetError(f"sbm num_classes: must be >= 2, got {num_classes}")
    if num_nodes < num_classes:
        raise DatasetError(
            f"sbm num_nodes: must be >= num_classes ({num_classes}), got {num_nodes}")
    if not avg_degree > 0:
        raise DatasetError(f"sbm avg_degree: must be > 0, got {avg_degree}")
    if not 0.0 <= homophily <= 1.0:
        raise DatasetError(f"sbm homophily: must be in [0, 1], got {homophily}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_nodes) % num_classes)
    members = np.argsort(labels, kind="stable")  # nodes grouped by class
    sizes = np.bincount(labels, minlength=num_classes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    num_edges = int(round(num_nodes * avg_degree / 2))
    src = rng.integers(0, num_nodes, num_edges)
    other = rng.integers(1, num_classes, num_edges)  # shift to a different class
    same = rng.random(num_edges) < homophily
    cls = np.where(same, labels[src], (labels[src] + other) % num_classes)
    dst = members[starts[cls] + (rng.random(num_edges) * sizes[cls]).astype(np.int64)]
    return _dataset("sbm", src, dst, labels, num_classes, np.arange(num_nodes), split,
                    seed if split_seed is None else split_seed)


_FIELD_SEP = re.compile(r"[,\s]+")


def _read_pairs(path: Path, what: str):
    # Yields (line number, first field, second field) of a two-column text file.
    with open(path, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            fields = _FIELD_SEP.split(text)
            if len(fields) != 2:
                raise DatasetError(
                    f"{path}:{lineno}: expected 2 fields `{what}` separated by whitespace "
                    f"or a comma, got {len(fields)}: {text!r}")
            yield lineno, fields[0], fields[1]


def _as_ids(tokens):
    # Integer ids stay integers (sorted numerically); anything else stays a string.
    try:
        return np.asarray([int(t) for t in tokens], dtype=np.int64)
    except ValueError:
        return np.asarray(tokens, dtype=str)


def load_edgelist(path: Union[str, Path], labels_path: Optional[Union[str, Path]] = None,
                  split: Sequence[float] = DEFAULT_SPLIT, split_seed: int = 0) -> GraphDataset:
    """Load a user's edge list, remapping node ids to 0..N-1.

    Lines hold `src dst` separated by whitespace or a comma; '#' starts a comment.
    The optional labels file holds `node label` lines; integer labels are kept as
    given (num_classes = max + 1), other labels are numbered in sorted order and keep
    their text as the classes' names (``class_names``). Nodes
    named only in the labels file become isolated nodes; nodes without a label get -1.
    When every id is an integer, ids compare as integers ('007' and '7' are one node).

    Args:
        path: edge list file.
        labels_path: optional node label file.
        split: (train, val, test) fractions over the labelled nodes.
        split_seed: split permutation seed.

    Returns:
        GraphDataset whose node_ids maps each new id to the file's id (int64 when all
        ids are integers, else str), sorted.

    Raises:
        FileNotFoundError: a file does not exist.
        DatasetError: a line is malformed (the message names file and line), a label is
            negative, a node has two labels, or the edge list has no edges.
    """
    path = Path(path)
    edges = [(a, b) for _, a, b in _read_pairs(path, "src dst")]
    if not edges:
        raise DatasetError(f"{path}: no edges found (expected `src dst` lines)")
    label_of = {}
    if labels_path is not None:
        for lineno, node, label in _read_pairs(Path(labels_path), "node label"):
            if label_of.setdefault(node, label) != label:
                raise DatasetError(
                    f"{labels_path}:{lineno}: node {node!r} labelled {label!r}, "
                    f"but earlier {label_of[node]!r}")
    tokens = np.asarray(edges, dtype=str)
    node_ids, inverse = np.unique(
        _as_ids(np.concatenate([tokens.ravel(), list(label_of)])), return_inverse=True)
    src, dst = inverse[:tokens.size].reshape(-1, 2).T
    labels = np.full(len(node_ids), -1, dtype=np.int64)
    num_classes, class_names = 0, None
    if label_of:
        values = _as_ids(list(label_of.values()))
        if values.dtype.kind == "i":
            if (values < 0).any():
                raise DatasetError(
                    f"{labels_path}: labels must be >= 0 (or non-numeric names), "
                    f"got {int(values.min())}")
            codes = values
        else:
            class_names, codes = np.unique(values, return_inverse=True)
        labels[inverse[tokens.size:]] = codes
        num_classes = int(codes.max()) + 1
    return _dataset(path.name, src, dst, labels, num_classes, node_ids, split, split_seed,
                    class_names)


_LOADERS = {
    "karate": load_karate,
    "wordnet": load_wordnet,
    "sbm": load_sbm,
    "edgelist": load_edgelist,
}
DATASET_NAMES = tuple(sorted(_LOADERS))


def load_dataset(name: str, **kwargs) -> GraphDataset:
    """Load a dataset by name, passing kwargs to its loader.

    Args:
        name: one of 'karate', 'wordnet', 'sbm', 'edgelist'.
        **kwargs: the loader's arguments (e.g. path= for 'edgelist', num_nodes= for 'sbm').

    Returns:
        GraphDataset.

    Raises:
        DatasetError: unknown name, or bad arguments for the loader.
        DatasetNotFoundError: the dataset's files are not installed.
    """
    loader = _LOADERS.get(name)
    if loader is None:
        raise DatasetError(f"dataset: unknown name {name!r}; expected one of {list(DATASET_NAMES)}")
    signature = inspect.signature(loader)
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise DatasetError(
            f"dataset {name!r}: {exc}; its arguments are {list(signature.parameters)}") from exc
    return loader(**kwargs)
