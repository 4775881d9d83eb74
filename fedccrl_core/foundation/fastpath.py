"""The device switches of the fast engine path (DESIGN 'Speed'), params.yaml `train.fast`.

With `train.fast: true` (the default):
  * channels_last model weights, on every device (cuDNN and oneDNN then run NHWC kernels; inputs
    stay NCHW, the first convolution converts them, so the augmentation code never sees
    channels_last tensors). On the CPU this made the small CNN's forward+backward 1.7-2.1x faster
    at 32 px (`fedccrl-bench speed --size 32 --threads 1`, row "channels_last"), and it is what lets CI
    run this branch of the fast path;
  * on CUDA only: bf16 autocast around every training step (`Algorithm.local_train_steps`) and
    every evaluation forward (`learning.accuracy.predict`); bf16 needs no loss scaling. Losses that need
    float32 upcast themselves (`losses.supcon_loss` turns autocast off for its similarity matrix).
    On the CPU bf16 is slower than float32 for these convolutions, so it stays off there;
  * on CUDA only: cuDNN autotuning (`torch.backends.cudnn.benchmark`), with static batch shapes: the last,
    partial minibatch of an epoch padded to the batch size under a row mask (`learning/static_batch.py`) for the
    algorithms that support it (`Algorithm.pads_partial_batch`), and the last evaluation batch padded to the
    evaluation batch size, so each shape is autotuned once per process, not once per client;
  * on CUDA only: Adam's fused implementation (one kernel for all parameters instead of a loop per tensor), and
    FedCCRL's two augmented views drawn in one call on [X; X] (`FedCCRL.views_in_one_draw`).
channels_last changes only the order of floating-point sums, so CPU results with `train.fast` on
and off agree to float32 rounding, not bit for bit (tests/test_bench.py pins the tolerance); each
setting is deterministic on its own. The rest of the fast path needs no switch: shards resident on the
device as uint8 (`learning.clients.ClientData`), CCDT and per-sample AugMix vectorized on the device
(`augment/`), no per-step host syncs, large evaluation batches (`evaluate.batch_size`) and several
clients interleaved on CUDA streams (`federation.concurrent`).


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def resolve_device(name: str, key: str = "params.yaml: train.device") -> torch.device:
    """A device setting (auto | cpu | cuda) as a torch device; `key` names the setting in the error (a bench: its
    --device option)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key} is 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"{key} must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


_cuda_code_everywhere = False  # set only inside `cuda_code_path()`


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """Inside it, every device runs the code the CUDA fast path runs: `enabled` and `static_batches` answer as on
    CUDA, and AugMix skips the CPU's compaction (`compacts`). For a bench that counts, on the CPU, the operators
    and host syncs of the accelerator's code (`fedccrl-bench dispatch --code-path cuda`); training never enters it."""
    global _cuda_code_everywhere
    before = _cuda_code_everywhere
    _cuda_code_everywhere = True
    try:
        yield
    finally:
        _cuda_code_everywhere = before


def runs_cuda_code(device: torch.device | str) -> bool:
    """Whether code on `device` takes the CUDA fast path's branches: a CUDA device, or any inside `cuda_code_path`."""
    return _cuda_code_everywhere or torch.device(device).type == "cuda"


def compacts(device: torch.device | str) -> bool:
    """Whether AugMix runs an operation family on its selected images only (augment/augmix_ops.py `_apply_family`):
    on the CPU, where reading the selection is free; not on an accelerator, where it is a host sync, nor inside
    `cuda_code_path`."""
    return torch.device(device).type == "cpu" and not _cuda_code_everywhere


def enabled(fast: bool, device: torch.device | str) -> bool:
    """Whether the CUDA-only switches (bf16 autocast, cuDNN autotuning) apply: `train.fast` on and a
    CUDA device. channels_last follows `train.fast` alone (`prepare_model(model, fast)`)."""
    return bool(fast) and runs_cuda_code(device)


def static_batches(fast: bool, device: torch.device | str) -> bool:
    """Whether training pads its last partial minibatch and evaluation its last batch to a fixed shape: the CUDA
    switches of `enabled`. On the CPU every batch keeps its own size, as before (nothing autotunes there)."""
    return enabled(fast, device)


def autocast(on: bool, device: torch.device | str):
    """bf16 autocast on `device` when `on`, else a no-op context."""
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def prepare_model(model: torch.nn.Module, fast: bool) -> torch.nn.Module:
    """channels_last weights when `fast` (any device), and cuDNN autotuning on CUDA (in place; the
    Parameter objects are kept, so an optimizer built before or after sees the same tensors)."""
    if fast:
        model.to(memory_format=torch.channels_last)
        if any(p.is_cuda for p in model.parameters()):
            torch.backends.cudnn.benchmark = True
    return model


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> device. On CUDA through pinned memory with non_blocking=True: a copy from pageable
    memory would block the host until the stream reaches it (a host sync)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
