"""Training report figure: the loss curve beside a 2-D projection of the embeddings."""
from pathlib import Path
from typing import Optional, Sequence, Union

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


def save_training_plot(path: Union[str, Path], losses: Sequence[float], embeddings,
                       labels: Optional[torch.Tensor] = None, method: str = "pca",
                       max_points: int = 5000, seed: int = 0, title: str = "") -> Path:
    """Write a PNG: loss per step (left), embeddings in 2-D coloured by class (right).

    Args:
        path: output .png path; parent directories are created.
        losses: loss per logged step.
        embeddings: (N, D) tensor or array.
        labels: (N,) classes, -1 for unlabelled; None draws every point alike.
        method: 'pca' or 'tsne'.
        max_points: seeded subsample size for the projection, so t-SNE stays quick.
        seed: subsample and t-SNE seed.
        title: figure title.

    Returns:
        The path written.

    Raises:
        ValueError: as project_2d, or labels of the wrong length.
    """
    x = _as_numpy(embeddings)
    n = len(x)
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels: expected {n} entries (one per embedding), got {len(labels)}")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.permutation(n)[:max_points]) if n > max_points else np.arange(n)
    xy = project_2d(x[rows], method, seed)
    colours = None if labels is None else _as_numpy(labels)[rows]

    fig, (ax_loss, ax_emb) = plt.subplots(1, 2, figsize=(12, 5))
    ax_loss.plot(np.arange(1, len(losses) + 1), losses, linewidth=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    # Big dots for small graphs, small ones where thousands overlap.
    size = float(np.clip(3000 / len(rows), 3, 40))
    if colours is None:
        ax_emb.scatter(xy[:, 0], xy[:, 1], s=size, alpha=0.7, linewidths=0)
    else:
        classes = np.unique(colours[colours >= 0])
        cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
        for i, c in enumerate(classes):
            at = colours == c
            ax_emb.scatter(xy[at, 0], xy[at, 1], s=size, alpha=0.7, linewidths=0,
                           color=cmap(i % cmap.N), label=str(c))
        if len(classes) <= 10:
            ax_emb.legend(title="class", markerscale=max(1.0, 20 / size), fontsize="small")
    ax_emb.set_title(f"embeddings ({method.upper()}, {len(rows)} of {n} nodes)")
    ax_emb.set_xticks([])
    ax_emb.set_yticks([])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
