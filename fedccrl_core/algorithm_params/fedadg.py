"""train.fedadg: FedADG's hyperparameters; the algorithm is fedccrl_core/algorithms/fedadg.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.foundation.hparams import HParams, hp


class FedADGParams(HParams):
    """train.fedadg."""

    lambda0: float = hp(
        0.85,
        "weight of L_err, 1 - lambda0 on L_advf: reference localTrain alpha 0.85; FedCCRL reference 0.85",
        ge=0,
        le=1,
    )
    e1: int = hp(
        3,
        "adversarial epochs after the E0 = train.local_epochs CE epochs: FedCCRL reference 3 (FedADG reference 7)",
        ge=0,
    )
    lr_adv: float = hp(
        7e-4,
        "Adam lr of D and G: FedCCRL reference disc_lr = gen_lr = 0.0007 (FedADG reference: SGD 0.007 and 0.01)",
        gt=0,
    )
    label_value: float = hp(0.7, "scaled one-hot label fed to G and D: FedADG reference 0.7", gt=0, le=1)
    noise_dim: int = hp(
        128,
        "uniform noise size of G; our choice, reduced from the reference's 2048: G is "
        "aggregated, so it is sent every round",
        ge=1,
    )
    gen_hidden: int = hp(512, "hidden width of G; our choice, reduced from the reference's 4096 (as noise_dim)", ge=1)
    rp_dim: int = hp(1024, "D's random projection size: FedADG reference --rp-size 1024 (D stays on the client)", ge=1)
    disc_hidden: int = hp(1024, "D's hidden width: FedADG reference 1024", ge=1)
