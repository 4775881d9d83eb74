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


def pooled_accuracy(correct: int, n: int) -> float:
    """Σ correct / Σ n of evaluation counts (federated evaluation: each site counts on its own images) as the
    float32 mean `accuracy` takes over the pooled images: the count of 0/1 values is exact in float32 below 2^24
    and the one float32 division is correctly rounded, so the two agree bit for bit (tests/test_site_eval.py)."""
    if n == 0:
        return float("nan")
    if not 0 <= correct <= n < 2**24:
        raise ValueError(f"evaluation counts: {correct} correct of {n} images")
    return float(torch.tensor(correct, dtype=torch.float32) / torch.tensor(n, dtype=torch.float32))


@torch.no_grad()
def class_counts(
    model, x_u8, y, num_classes: int, batch_size=256, mean=IMAGENET_MEAN, std=IMAGENET_STD, fast: bool = False
) -> tuple[list[int], list[int]]:
    """Per class k: (images of class k predicted correctly, images predicted as k) on (x_u8, y); with y's own
    class histogram these are what a site returns for evaluation (fedccrl_flower/evalsets.py)."""
    pred = predict(model, x_u8, batch_size, mean, std, fast)
    right = torch.bincount(y[pred == y], minlength=num_classes)
    predicted = torch.bincount(pred, minlength=num_classes)
    return [int(v) for v in right.tolist()], [int(v) for v in predicted.tolist()]
