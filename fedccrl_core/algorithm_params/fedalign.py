"""train.fedalign: FedAlign's hyperparameters (fedalign.txt); the algorithm is fedccrl_core/algorithms/fedalign.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar

from fedccrl_core.foundation.hparams import HParams, hp


class FedAlignParams(HParams):
    """train.fedalign (fedalign.txt sections 3.2-3.7)."""

    uploads_statistics: ClassVar[bool] = True  # FedCCRL's exchange (Eq. 8): train.privacy.statistics must noise it

    r: float = hp(0.1, "upload ratio of statistics: Table 1 caption r = 0.1", gt=0, le=1)
    alpha: float = hp(
        0.1,
        "MixStyle lambda ~ Beta(alpha, alpha) (Eq. 9-10); our choice: not given, MixStyle's and FedCCRL's 0.1",
        gt=0,
    )
    n_clusters: int = hp(
        3,
        "k-means clusters of the pool's (mu, sigma) (Sec. 3.3 Clustering); our choice: not "
        "given, the source domains of a leave-one-domain-out run; 1 = FedCCRL's uniform pool",
        ge=1,
    )
    variance_weights: bool = hp(
        True,
        "Sec. 3.3 Probabilistic Sampling Weights: cluster c drawn with p_c = v_c / "
        "sum v; false = clusters equally likely (our ablation switch)",
    )
    tau: float = hp(0.1, "SupCon temperature (Eq. 12; Sec. 4 training configuration)", gt=0)
    lambda1: float = hp(0.1, "weight of L_SC + L_RC (Eq. 16); our choice: not given, FedCCRL's reference 0.1", ge=0)
    lambda2: float = hp(0.1, "weight of L_JS (Eq. 16); our choice: not given, FedCCRL's reference 0.1", ge=0)
    lambda_adv: float = hp(
        0.1,
        "gradient-reversal scale of the discriminator loss for h (Sec. 3.4); our choice: "
        "not given, and Eq. 16 has no adversarial term; 0.1 as the other weights",
        ge=0,
    )
    disc_hidden: int = hp(
        256,
        "D's hidden width, two FC + BN + ReLU + dropout layers (Sec. 3.4); our choice: D is "
        "aggregated, 256 adds ~0.4 M parameters to MobileNetV3-Large's 4.2 M",
        ge=1,
    )
    disc_dropout: float = hp(
        0.5, "D's dropout (Sec. 3.4 names dropout, not its rate); our choice: DANN's domain classifier 0.5", ge=0, lt=1
    )
    difp: bool = hp(
        False,
        "M = MixStyle only (Eq. 3, Sec. 3.2); true adds FedCCRL's per-sample AugMix after it "
        "(our option: the abstract's 'domain-invariant feature perturbation')",
    )
    beta: float = hp(1.0, "AugMix Dirichlet/Beta parameter, only with difp (FedCCRL's)", gt=0)
    severity: int = hp(3, "AugMix severity, only with difp (FedCCRL's)", ge=1, le=10)
    l_sc: bool = hp(True, "Eq. 16 term switch (our ablation switch; all on = the paper)")
    l_rc: bool = hp(True, "Eq. 16 term switch (our ablation switch; all on = the paper)")
    l_js: bool = hp(True, "Eq. 16 term switch (our ablation switch; all on = the paper)")
    adv: bool = hp(True, "Sec. 3.4 discriminator on; false = exactly Eq. 16 (D is still built and sent, untrained)")
