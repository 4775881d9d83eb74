"""Static batch shapes: the last, partial minibatch of an epoch padded to the full batch size B under a row mask.

The reference FedCCRL code trains every minibatch, the last partial one too (a DataLoader without drop_last), so the
partial batch is padded, not dropped. With every step the same shape, cuDNN autotunes each shape once per process,
whatever the client or round (fastpath.static_batches says where this is on). The padding must not change what the
step computes:
  * `pad_rows`: the batch's indices, extended to B by repeating its own rows (finite, in-distribution inputs);
  * `real_rows_only`: every BatchNorm layer in train mode takes its batch statistics from the real rows only, and
    updates its running statistics from them, as the unpadded batch would. The padded rows are normalized with the
    same statistics, so they stay on the real rows' scale;
  * the algorithm takes its loss on the real rows only (`StepContext.real_rows`, algorithms/base.py), so no gradient
    comes from a padded row.
A padded step then equals the unpadded one up to the order of floating-point sums (tests/test_static_batch.py). An
input of k * B rows (FedCCRL's three views in one pass, Eq. 4) has k blocks, each with its first `real` rows real.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def pad_rows(idx: torch.Tensor, size: int) -> torch.Tensor:
    """idx (r >= 1 indices) extended to `size` by repeating its rows in turn; no host sync (r is the shape)."""
    r = idx.numel()
    if r >= size:
        return idx
    return idx[torch.arange(size, device=idx.device) % r]


def real_row_index(n_rows: int, real: int, block: int, device) -> torch.Tensor:
    """The real rows of an input of n_rows = k * block rows: the first `real` of each block."""
    if n_rows % block:
        raise ValueError(f"a padded batch has a multiple of {block} rows, got {n_rows}")
    starts = torch.arange(0, n_rows, block, device=device)
    return (starts[:, None] + torch.arange(real, device=device)[None, :]).reshape(-1)


def _masked_batch_norm(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """BatchNorm in train mode with the statistics of x's `rows` (float32), applied to every row; the running
    statistics updated as torch's BatchNorm does (momentum, or the cumulative average when momentum is None; the
    running variance unbiased)."""
    dims = [0, *range(2, x.dim())]
    real = x.index_select(0, rows).float()
    var, mean = torch.var_mean(real, dim=dims, unbiased=False)
    if bn.track_running_stats and bn.running_mean is not None:
        assert bn.running_var is not None and bn.num_batches_tracked is not None  # kept with running_mean
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = bn.momentum if bn.momentum is not None else 1.0 / bn.num_batches_tracked
            count = real.numel() // real.shape[1]
            bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), factor)
            bn.running_var.lerp_((var * (count / max(count - 1, 1))).to(bn.running_var.dtype), factor)
    shape = (1, -1, *([1] * (x.dim() - 2)))
    y = (x.float() - mean.view(shape)) * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.float().view(shape) + bn.bias.float().view(shape)
    return y.to(x.dtype)


@contextlib.contextmanager
def real_rows_only(model: nn.Module, real: int, block: int):
    """Within: every BatchNorm layer of `model` in train mode normalizes with the statistics of the first `real`
    rows of each `block` rows of its input (module docstring). A no-op when real == block. Each layer's forward is
    replaced on the instance for the duration, and restored after."""
    if real >= block:
        yield
        return
    replaced = []

    def masked_forward(bn):
        plain = bn.forward

        def forward(x):
            if not bn.training:
                return plain(x)
            return _masked_batch_norm(bn, x, real_row_index(x.shape[0], real, block, x.device))

        return forward

    try:
        for m in model.modules():
            if type(m) in BATCH_NORMS and "forward" not in vars(m):  # a subclass has its own forward: untouched
                m.forward = masked_forward(m)
                replaced.append(m)
        yield
    finally:
        for m in replaced:
            del m.forward


def real_part(t: torch.Tensor, real: int | None) -> torch.Tensor:
    """The first `real` rows of a model output or label tensor (all of them when real is None)."""
    return t if real is None else t[:real]
