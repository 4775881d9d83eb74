"""Static batch shapes: the last, partial minibatch of an epoch padded to the full batch size B under a row mask.

The reference FedCCRL code trains every minibatch, the last partial one too (a DataLoader without drop_last), so the
partial batch is padded, not dropped. With every step the same shape, cuDNN autotunes each shape once per process,
whatever the client or round (fastpath.static_batches says where this is on). The padding must not change what the
step computes:
  * `pad_rows`: the batch's indices, extended to B by repeating its own rows (finite, in-distribution inputs);
  * `real_rows_only`: every BatchNorm layer in train mode runs on the real rows only (torch's forward hooks: its
    own forward, given the real rows), so it takes its batch statistics from them and updates its running
    statistics as the unpadded batch would. Each padded row leaves the layer as a copy of the real row it
    stands for, so it stays finite and on the real rows' scale;
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


def _first_of_each_block(real: int, block: int, k: int, device) -> torch.Tensor:
    """For each of k * block rows, the position in the k * real real rows of the real row it repeats: row j of
    block b is real row (j mod real) of b."""
    starts = torch.arange(0, k * real, real, device=device)
    return (starts[:, None] + (torch.arange(block, device=device) % real)[None, :]).reshape(-1)


class _RealRowsOnly:
    """The pair of hooks that mask one BatchNorm layer in train mode (torch's public module hooks; the layer's own
    forward runs, on the real rows): the forward pre-hook hands it the real rows only, so it takes its statistics
    from them and updates its running statistics as on the unpadded batch; the forward hook gives each padded row
    the output of the real row it stands for, so every row leaves the layer on the real rows' scale and the
    output has the input's rows."""

    def __init__(self, real: int, block: int):
        self.real, self.block = real, block

    def real_rows_in(self, bn: nn.Module, args: tuple) -> tuple | None:
        if not bn.training:
            return None
        (x,) = args
        return (x[real_row_index(x.shape[0], self.real, self.block, x.device)],)  # indexing keeps channels_last

    def every_row_out(self, bn: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not bn.training:
            return None
        return out[_first_of_each_block(self.real, self.block, out.shape[0] // self.real, out.device)]


@contextlib.contextmanager
def real_rows_only(model: nn.Module, real: int, block: int):
    """Within: every BatchNorm layer of `model` in train mode normalizes with the statistics of the first `real`
    rows of each `block` rows of its input (module docstring). A no-op when real == block. Each of torch's own
    BatchNorm layers gets the hooks of _RealRowsOnly for the duration; they are removed after."""
    if real >= block:
        yield
        return
    mask, handles = _RealRowsOnly(real, block), []
    try:
        for m in model.modules():
            if type(m) in BATCH_NORMS:  # a subclass has its own statistics: untouched (Algorithm.pads_partial_batch)
                handles.append(m.register_forward_pre_hook(mask.real_rows_in))
                handles.append(m.register_forward_hook(mask.every_row_out))
        yield
    finally:
        for h in handles:
            h.remove()


def real_part(t: torch.Tensor, real: int | None) -> torch.Tensor:
    """The first `real` rows of a model output or label tensor (all of them when real is None)."""
    return t if real is None else t[:real]
