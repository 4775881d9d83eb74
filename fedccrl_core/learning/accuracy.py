"""Accuracy of a model on uint8 images, in large batches (no per-batch host sync).

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import torch

from fedccrl_core.foundation import fastpath
from fedccrl_core.learning.static_batch import pad_rows
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD, normalize_u8


@torch.no_grad()
def predict(
    model, x_u8: torch.Tensor, batch_size: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD, fast: bool = False
) -> torch.Tensor:
    """Predicted class of every image (x_u8: uint8 NCHW on the model's device). fast: channels_last
    weights, plus bf16 autocast on CUDA (train.fast, fastpath.py)."""
    was_training = model.training
    model.eval()
    on = fastpath.enabled(fast, x_u8.device)
    static = fastpath.static_batches(fast, x_u8.device) and len(x_u8) > batch_size
    fastpath.prepare_model(model, fast)
    with fastpath.autocast(on, x_u8.device):
        preds = []
        for i in range(0, len(x_u8), batch_size):
            batch = x_u8[i : i + batch_size]
            real = len(batch)
            if static and real < batch_size:  # the last batch padded to the batch's shape (eval mode: per row)
                batch = batch[pad_rows(torch.arange(real, device=batch.device), batch_size)]
            preds.append(model(normalize_u8(batch, mean, std))[:real].argmax(1))
    model.train(was_training)
    if not preds:
        return torch.empty(0, dtype=torch.long, device=x_u8.device)
    return torch.cat(preds)


def accuracy(model, x_u8, y, batch_size=256, mean=IMAGENET_MEAN, std=IMAGENET_STD, fast: bool = False) -> float:
    if len(y) == 0:
        return float("nan")
    return float((predict(model, x_u8, batch_size, mean, std, fast) == y).float().mean())
