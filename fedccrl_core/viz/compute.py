"""The data behind the figures: augmentation previews, encoder representations for t-SNE, CAMs.

Floor 4 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedccrl_core.augment.ccdt import ccdt
from fedccrl_core.augment.compose import fedccrl_augment
from fedccrl_core.augment.settings import AugmentParams
from fedccrl_core.learning.statistics import denormalize, normalize_u8
from fedccrl_core.viz.gradcam import grad_cam


def _to_u8(x_norm: torch.Tensor, mean, std) -> np.ndarray:
    x01 = denormalize(x_norm, mean, std).clamp(0, 1)
    return (x01.permute(0, 2, 3, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)


@dataclass(frozen=True)
class AugmentationViews:
    """One client's row of FedCCRL Fig. 3 (fedccrl_core/viz/figures.py `augmentation_preview`): the same images as
    uint8 [n, H, W, 3], three times."""

    client: str
    original: np.ndarray
    ccdt: np.ndarray  # CCDT with F_pool^i (Alg. 2)
    ccdt_difp: np.ndarray  # that CCDT output, then DIFP (Alg. 3)


def augmentation_views(
    client: str,
    images_u8: np.ndarray,
    pool_mu: np.ndarray,
    pool_sigma: np.ndarray,
    cfg: AugmentParams,
    seed: int,
    mean,
    std,
) -> AugmentationViews:
    """original | CCDT with F_pool^i | the same CCDT output then DIFP (Fig. 3: (c) is made from (b))."""
    g = torch.Generator().manual_seed(seed)
    x = normalize_u8(torch.from_numpy(np.ascontiguousarray(images_u8)), mean, std)
    mu, sigma = torch.as_tensor(pool_mu), torch.as_tensor(pool_sigma)
    x_ccdt = ccdt(
        x,
        mu,
        sigma,
        cfg.alpha,
        g,
        unbiased=cfg.reading("mixstyle_var") == "unbiased",
        pool_draw=cfg.reading("pool_draw"),
    )
    difp_only = cfg.model_copy(update={"ccdt": False, "difp": True})
    x_both = fedccrl_augment(x_ccdt, None, None, difp_only, g, mean, std)
    return AugmentationViews(client, np.asarray(images_u8), _to_u8(x_ccdt, mean, std), _to_u8(x_both, mean, std))


@torch.no_grad()
def representations(model, images_u8: np.ndarray, mean, std, batch_size: int = 256) -> np.ndarray:
    """h(x) for every image: one row per image, [n, V] float32 (the t-SNE input)."""
    if len(images_u8) == 0:
        raise ValueError("representations: no images")
    model.eval()
    x = torch.from_numpy(np.ascontiguousarray(images_u8))
    out = [model.h(normalize_u8(x[i : i + batch_size], mean, std)).float() for i in range(0, len(x), batch_size)]
    return torch.cat(out).numpy()


def cams(model, images_u8: np.ndarray, mean, std) -> tuple[np.ndarray, np.ndarray]:
    x = normalize_u8(torch.from_numpy(np.ascontiguousarray(images_u8)), mean, std)
    cam, pred = grad_cam(model, x)
    return cam.numpy(), pred.numpy()


def preview_rows(shards, pools, fedccrl_hp, seed: int, n_preview: int, mean, std) -> list[AugmentationViews]:
    """FedCCRL Fig. 3 for every client: `n_preview` of its training images, CCDT with the pool of the other
    clients' uploads F_j (Eq. 8, drawn here as the server would hold them), then DIFP."""
    from fedccrl_core.algorithms.fedccrl import pool_without
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.pools import load_pool, sample_statistics
    from fedccrl_core.data.shards import load_client

    rng = np.random.default_rng(seed)
    ids = [c.id for c in load_manifest(shards).clients]
    uploads = {}
    for cid in ids:
        mu, sigma = load_pool(pools, cid)
        f_mu, f_sigma = sample_statistics(mu, sigma, fedccrl_hp.r, rng)  # Eq. 8
        uploads[cid] = {"mu": f_mu, "sigma": f_sigma}
    aug = fedccrl_hp  # resolved: its switches hold the variant's readings
    rows = []
    for j, cid in enumerate(ids):
        shard = load_client(shards, cid)
        pick = np.sort(rng.choice(len(shard.train_y), size=min(n_preview, len(shard.train_y)), replace=False))
        pmu, psig = pool_without(uploads, cid)
        rows.append(augmentation_views(cid, shard.train_x[pick], pmu, psig, aug, seed + j, mean, std))
    return rows


def model_features(
    models: dict, x: np.ndarray, y: np.ndarray, pick: np.ndarray, n_cam: int, mean, std
) -> tuple[dict, dict]:
    """For each {algorithm: model file}: h(x) of the picked held-out images and their labels (the t-SNE input of
    FedCCRL Fig. 5, embedded by tsne_2d) and the Grad-CAMs of the first n_cam of them (Fig. 7)."""
    from fedccrl_core.algorithms import load_model

    feats, cam_maps = {}, {}
    for alg, path in models.items():
        model, _ = load_model(path)
        feats[alg] = (representations(model, x[pick], mean, std), y[pick])
        cam_maps[alg] = cams(model, x[pick[:n_cam]], mean, std)
    return feats, cam_maps
