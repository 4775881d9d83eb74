"""The data behind the figures: augmentation previews, encoder representations for t-SNE, CAMs."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedccrl_core.augment import AugmentConfig, ccdt, fedccrl_augment
from fedccrl_core.statistics import denormalize, normalize_u8
from fedccrl_core.viz.gradcam import grad_cam


def _to_u8(x_norm: torch.Tensor, mean, std) -> np.ndarray:
    x01 = denormalize(x_norm, mean, std).clamp(0, 1)
    return (x01.permute(0, 2, 3, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)


def augmentation_views(images_u8: np.ndarray, pool_mu: np.ndarray, pool_sigma: np.ndarray, cfg: AugmentConfig,
                       seed: int, mean, std) -> dict[str, np.ndarray]:
    """original | CCDT with F_pool^i | the same CCDT output then DIFP (Fig. 3: (c) is made from (b))."""
    g = torch.Generator().manual_seed(seed)
    x = normalize_u8(torch.from_numpy(np.ascontiguousarray(images_u8)), mean, std)
    mu, sigma = torch.as_tensor(pool_mu), torch.as_tensor(pool_sigma)
    x_ccdt = ccdt(x, mu, sigma, cfg.alpha, g, unbiased=cfg.mixstyle_var == "unbiased", pool_draw=cfg.pool_draw)
    difp_only = dataclasses.replace(cfg, ccdt=False, difp=True)
    x_both = fedccrl_augment(x_ccdt, None, None, difp_only, g, mean, std)
    return {"original": np.asarray(images_u8), "ccdt": _to_u8(x_ccdt, mean, std), "ccdt_difp": _to_u8(x_both, mean, std)}


@torch.no_grad()
def representations(model, images_u8: np.ndarray, mean, std, batch_size: int = 256) -> np.ndarray:
    """h(x) for every image: one row per image, [n, V] float32 (the t-SNE input)."""
    if len(images_u8) == 0:
        raise ValueError("representations: no images")
    model.eval()
    x = torch.from_numpy(np.ascontiguousarray(images_u8))
    out = [model.h(normalize_u8(x[i:i + batch_size], mean, std)).float() for i in range(0, len(x), batch_size)]
    return torch.cat(out).numpy()


def tsne_2d(features: np.ndarray, seed: int) -> np.ndarray:
    from sklearn.manifold import TSNE

    perplexity = float(min(30, max(2, (len(features) - 1) // 3)))
    return TSNE(n_components=2, init="pca", random_state=seed, perplexity=perplexity,
                max_iter=500).fit_transform(features)


def cams(model, images_u8: np.ndarray, mean, std) -> tuple[np.ndarray, np.ndarray]:
    x = normalize_u8(torch.from_numpy(np.ascontiguousarray(images_u8)), mean, std)
    cam, pred = grad_cam(model, x)
    return cam.numpy(), pred.numpy()
