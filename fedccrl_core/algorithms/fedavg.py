"""FedAvg (McMahan et al., 2017): local cross-entropy training, aggregation weighted by n_i (Eq. 2).

Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.fedavg import FedAvgParams
from fedccrl_core.algorithms.base import Algorithm, cross_entropy_step
from fedccrl_core.foundation.hparams import HParams


class FedAvg(Algorithm):
    name = "fedavg"
    Params: type[HParams] = FedAvgParams  # HParams: FedOMG on FedAvg's clients has its own
    pads_partial_batch = True  # its loss reads ctx.real_rows only (learning/static_batch.py)

    def train_step(self, model, x, y, ctx):
        return cross_entropy_step(model, x, y, ctx.real_rows)
