"""Grad-CAM (Selvaraju et al., ICCV 2017) on the last convolution of the encoder h, as in FedCCRL Fig. 7.

L^c = ReLU(sum_k alpha_k^c A^k), alpha_k^c = 1/Z sum_{i,j} dy^c / dA^k_{ij}; upsampled to the input size and
normalized to [0, 1] per image (an all-zero map stays zero).


Floor 4 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def last_conv(module: nn.Module) -> nn.Conv2d:
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError("Grad-CAM: the encoder has no Conv2d layer")
    return convs[-1]


def grad_cam(model, x: torch.Tensor, target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CAMs [B, H, W] in [0, 1] for class `target` (default: the predicted class), and the predictions."""
    layer = last_conv(model.h)
    store: dict[str, torch.Tensor] = {}
    h1 = layer.register_forward_hook(lambda m, i, o: store.__setitem__("A", o))
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            logits = model(x)
            pred = logits.argmax(1)
            cls = pred if target is None else target
            score = logits.gather(1, cls.view(-1, 1)).sum()
            grads = torch.autograd.grad(score, store["A"])[0]
    finally:
        h1.remove()
        model.train(was_training)
    alpha = grads.mean(dim=(2, 3), keepdim=True)
    cam = F.relu((alpha * store["A"]).sum(1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False).squeeze(1)
    peak = cam.flatten(1).max(1).values.clamp(min=1e-12).view(-1, 1, 1)
    cam = torch.where(peak > 1e-12, cam / peak, torch.zeros_like(cam))
    return cam.detach(), pred.detach()
