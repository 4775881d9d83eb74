"""The pipeline's figures. Each function takes plain arrays and writes one PNG; titles, axis labels,
class legends, and the domain and algorithm on each panel. Deterministic given the inputs and seed.

Floor 4 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PatchCollection
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from fedccrl_core.foundation.fsio import atomic_file

if TYPE_CHECKING:
    from fedccrl_core.viz.compute import AugmentationViews  # torch: only its type here

CMAP = plt.get_cmap("tab10")
GAP = 6  # white pixels between the small images of a mosaic (Fig. 3, 7)


def mosaic(tiles: np.ndarray, gap: int = GAP) -> np.ndarray:
    """One image from a grid of equal images: tiles [rows, cols, H, W, C] (uint8) -> [rows*H + (rows-1)*gap,
    cols*W + (cols-1)*gap, C], white between tiles. Tile (r, c) starts at (r*(H+gap), c*(W+gap)). One imshow per
    grid instead of one Axes per image: the grids of Fig. 3 and 7 drew 240 Axes."""
    rows, cols, h, w, c = tiles.shape
    out = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, c), 255, dtype=tiles.dtype)
    for r in range(rows):
        for k in range(cols):
            out[r * (h + gap) : r * (h + gap) + h, k * (w + gap) : k * (w + gap) + w] = tiles[r, k]
    return out


def _show_mosaic(ax, tiles: np.ndarray, gap: int = GAP) -> None:
    """imshow of mosaic(tiles) with a thin black frame round each tile (as each image's Axes had) and no ticks."""
    rows, cols, h, w = tiles.shape[:4]
    ax.imshow(mosaic(tiles, gap))
    frames = [Rectangle((k * (w + gap) - 0.5, r * (h + gap) - 0.5), w, h) for r in range(rows) for k in range(cols)]
    ax.add_collection(PatchCollection(frames, facecolor="none", edgecolor="black", linewidth=0.8, clip_on=False))
    ax.set_xticks([]), ax.set_yticks([])
    for s in ax.spines.values():
        s.set_visible(False)


def _save(fig, path: Path) -> Path:
    """Lay the figure out once with its layout engine, then draw it once. savefig with an engine set draws
    twice (a dry draw first) and lays out at each draw; bbox_inches="tight" adds another draw to measure the ink."""
    path = Path(path)
    try:
        engine = fig.get_layout_engine()
        if engine is not None:
            engine.execute(fig)
            fig.set_layout_engine(None)  # the positions stay; savefig then draws once
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110, metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def augmentation_preview(rows: list[AugmentationViews], path: Path) -> Path:
    """Fig. 3 per client: originals | CCDT (pool statistics of other clients) | CCDT then DIFP.
    One Axes per view: a mosaic of every client's images (one client per row, named on the left)."""
    n, h, w = rows[0].original.shape[:3]
    views = (
        ("original", [row.original for row in rows]),
        ("CCDT (MixStyle, other clients' pool)", [row.ccdt for row in rows]),
        ("CCDT + DIFP (AugMix)", [row.ccdt_difp for row in rows]),
    )
    tall = (len(rows) * (h + GAP) - GAP) / (n * (w + GAP) - GAP)  # a view's mosaic: height / width
    fig, axes = plt.subplots(1, 3, figsize=(1.1 * 3 * n, 1.1 * n * tall + 0.7), layout="tight")
    for ax, (title, images) in zip(axes, views):
        _show_mosaic(ax, np.stack(images))
        ax.set_title(title, fontsize=8, loc="left")
    centres = [r * (h + GAP) + (h - 1) / 2 for r in range(len(rows))]
    axes[0].set_yticks(centres, [row.client for row in rows], fontsize=8, rotation=90, va="center")
    axes[0].tick_params(axis="y", length=0)
    fig.suptitle("FedCCRL feature augmentation per client (Fig. 3)", fontsize=10)
    return _save(fig, path)


def round_curves(domain: str, series: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> Path:
    """Per-round curves for one held-out domain. series: {metric: {algorithm: [(round, value)]}}."""
    metrics = list(series)
    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    w, h = 3.6 * ncols, 2.9 * nrows
    fig, axes = plt.subplots(nrows, ncols, figsize=(w, h), squeeze=False)
    # fixed margins in inches, room for y tick labels of 7 characters, the axis labels and the titles: a tight
    # layout measured every tick label of the 6 panels twice, half of this figure's time
    left, right, bottom, top, wgap, hgap = 0.95, 0.15, 0.6, 0.35, 1.05, 0.85
    aw, ah = (w - left - right - (ncols - 1) * wgap) / ncols, (h - bottom - top - (nrows - 1) * hgap) / nrows
    fig.subplots_adjust(
        left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h, wspace=wgap / aw, hspace=hgap / ah
    )
    for ax in axes.flat[len(metrics) :]:
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
    return _save(fig, path)


def tsne_panels(domain: str, panels: dict[str, tuple[np.ndarray, np.ndarray]], classes: list[str], path: Path) -> Path:
    """Fig. 5: t-SNE of h(x) on the held-out domain, one panel per algorithm. panels: {alg: (xy [n,2], y [n])}."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False, layout="tight")
    for ax, (alg, (xy, y)) in zip(axes[0], panels.items()):
        for c, name in enumerate(classes):
            m = y == c
            ax.scatter(xy[m, 0], xy[m, 1], s=6, color=CMAP(c % 10), label=name)
        ax.set_title(f"{alg} — held-out {domain}", fontsize=9)
        ax.set_xlabel("t-SNE 1"), ax.set_ylabel("t-SNE 2")
        ax.set_xticks([]), ax.set_yticks([])
    axes[0, -1].legend(fontsize=7, markerscale=2, loc="center left", bbox_to_anchor=(1, 0.5), title="class")
    return _save(fig, path)


def gradcam_grid(
    domain: str,
    images: np.ndarray,
    cams: dict[str, tuple[np.ndarray, np.ndarray]],
    classes: list[str],
    labels: np.ndarray,
    path: Path,
) -> Path:
    """Fig. 7: Grad-CAM overlays, one row per algorithm. cams: {alg: (cam [n,H,W] in [0,1], pred [n])}.
    One Axes per row: a mosaic of the images (top row) or of the overlays, each image's label above it."""
    n, h, w = images.shape[:3]
    jet = plt.get_cmap("jet")
    fig, axes = plt.subplots(len(cams) + 1, 1, figsize=(1.4 * n, 1.5 * (len(cams) + 1)), squeeze=False, layout="tight")
    rows = [("image (true class)", images, [classes[c] for c in labels])]
    for alg, (cam, pred) in cams.items():
        # the heat map at alpha 0.45 over the image, blended here (as imshow(image); imshow(cam, alpha=0.45) did)
        heat = jet(np.clip(cam, 0, 1))[..., :3]
        over = (0.55 * images / 255.0 + 0.45 * heat) * 255 + 0.5
        rows.append((alg, over.astype(np.uint8), [f"pred {classes[p]}" for p in pred]))
    for ax, (name, tiles, titles) in zip(axes[:, 0], rows):
        _show_mosaic(ax, tiles[None])
        for i, t in enumerate(titles):
            ax.text(i * (w + GAP) + (w - 1) / 2, -0.5 - 0.06 * h, t, fontsize=7, ha="center", va="bottom")
        ax.set_ylabel(name, fontsize=8)
    fig.suptitle(f"Grad-CAM on held-out {domain} (Fig. 7)", fontsize=10)
    return _save(fig, path)


def confusion(domain: str, algorithm: str, cm: np.ndarray, classes: list[str], path: Path) -> Path:
    cm = np.asarray(cm)
    norm = cm / np.clip(cm.sum(1, keepdims=True), 1, None)
    w, h = 1.0 + 0.5 * len(classes), 0.8 + 0.5 * len(classes)
    fig, ax = plt.subplots(figsize=(w, h))
    # margins in inches from the longest class name (7 pt tick labels, the x ones at 45 degrees), not measured
    # from every text of the figure by a tight layout; the colorbar and its label on the right
    r = fig.canvas.get_renderer()  # type: ignore[attr-defined]  # the Agg canvas (fedccrl_core.viz sets Agg) has it; the base class does not declare it
    name = max(r.get_text_width_height_descent(c, FontProperties(size=7), ismath=False)[0] for c in classes) / fig.dpi
    left, bottom, top, right = name + 0.45, 0.71 * name + 0.5, 0.35, 0.8
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    if len(classes) <= 20:
        for i in range(len(classes)):
            for j in range(len(classes)):
                ax.text(
                    j,
                    i,
                    str(int(cm[i, j])),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if norm[i, j] > 0.5 else "black",
                )
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(classes)), classes, fontsize=7)
    ax.set_xlabel("predicted class"), ax.set_ylabel("true class")
    ax.set_title(f"{algorithm} — held-out {domain}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, label="row-normalized")
    return _save(fig, path)
