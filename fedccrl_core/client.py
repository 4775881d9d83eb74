"""What one client holds: its data (never leaves it) and the state that persists across rounds."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ClientData:
    """A client's shard, resident on the training device as uint8 NCHW (decoded once, DESIGN 'Speed')."""

    client_id: str
    domain: str
    train_x: torch.Tensor  # uint8 [n, 3, S, S]
    train_y: torch.Tensor  # int64 [n]
    val_x: torch.Tensor
    val_y: torch.Tensor
    stats_mu: np.ndarray | None = None  # per-training-sample channel statistics (Eq. 6-7), from the pools stage
    stats_sigma: np.ndarray | None = None

    @property
    def n_train(self) -> int:
        return int(self.train_y.shape[0])

    @classmethod
    def from_numpy(cls, client_id, domain, train_x, train_y, val_x, val_y, device, stats_mu=None, stats_sigma=None):
        def images(a):  # NHWC uint8 -> NCHW uint8 on device
            return torch.from_numpy(np.ascontiguousarray(a)).permute(0, 3, 1, 2).contiguous().to(device)

        def labels(a):
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

        return cls(client_id, domain, images(train_x), labels(train_y), images(val_x), labels(val_y),
                   stats_mu, stats_sigma)


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
    def from_dict(cls, d: dict) -> "ClientState":
        return cls(d.get("optimizer"), d.get("scheduler"), d.get("extra") or {})
