"""train.fedavg: FedAvg's (empty) hyperparameters; the algorithm is fedccrl_core/algorithms/fedavg.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.foundation.hparams import HParams


class FedAvgParams(HParams):
    """train.fedavg: FedAvg has no hyperparameters (the empty group keeps dvc.yaml's train.${item.algorithm}
    resolvable)."""
