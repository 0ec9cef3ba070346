"""Training report figure: loss curve, 2-D projection of a few classes, F1 per class."""
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def _as_numpy(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def project_2d(embeddings, method: str = "pca", seed: int = 0) -> np.ndarray:
    """Project embeddings to two dimensions.

    Args:
        embeddings: (N, D) tensor or array, D >= 2.
        method: 'pca' (numpy SVD, fast, linear) or 'tsne' (scikit-learn; slow, so
            subsample first).
        seed: t-SNE seed.

    Returns:
        float (N, 2) coordinates.

    Raises:
        ValueError: method is unknown or D < 2.
    """
    x = _as_numpy(embeddings).astype(np.float64)
    if x.ndim != 2 or x.shape[1] < 2:
        raise ValueError(f"embeddings: expected shape (N, D >= 2), got {x.shape}")
    if method == "pca":
        centered = x - x.mean(axis=0)
        _, _, vt = np.linalg.svd(centered, full_matrices=False)
        return centered @ vt[:2].T
    if method == "tsne":
        from sklearn.manifold import TSNE  # heavy import, only when asked for

        return TSNE(n_components=2, init="pca", random_state=seed,
                    perplexity=min(30.0, (len(x) - 1) / 3)).fit_transform(x)
    raise ValueError(f"method: expected 'pca' or 'tsne', got {method!r}")


def largest_classes(labels, k: int = 10) -> np.ndarray:
    """The ``k`` classes with the most labelled nodes, largest first (ties: lower id).

    Args:
        labels: (N,) classes, -1 for unlabelled.
        k: how many.

    Returns:
        int64 array of at most ``k`` class ids.
    """
    y = _as_numpy(labels)
    classes, counts = np.unique(y[y >= 0], return_counts=True)
    order = np.lexsort((classes, -counts))
    return classes[order[:k]].astype(np.int64)


#: :func:`shown_classes` picks the best scored among this many times as many classes.
SHOWN_POOL = 3


def shown_classes(labels, k: int, per_class_f1: Optional[Dict[int, float]] = None,
                  pool: int = SHOWN_POOL) -> np.ndarray:
    """The classes a 2-D projection colours: the ``k`` largest, or, given each class's
    F1, the ``k`` best scored of the ``pool * k`` largest (largest first).

    Dozens of classes drawn at once are one cloud of colours, and so are classes the
    embeddings do not separate; the classes they separate best, among those with many
    nodes, show what the embeddings learned.

    Args:
        labels: (N,) classes, -1 for unlabelled.
        k: how many classes.
        per_class_f1: class -> F1, or None.
        pool: with F1, the best are picked among the ``pool * k`` largest classes.

    Returns:
        int64 array of at most ``k`` class ids, largest first.
    """
    if not per_class_f1:
        return largest_classes(labels, k)
    candidates = largest_classes(labels, pool * k)
    best = sorted(candidates, key=lambda c: -per_class_f1.get(int(c), 0.0))[:k]
    return np.asarray([c for c in candidates if c in best], dtype=np.int64)


def f1_bar_order(per_class_f1: Dict[int, float], support: Optional[Dict[int, int]] = None
                 ) -> List[int]:
    """Classes in the order the F1 bars are drawn: most scored nodes first, then by id."""
    support = support or {}
    return sorted(per_class_f1, key=lambda c: (-support.get(c, 0), c))


def _name(c: int, class_names: Optional[Sequence[str]]) -> str:
    return class_names[c] if class_names is not None and 0 <= c < len(class_names) else str(c)


def save_training_plot(path: Union[str, Path], losses: Sequence[float], embeddings,
                       labels: Optional[torch.Tensor] = None, method: str = "tsne",
                       max_points: int = 1200, seed: int = 0, title: str = "",
                       top_classes: int = 6,
                       per_class_f1: Optional[Dict[int, float]] = None,
                       support: Optional[Dict[int, int]] = None,
                       class_names: Optional[Sequence[str]] = None) -> Path:
    """Write a PNG: the loss curve, the embeddings of the largest classes in 2-D, and
    (when given) the test F1 of every class as bars.

    With many classes a scatter of all of them is an undifferentiated cloud, so only
    ``top_classes`` are projected (:func:`shown_classes`: the largest, or with F1 the best
    scored of the largest; a seeded subsample of their nodes), each with its own colour
    and a legend.

    Args:
        path: output .png path; parent directories are created.
        losses: loss per logged step.
        embeddings: (N, D) tensor or array.
        labels: (N,) classes, -1 for unlabelled; None (or no labelled node) draws every
            point alike.
        method: 'tsne' (default) or 'pca'.
        max_points: seeded subsample size for the projection, so t-SNE stays quick;
            with labels, shared equally by the shown classes.
        seed: subsample and t-SNE seed.
        title: figure title.
        top_classes: how many classes the projection shows.
        per_class_f1: class -> F1 (``ClassificationScores.per_class_f1``): adds the bars.
        support: class -> scored nodes, to order the bars (largest first) and label them.
        class_names: names of the classes by id (e.g. WordNet's lexicographer files).

    Returns:
        The path written.

    Raises:
        ValueError: as project_2d, or labels of the wrong length.
    """
    x = _as_numpy(embeddings)
    n = len(x)
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels: expected {n} entries (one per embedding), got {len(labels)}")
    y = None if labels is None else _as_numpy(labels)
    if y is not None and not (y >= 0).any():
        y = None  # no node has a label: every point alike
    shown = None if y is None else shown_classes(y, top_classes, per_class_f1)
    rng = np.random.default_rng(seed)
    if y is None:
        rows = np.sort(rng.permutation(n)[:max_points]) if n > max_points else np.arange(n)
    else:
        # The same number of nodes per class (at most): a class of 40% of the nodes
        # would otherwise bury the others under its points.
        per = max(1, max_points // max(len(shown), 1))
        rows = np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == c))[:per]
                                       for c in shown]))
    xy = project_2d(x[rows], method, seed)

    panels = 3 if per_class_f1 else 2
    height = max(5.0, 0.17 * len(per_class_f1)) if per_class_f1 else 5.0  # readable bars
    widths = [1.0, 1.1, 1.3][:panels]
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * sum(widths), height),
                             gridspec_kw={"width_ratios": widths}, layout="constrained")
    ax_loss, ax_emb = axes[0], axes[1]
    ax_loss.plot(np.arange(1, len(losses) + 1), losses, linewidth=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    # Big dots for small graphs, small ones where thousands overlap.
    size = float(np.clip(6000 / max(len(rows), 1), 5, 40))
    if y is None:
        ax_emb.scatter(xy[:, 0], xy[:, 1], s=size, alpha=0.7, linewidths=0)
        ax_emb.set_title(f"embeddings ({method.upper()}, {len(rows)} of {n} nodes)")
    else:
        colours = y[rows]
        cmap = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20")
        for i, c in enumerate(shown):
            at = colours == c
            ax_emb.scatter(xy[at, 0], xy[at, 1], s=size, alpha=0.7, linewidths=0,
                           color=cmap(i % cmap.N), label=_name(int(c), class_names))
        # below the points, inside the panel: no gap beside it for a legend
        ax_emb.legend(markerscale=max(1.0, 20 / size), fontsize="small", frameon=False,
                      loc="upper center", bbox_to_anchor=(0.5, -0.01),
                      ncol=min(3, len(shown)))
        total = len(np.unique(y[y >= 0]))
        if total <= len(shown):
            which = f"all {total} classes"
        elif per_class_f1:
            which = (f"the {len(shown)} best-scored of the {SHOWN_POOL * len(shown)} largest "
                     f"of {total} classes")
        else:
            which = f"the {len(shown)} largest of {total} classes"
        ax_emb.set_title(f"{method.upper()} of {which}\n(up to {per} nodes each)")
    ax_emb.set_xticks([])
    ax_emb.set_yticks([])
    if per_class_f1:
        ax_f1 = axes[2]
        order = f1_bar_order(per_class_f1, support)
        scores = [per_class_f1[c] for c in order]
        names = [_name(c, class_names) + (f" ({support[c]})" if support else "")
                 for c in order]
        ax_f1.barh(np.arange(len(order)), scores, color="tab:blue", alpha=0.8)
        fs = max(6, min(9, 360 // max(len(order), 1)))
        for i, f in enumerate(scores):
            ax_f1.text(min(f, 0.9) + 0.01, i, f"{f:.2f}", va="center", fontsize=fs)
        macro = float(np.mean(scores))
        ax_f1.axvline(macro, color="tab:red", linewidth=1, linestyle="--")
        ax_f1.set_yticks(np.arange(len(order)))
        ax_f1.set_yticklabels(names, fontsize=fs)
        ax_f1.invert_yaxis()  # largest class on top
        ax_f1.set_xlim(0, 1)
        ax_f1.set_xlabel("test F1")
        ax_f1.set_title(f"F1 per class, test nodes (dashed: macro F1 {macro:.3f})")
        ax_f1.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
