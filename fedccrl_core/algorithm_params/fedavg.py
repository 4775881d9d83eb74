"""train.fedavg: FedAvg's (empty) hyperparameters; the algorithm is fedccrl_core/algorithms/fedavg.py.
"""
from __future__ import annotations

from fedccrl_core.hparams import HParams


class FedAvgParams(HParams):
    """train.fedavg: FedAvg has no hyperparameters (the empty group keeps dvc.yaml's train.${item.algorithm}
    resolvable)."""
