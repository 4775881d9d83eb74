"""The pipeline's figures. Each function takes plain arrays and writes one PNG; titles, axis labels,
class legends, and the domain and algorithm on each panel. Deterministic given the inputs and seed."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
import numpy as np

from fedccrl_core.fsio import atomic_file

CMAP = plt.get_cmap("tab10")


def _save(fig, path: Path) -> Path:
    path = Path(path)
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def augmentation_preview(rows: list[dict], path: Path) -> Path:
    """Fig. 3 per client: originals | CCDT (pool statistics of other clients) | CCDT then DIFP.
    rows: [{"client": str, "original": u8 [n,H,W,3], "ccdt": ..., "ccdt_difp": ...}]"""
    n = rows[0]["original"].shape[0]
    cols = ("original", "ccdt", "ccdt_difp")
    titles = {"original": "original", "ccdt": "CCDT (MixStyle, other clients' pool)", "ccdt_difp": "CCDT + DIFP (AugMix)"}
    fig, axes = plt.subplots(len(rows), 3 * n, figsize=(1.1 * 3 * n, 1.25 * len(rows) + 0.6), squeeze=False)
    for r, row in enumerate(rows):
        for g, col in enumerate(cols):
            for i in range(n):
                ax = axes[r, g * n + i]
                ax.imshow(row[col][i])
                ax.set_xticks([]), ax.set_yticks([])
                if r == 0 and i == 0:
                    ax.set_title(titles[col], fontsize=8, loc="left")
            axes[r, 0].set_ylabel(row["client"], fontsize=8)
    fig.suptitle("FedCCRL feature augmentation per client (Fig. 3)", fontsize=10)
    return _save(fig, path)


def round_curves(domain: str, series: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> Path:
    """Per-round curves for one held-out domain. series: {metric: {algorithm: [(round, value)]}}."""
    metrics = list(series)
    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.9 * nrows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes.flat, metrics):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for k, (alg, pts) in enumerate(sorted(series[metric].items())):
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, marker="o", ms=3, label=alg, color=CMAP(k % 10))
        ax.set_title(f"{metric} — held-out {domain}", fontsize=9)
        ax.set_xlabel("round"), ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def tsne_panels(domain: str, panels: dict[str, tuple[np.ndarray, np.ndarray]], classes: list[str], path: Path) -> Path:
    """Fig. 5: t-SNE of h(x) on the held-out domain, one panel per algorithm. panels: {alg: (xy [n,2], y [n])}."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (alg, (xy, y)) in zip(axes[0], panels.items()):
        for c, name in enumerate(classes):
            m = y == c
            ax.scatter(xy[m, 0], xy[m, 1], s=6, color=CMAP(c % 10), label=name)
        ax.set_title(f"{alg} — held-out {domain}", fontsize=9)
        ax.set_xlabel("t-SNE 1"), ax.set_ylabel("t-SNE 2")
        ax.set_xticks([]), ax.set_yticks([])
    axes[0, -1].legend(fontsize=7, markerscale=2, loc="center left", bbox_to_anchor=(1, 0.5), title="class")
    return _save(fig, path)


def gradcam_grid(domain: str, images: np.ndarray, cams: dict[str, tuple[np.ndarray, np.ndarray]], classes: list[str],
                 labels: np.ndarray, path: Path) -> Path:
    """Fig. 7: Grad-CAM overlays, one row per algorithm. cams: {alg: (cam [n,H,W] in [0,1], pred [n])}."""
    n = images.shape[0]
    fig, axes = plt.subplots(len(cams) + 1, n, figsize=(1.4 * n, 1.5 * (len(cams) + 1)), squeeze=False)
    for i in range(n):
        axes[0, i].imshow(images[i])
        axes[0, i].set_title(classes[labels[i]], fontsize=7)
        for r, (alg, (cam, pred)) in enumerate(cams.items(), 1):
            axes[r, i].imshow(images[i])
            axes[r, i].imshow(cam[i], cmap="jet", alpha=0.45, vmin=0, vmax=1)
            axes[r, i].set_title(f"pred {classes[pred[i]]}", fontsize=7)
    for r, name in enumerate(["image (true class)", *cams]):
        axes[r, 0].set_ylabel(name, fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(f"Grad-CAM on held-out {domain} (Fig. 7)", fontsize=10)
    return _save(fig, path)


def confusion(domain: str, algorithm: str, cm: np.ndarray, classes: list[str], path: Path) -> Path:
    cm = np.asarray(cm)
    norm = cm / np.clip(cm.sum(1, keepdims=True), 1, None)
    fig, ax = plt.subplots(figsize=(1.0 + 0.5 * len(classes), 0.8 + 0.5 * len(classes)))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    if len(classes) <= 20:
        for i in range(len(classes)):
            for j in range(len(classes)):
                ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if norm[i, j] > 0.5 else "black")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(classes)), classes, fontsize=7)
    ax.set_xlabel("predicted class"), ax.set_ylabel("true class")
    ax.set_title(f"{algorithm} — held-out {domain}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, label="row-normalized")
    return _save(fig, path)
