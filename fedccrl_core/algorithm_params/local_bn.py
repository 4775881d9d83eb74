"""train.fedbn, train.silobn: the FedFD-A paper's SGD setting (section 4.1) for its local-BN baselines, the
base of train.fedfd; the algorithms are fedccrl_core/algorithms/local_bn.py, fedbn.py and silobn.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal

from fedccrl_core.foundation.hparams import HParams, hp


class LocalBNParams(HParams):
    """The FedFD-A paper's optimizer (section 4.1), used for FedFD-A and, as the paper does, for its FedBN
    and SiloBN baselines (train.fedbn, train.silobn; also in train.fedfd, train.fedfd_a)."""

    optimizer: Literal["sgd", "train"] = hp(
        "sgd",
        "sgd: fedfd-a.txt section 4.1 (its baselines too); train: the "
        "project-wide Adam with train.lr, weight_decay, lr_schedule",
    )
    lr: float = hp(0.01, "SGD, fixed learning rate (fedfd-a.txt section 4.1)", gt=0)
    momentum: float = hp(0.5, "SGD momentum (fedfd-a.txt section 4.1)", ge=0, lt=1)
    weight_decay: float = hp(0.0, "our choice: section 4.1 names no weight decay", ge=0)
    batch_size: int | None = hp(
        64,
        "fedfd-a.txt section 4.1; replaces train.batch_size (null = train.batch_size); "
        ">= 2: BatchNorm needs two samples per batch",
        ge=2,
    )


class FedBNParams(LocalBNParams):
    """train.fedbn."""


class SiloBNParams(LocalBNParams):
    """train.silobn."""
