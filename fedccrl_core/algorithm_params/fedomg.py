"""train.fedomg and train.fedccrl_omg: FedOMG's server-step hyperparameters (Nguyen et al., ICLR 2025, arXiv
2501.14653, Eq. 15-17); the algorithms are fedccrl_core/algorithms/fedomg.py, docs/algorithms/fedomg.md lists the
choices the paper leaves open and where the official code (skydvn/FedOMG) departs from it.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar

from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams
from fedccrl_core.foundation.hparams import HParams, hp


class FedOMGParams(HParams):
    """train.fedomg (Eq. 15-17): FedAvg's clients, FedOMG's server step."""

    dp_refusal: ClassVar[str] = (
        "FedOMG's server step (Eq. 15-17) combines the clients' updates by its own rule instead of Eq. 2; DP-FedAvg "
        "replaces Eq. 2 only"
    )

    kappa: float = hp(
        0.5,
        "Eq. 15-16: kappa, the radius of the matching term around g_FL; the paper's 0.5 (its "
        "code's -c default 0.5); 0 = FedAvg's direction",
        ge=0,
    )
    global_lr: float = hp(
        1.0,
        "Eq. 17: eta_g; our choice for the 10-round schedule (the paper states 0.05, its PACS "
        "code 0.5; 0.05 barely moves the model in 10 rounds: docs/algorithms/fedomg.md); "
        "1 with kappa 0 = FedAvg",
        gt=0,
    )
    search_lr: float = hp(
        25.0,
        "Eq. 15: learning rate of the momentum search on the softmax logits of Gamma; the paper's and its code's 25",
        gt=0,
    )
    search_steps: int = hp(20, "Eq. 15: momentum steps of the search; the paper's ~20, its code's 20", ge=1)
    search_momentum: float = hp(
        0.5, "Eq. 15: momentum of the search (heavy ball, PyTorch SGD form); the paper's and its code's 0.5", ge=0, lt=1
    )


class FedCCRLOMGParams(FedOMGParams, FedCCRLParams):
    """train.fedccrl_omg: FedCCRL's clients (train.fedccrl's keys) with FedOMG's server step (train.fedomg's keys).
    Our combination, not a published method."""
