"""FedCCRL (Wang et al., fedccrl-v2.txt), Algorithm 1.

Client i, each round:
  Eq. 8     F_i = {(mu(x_j), sigma(x_j))}, ceil(r n_i) samples of its own, uploaded (client_upload)
  line 7    receives F_pool^i = F_pool \\ F_i (server_payloads)
  Eq. 3     X1 = M(X), X2 = M(X), M = AugMix . MixStyle, independent draws (CCDT then DIFP)
  Eq. 4-5   Z = h(X), Y_hat = g(Z) for the three views
  Eq. 12    L_RA = 1/2 (L_SC(Z1, Z) + L_SC(Z2, Z))
  Eq. 14    L_JS over the three softmax outputs
  Eq. 16    L_CLS = mean CE over the three views
  Eq. 15    L = L_CLS + lambda1 L_RA + lambda2 L_JS
The three views go through h in one concatenated batch (as AugMix's JSD training does), so
BatchNorm sees the batch statistics of all three views together.

`variant: paper | reference`. The paper's Table 1 comes from the authors' code
(SanphouWang/FedCCRL at 60b2d9b), which differs from the equations above. Each difference is a
switch of its own (VARIANT_SWITCHES: key -> (paper reading, reference reading)); a switch left
at `auto` follows `variant`. docs/algorithms/fedccrl.md lists them with the reference's file:line.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from fedccrl_core import contract
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.hparams import HParams, hp
from fedccrl_core.augment import AugmentConfig, fedccrl_augment
from fedccrl_core.data.pools import sample_statistics, unbiased_sigma
from fedccrl_core.losses import fedccrl_loss
from fedccrl_core.privacy.dp import privatize
from fedccrl_core.privacy.settings import PrivacySettings

# train.fedccrl.<key>: (the paper's reading, the reference code's), chosen by `variant` when `auto`
VARIANT_SWITCHES = {
    "forward": ("joint", "per_view"),        # one pass on the 3B concatenation | three passes (BN per view)
    "l_cls": ("mean", "sum"),                # Eq. 16's 1/3 | the sum of the three CEs
    "supcon": ("paper", "self_positive"),    # Eq. 11's P(i) without i | i its own positive, mean over 2B
    "augmix": ("per_sample", "batch"),       # Alg. 3 per sample | torchvision's AugMix on the batch tensor
    "mixstyle_var": ("population", "unbiased"),      # Eq. 7 | torch.var's default
    "pool_draw": ("with_replacement", "reference"),  # Alg. 2 line 5 | distinct rows when the pool has >= B
    "upload": ("ceil", "floor_unbiased"),    # Eq. 8 | floor(r n) rows with the unbiased std
    "last_batch": ("skip_single", "keep"),   # skip a last batch of 1 | keep every batch
}
VARIANTS = ("paper", "reference")


def _switch(key: str):
    """The type of train.fedccrl.<key>: auto or one of its two readings."""
    return Literal[("auto", *VARIANT_SWITCHES[key])]


def resolve_variant(hp: dict) -> dict:
    """hp (validated: `variant` and each switch are Literals of FedCCRLParams) with every `auto` switch replaced
    by the reading of hp["variant"]."""
    variant = hp["variant"]
    out = dict(hp)
    for key, readings in VARIANT_SWITCHES.items():
        if out[key] == "auto":
            out[key] = readings[VARIANTS.index(variant)]
    if out.get("augmix_impl", "tensor") == "pil" and out["augmix"] != "per_sample":
        raise ValueError(f"params.yaml: train.fedccrl.augmix_impl pil implements augmix per_sample only, but augmix "
                         f"is {out['augmix']} (variant {variant}); use augmix_impl: tensor")
    return out


def pool_without(uploads: dict[str, dict], client_id: str) -> tuple[np.ndarray, np.ndarray]:
    """F_pool^i = F_pool \\ F_i: the concatenated statistics of every other client (Algorithm 1, line 7)."""
    others = [u for cid, u in uploads.items() if cid != client_id and u is not None]
    if not others:
        raise ValueError(f"FedCCRL: client {client_id} has no other client's statistics (needs >= 2 clients)")
    return (np.concatenate([u["mu"] for u in others]).astype(np.float32),
            np.concatenate([u["sigma"] for u in others]).astype(np.float32))


class StatisticsExchange:
    """Algorithm 1 lines 3-7, shared with FedAlign (which builds on FedCCRL's exchange, its Fig. 2)."""

    def client_upload(self, data, rng):
        """Eq. 8: a fresh uniform subset of ceil(r n_i) of the client's own per-sample statistics."""
        if data.stats_mu is None:
            raise ValueError(f"{type(self).__name__}: client {data.client_id} has no statistics (run the pools stage)")
        mu, sigma = sample_statistics(data.stats_mu, data.stats_sigma, self.hp["r"], rng)
        return self.released({"mu": mu, "sigma": sigma}, rng)

    def released(self, upload: dict, rng) -> dict:
        """F_i as it leaves the client: as drawn (the paper), or each row clipped and noised when
        train.privacy.statistics is on (privacy/dp.py), with draws from the same rng after Eq. 8's."""
        s = PrivacySettings.from_mapping(self.local.privacy)
        if not s.on_statistics:
            return upload
        mu, sigma = privatize(upload["mu"], upload["sigma"], s, rng)
        return {"mu": mu, "sigma": sigma}

    def server_payloads(self, uploads):
        """Line 7: every client receives F_pool^i, the statistics of every other client."""
        return {cid: dict(zip(("mu", "sigma"), pool_without(uploads, cid))) for cid in uploads}


class FedCCRLParams(HParams):
    """train.fedccrl (fedccrl-v2.txt)."""

    r: float = hp(0.1, "Eq. 8: share of a client's per-sample statistics uploaded each round; Table 1 caption r = 0.1",
                  gt=0, le=1)
    alpha: float = hp(0.1, "Alg. 2 (CCDT/MixStyle): lambda ~ Beta(alpha, alpha); Sec. 4.2 alpha = 0.1", gt=0)
    beta: float = hp(1.0, "Alg. 3 (DIFP/AugMix): Dirichlet(beta) chain weights and m ~ Beta(beta, beta); "
                          "Sec. 4.2 beta = 1.0", gt=0)
    severity: int = hp(3, "Alg. 3: AugMix operation severity; not stated, AugMix's (Hendrycks et al.) default 3",
                       ge=1, le=10)
    tau: float = hp(0.1, "Eq. 11: SupCon temperature; Sec. 4.2 tau = 0.1", gt=0)
    lambda1: float = hp(0.1, "Eq. 15: weight of L_RA; not stated, the reference implementation's 0.1", ge=0)
    lambda2: float = hp(0.1, "Eq. 15: weight of L_JS; not stated, the reference implementation's 0.1", ge=0)
    ccdt: bool = hp(True, "Table 2 ablation: CCDT (MixStyle from the pool) in M")
    difp: bool = hp(True, "Table 2 ablation: DIFP (per-sample AugMix) in M")
    l_ra: bool = hp(True, "Table 2 ablation: L_RA in Eq. 15")
    l_js: bool = hp(True, "Table 2 ablation: L_JS in Eq. 15")
    # the paper's reading or the reference code's: each switch is auto (follow `variant`) or a reading
    variant: Literal[VARIANTS] = hp("paper", "paper = Eq. 3-16 and Alg. 1-3 | reference = the authors' code "
                                             "(SanphouWang/FedCCRL at 60b2d9b) behind Table 1")
    forward: _switch("forward") = hp("auto", "Eq. 4: joint = one pass on the 3B concatenation | per_view = three "
                                             "passes, BN per view (reference algorithm/client/fedccrl.py:74-86)")
    l_cls: _switch("l_cls") = hp("auto", "Eq. 16: mean = 1/3 of the three CEs | sum (reference "
                                         "algorithm/client/fedccrl.py:76, :86)")
    supcon: _switch("supcon") = hp("auto", "Eq. 11: paper = P(i) without i | self_positive = i its own positive, "
                                           "mean over 2B anchors (reference algorithm/client/fedccrl.py:137-145)")
    augmix: _switch("augmix") = hp("auto", "Alg. 3: per_sample | batch = torchvision AugMix on the batch tensor, "
                                           "one op chain per batch (reference algorithm/client/fedccrl.py:154-165)")
    mixstyle_var: _switch("mixstyle_var") = hp("auto", "Eq. 7: population | unbiased = torch.var's default "
                                                       "(reference model/models.py:272)")
    pool_draw: _switch("pool_draw") = hp("auto", "Alg. 2 line 5: with_replacement | reference = distinct rows when "
                                                 "the pool holds >= B (reference algorithm/client/fedccrl.py:55-63)")
    upload: _switch("upload") = hp("auto", "Eq. 8: ceil(r n_i) rows | floor_unbiased = floor(r n_i) rows, unbiased "
                                           "std (reference algorithm/client/fedccrl.py:21-44)")
    last_batch: _switch("last_batch") = hp("auto", "skip_single = a last batch of 1 skipped (BatchNorm) | keep = "
                                                   "every batch (reference DataLoader, no drop_last)")
    augmix_impl: Literal["tensor", "pil"] = hp("tensor", "how augmix per_sample runs, not what it draws: tensor = "
                                                         "batched on the device | pil = PIL per sample on the host "
                                                         "(augment/augmix_pil.py); `fedccrl bench` says which is "
                                                         "faster on a device")
    uint8_wrap: bool = hp(False, "reference algorithm/client/fedccrl.py:157-159 casts MixStyle's output to uint8 "
                                 "unclamped (values outside [0, 1] wrap mod 256): a defect, off even in variant "
                                 "reference; true reproduces it")


class FedCCRL(StatisticsExchange, Algorithm):
    name = "fedccrl"
    Params = FedCCRLParams

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.hp = resolve_variant(self.hp)

    def client_upload(self, data, rng):
        """Eq. 8 (upload: ceil), or the reference's floor(r n_i) rows with the unbiased std."""
        if self.hp["upload"] == "ceil":
            return super().client_upload(data, rng)
        if data.stats_mu is None:
            raise ValueError(f"FedCCRL: client {data.client_id} has no statistics (run the pools stage)")
        mu, sigma = sample_statistics(data.stats_mu, data.stats_sigma, self.hp["r"], rng, rounding="floor")
        return self.released({"mu": mu, "sigma": unbiased_sigma(sigma, data.image_hw[0] * data.image_hw[1])}, rng)

    def min_batch(self) -> int:
        return 1 if self.hp["last_batch"] == "keep" else 2

    def train_step(self, model, x, y, ctx):
        x1, x2 = self.augmented_views(x, ctx)
        return self.loss_from_views(model, x, x1, x2, y)

    def augmented_views(self, x, ctx):
        """Eq. 3: X1 = M(X), X2 = M(X), two independent draws on x's device."""
        if ctx.state.get("pool") is None:  # move F_pool^i to the device once per client-round
            ctx.state["pool"] = (torch.as_tensor(ctx.payload["mu"], device=x.device),
                                 torch.as_tensor(ctx.payload["sigma"], device=x.device))
        pool_mu, pool_sigma = ctx.state["pool"]
        aug = AugmentConfig.from_mapping(self.hp)
        mean, std = self.local.mean, self.local.std
        x1 = fedccrl_augment(x, pool_mu, pool_sigma, aug, ctx.generator, mean, std)  # Eq. 3, first draw
        x2 = fedccrl_augment(x, pool_mu, pool_sigma, aug, ctx.generator, mean, std)  # Eq. 3, independent draw
        return x1, x2

    def loss_from_views(self, model, x, x1, x2, y):
        """Eq. 4-5 and 12-16 on the three views. Returns (loss, {term: tensor}, logits on x)."""
        hp = self.hp
        b = x.shape[0]
        if hp["forward"] == "joint":
            z_all = model.h(torch.cat([x, x1, x2]))                                  # Eq. 4
            logits_all = model.g(z_all)                                              # Eq. 5
            z, z1, z2 = z_all[:b], z_all[b:2 * b], z_all[2 * b:]
            lo, lo1, lo2 = logits_all[:b], logits_all[b:2 * b], logits_all[2 * b:]
        else:  # the reference's three passes (clean first): BN normalizes each view by its own batch
            z, z1, z2 = model.h(x), model.h(x1), model.h(x2)                         # Eq. 4
            lo, lo1, lo2 = model.g(z), model.g(z1), model.g(z2)                      # Eq. 5
        loss, t = fedccrl_loss(lo, lo1, lo2, z, z1, z2, y, lambda1=hp["lambda1"], lambda2=hp["lambda2"],
                               tau=hp["tau"], l_ra=hp["l_ra"], l_js=hp["l_js"],
                               l_cls=hp["l_cls"], supcon=hp["supcon"])  # Eq. 12-16
        terms = {k: v for k, v in t.items() if contract.is_loss_term(k)}
        return loss, terms, lo
