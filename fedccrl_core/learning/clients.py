"""What one client holds: its data (never leaves it) and the state that persists across rounds.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch


def _images(a: np.ndarray, device) -> torch.Tensor:
    """NHWC uint8 (an array or a read-only memory-mapped shard) -> NCHW uint8 on `device`, one copy."""
    out = np.empty((a.shape[0], a.shape[3], a.shape[1], a.shape[2]), dtype=a.dtype)
    np.copyto(out, np.asarray(a).transpose(0, 3, 1, 2))
    return torch.from_numpy(out).to(device)


@dataclass
class ClientData:
    """A client's shard as uint8 NCHW on the training device (decoded once, DESIGN 'Speed').

    Lazy, so that a federation's memory does not grow with its clients: `train_x` is None and `train_source` is the shard's training images, uint8 NHWC,
    memory-mapped from the shard file (data/shards.py `load_client(mmap=True)`); `resident()` copies
    them to the device for one client's turn (uploads or local training), so only the sampled clients'
    pages are read and at most the clients training at once are in memory. Labels, validation split and
    statistics are small and always resident."""

    client_id: str
    domain: str
    train_x: torch.Tensor | None  # uint8 [n, 3, S, S]; None while lazy
    train_y: torch.Tensor  # int64 [n]
    val_x: torch.Tensor
    val_y: torch.Tensor
    stats_mu: np.ndarray | None = None  # per-training-sample channel statistics (Eq. 6-7), from the pools stage
    stats_sigma: np.ndarray | None = None
    train_source: np.ndarray | None = None  # uint8 [n, S, S, 3] (np.memmap) while lazy
    device: torch.device | str | None = None  # where `resident()` puts train_x

    @property
    def n_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def image_hw(self) -> tuple[int, int]:
        """(H, W) of the training images, without reading them."""
        if self.train_x is not None:
            return int(self.train_x.shape[2]), int(self.train_x.shape[3])
        assert self.train_source is not None  # lazy: train_x is None, the shard's images are here
        return int(self.train_source.shape[1]), int(self.train_source.shape[2])

    def resident(self) -> ClientData:
        """This client with its training images on the device (itself when they already are)."""
        if self.train_x is not None:
            return self
        assert self.train_source is not None  # lazy: train_x is None, the shard's images are here
        return dataclasses.replace(self, train_x=_images(self.train_source, self.device), train_source=None)

    @classmethod
    def from_numpy(
        cls,
        client_id,
        domain,
        train_x,
        train_y,
        val_x,
        val_y,
        device,
        stats_mu=None,
        stats_sigma=None,
        lazy: bool = False,
    ):
        """`lazy`: keep `train_x` (a memory-mapped NHWC array) where it is until `resident()`."""

        def labels(a):
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

        if lazy:
            return cls(
                client_id,
                domain,
                None,
                labels(train_y),
                _images(val_x, device),
                labels(val_y),
                stats_mu,
                stats_sigma,
                train_source=train_x,
                device=device,
            )
        return cls(
            client_id,
            domain,
            _images(train_x, device),
            labels(train_y),
            _images(val_x, device),
            labels(val_y),
            stats_mu,
            stats_sigma,
        )


@dataclass
class ClientState:
    """Per-client state kept across rounds: the optimizer and LR schedule (reference implementation
    default), and `extra` for algorithms that keep something local (e.g. FedBN's BN layers)."""

    optimizer: dict | None = None
    scheduler: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"optimizer": self.optimizer, "scheduler": self.scheduler, "extra": self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> ClientState:
        return cls(d.get("optimizer"), d.get("scheduler"), d.get("extra") or {})
