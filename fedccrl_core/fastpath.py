"""The device switches of the fast engine path (DESIGN 'Speed'), params.yaml `train.fast`.

With `train.fast: true` (the default) and a CUDA device:
  * bf16 autocast around every training step (`Algorithm.local_train_steps`) and every evaluation
    forward (`evaluation.predict`); bf16 needs no loss scaling. Losses that need float32 upcast
    themselves (`losses.supcon_loss` turns autocast off for its similarity matrix);
  * channels_last model weights (cuDNN then runs NHWC kernels; inputs stay NCHW, the first
    convolution converts them, so the augmentation code never sees channels_last tensors);
  * cuDNN autotuning (`torch.backends.cudnn.benchmark`).
On the CPU every switch is a no-op, so CPU results are bit-identical with `train.fast` on or off
(tests/test_bench.py pins this). The rest of the fast path needs no switch: shards resident on the
device as uint8 (`federation.client.ClientData`), CCDT and per-sample AugMix vectorized on the device
(`augment/`), no per-step host syncs, large evaluation batches (`evaluate.batch_size`) and several
clients interleaved on CUDA streams (`federation.concurrent`).
"""
from __future__ import annotations

import contextlib

import torch


def enabled(fast: bool, device: torch.device | str) -> bool:
    """Whether the fast-path switches apply: `train.fast` on and a CUDA device."""
    return bool(fast) and torch.device(device).type == "cuda"


def autocast(on: bool, device: torch.device | str):
    """bf16 autocast on `device` when `on`, else a no-op context."""
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def prepare_model(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    """channels_last weights and cuDNN autotuning when `on` (in place; the Parameter objects are kept,
    so an optimizer built before or after sees the same tensors)."""
    if on:
        model.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True
    return model


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> device. On CUDA through pinned memory with non_blocking=True: a copy from pageable
    memory would block the host until the stream reaches it (a host sync)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
