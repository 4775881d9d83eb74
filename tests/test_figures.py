"""Figures: the data behind them has the right shapes and properties, and each PNG is readable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fedccrl_core.augment.settings import AugmentParams
from fedccrl_core.learning.models import build_model
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD
from fedccrl_core.viz import figures as fig
from fedccrl_core.viz.compute import AugmentationViews, augmentation_views, cams, representations
from fedccrl_core.viz.embed import tsne_2d

M, S = IMAGENET_MEAN, IMAGENET_STD


def _images(n, size=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def assert_readable_png(path, min_size=(200, 150)):
    img = Image.open(path)
    img.load()
    assert img.format == "PNG" and img.size[0] >= min_size[0] and img.size[1] >= min_size[1]
    a = np.asarray(img.convert("L"), dtype=np.float32)
    assert a.std() > 5, "blank image"  # real content, not a single colour
    assert (a < 250).mean() > 0.02  # something is drawn on the white background


def test_gradcam_maps_are_nonnegative_and_normalized():
    torch.manual_seed(0)
    model = build_model("small_cnn", 5)
    cam, pred = cams(model, _images(6), M, S)
    assert cam.shape == (6, 32, 32) and pred.shape == (6,)
    assert (cam >= 0).all() and (cam <= 1 + 1e-6).all()
    peaks = cam.reshape(6, -1).max(1)
    assert np.all((np.abs(peaks - 1) < 1e-5) | (peaks == 0))  # each map is scaled to a max of 1 (or all zero)


def test_tsne_input_has_one_row_per_image_and_output_is_2d():
    model = build_model("small_cnn", 5)
    feats = representations(model, _images(40), M, S, batch_size=16)
    assert feats.shape == (40, model.feature_dim) and feats.dtype == np.float32
    xy = tsne_2d(feats, seed=0)
    assert xy.shape == (40, 2) and np.isfinite(xy).all()
    assert np.allclose(xy, tsne_2d(feats, seed=0))  # deterministic given the seed


def test_augmentation_views_use_the_pool_and_keep_shapes():
    imgs = _images(8)
    sigma = np.full((5, 3), 0.2, np.float32)
    bright, dark = np.full((5, 3), 1.5, np.float32), np.full((5, 3), -1.5, np.float32)  # strong foreign styles
    v = augmentation_views("c0", imgs, bright, sigma, AugmentParams(alpha=0.1), seed=1, mean=M, std=S)
    assert v.client == "c0"
    for x in (v.original, v.ccdt, v.ccdt_difp):
        assert x.shape == imgs.shape and x.dtype == np.uint8
    assert np.array_equal(v.original, imgs)
    v2 = augmentation_views("c0", imgs, bright, sigma, AugmentParams(alpha=0.1), seed=1, mean=M, std=S)
    assert np.array_equal(v.ccdt, v2.ccdt) and np.array_equal(v.ccdt_difp, v2.ccdt_difp)  # deterministic given the seed
    # the pool sets the style: Eq. 9-10 mix each image's (mu, sigma) with a pool row, with the same lambda and row
    # for the same seed, so a brighter pool can only brighten each image, and does so on average
    d = augmentation_views("c0", imgs, dark, sigma, AugmentParams(alpha=0.1), seed=1, mean=M, std=S)
    per_image = (v.ccdt.astype(float) - d.ccdt.astype(float)).reshape(len(imgs), -1).mean(1)
    assert (per_image >= 0).all() and per_image.mean() > 20, per_image
    assert not np.array_equal(v.ccdt_difp, d.ccdt_difp)  # Fig. 3 (c) is made from (b)


def test_every_figure_kind_is_a_readable_png(tmp_path):
    classes = ["circle", "square", "star"]
    imgs = _images(4)
    rows = [AugmentationViews(f"c{i}", imgs, imgs[::-1], 255 - imgs) for i in range(2)]
    rng = np.random.default_rng(0)
    paths = [
        fig.augmentation_preview(rows, tmp_path / "aug.png"),
        fig.round_curves(
            "sketch",
            {
                "target_acc": {"fedccrl": [(1, 0.2), (2, 0.5)], "fedavg": [(1, 0.2), (2, 0.3)]},
                "l_ra": {"fedccrl": [(1, 3.0), (2, 2.0)]},
            },
            tmp_path / "curves.png",
        ),
        fig.tsne_panels(
            "sketch",
            {a: (rng.normal(size=(30, 2)), rng.integers(0, 3, 30)) for a in ("fedccrl", "fedavg")},
            classes,
            tmp_path / "tsne.png",
        ),
        fig.gradcam_grid(
            "sketch",
            imgs,
            {"fedccrl": (rng.random((4, 32, 32)), np.array([0, 1, 2, 0]))},
            classes,
            np.array([0, 1, 2, 1]),
            tmp_path / "cam.png",
        ),
        fig.confusion("sketch", "fedccrl", np.array([[5, 1, 0], [2, 3, 1], [0, 0, 6]]), classes, tmp_path / "cm.png"),
    ]
    for p in paths:
        assert_readable_png(p)


@pytest.mark.parametrize("bad", [np.zeros((0, 32, 32, 3), np.uint8)])
def test_representations_of_nothing_is_an_error(bad):
    with pytest.raises(ValueError, match="no images"):
        representations(build_model("small_cnn", 3), bad, M, S)


def test_mosaic_places_each_image_with_white_gaps():
    tiles = np.random.default_rng(0).integers(0, 200, (2, 3, 5, 4, 3), dtype=np.uint8)  # no white pixel in a tile
    m = fig.mosaic(tiles, gap=2)
    assert m.shape == (2 * 5 + 2, 3 * 4 + 2 * 2, 3) and m.dtype == np.uint8
    for r in range(2):
        for c in range(3):
            assert np.array_equal(
                m[r * 7 : r * 7 + 5, c * 6 : c * 6 + 4], tiles[r, c]
            )  # tile (r, c) is the input image
    assert (m[5:7] == 255).all() and (m[:, 4:6] == 255).all() and (m[:, 10:12] == 255).all()  # the gaps are white
    assert (m != 255).sum() == tiles.size  # nothing else
    assert np.array_equal(fig.mosaic(tiles[:1, :1], gap=2), tiles[0, 0])  # one image: itself
