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
"""
from __future__ import annotations

import numpy as np
import torch

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.hparams import HParams, hp
from fedccrl_core.augment import AugmentConfig, fedccrl_augment
from fedccrl_core.data.pools import sample_statistics
from fedccrl_core.losses import fedccrl_loss


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


class FedCCRL(StatisticsExchange, Algorithm):
    name = "fedccrl"
    Params = FedCCRLParams

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
        z_all = model.h(torch.cat([x, x1, x2]))                                      # Eq. 4
        logits_all = model.g(z_all)                                                  # Eq. 5
        z, z1, z2 = z_all[:b], z_all[b:2 * b], z_all[2 * b:]
        lo, lo1, lo2 = logits_all[:b], logits_all[b:2 * b], logits_all[2 * b:]
        loss, t = fedccrl_loss(lo, lo1, lo2, z, z1, z2, y, lambda1=hp["lambda1"], lambda2=hp["lambda2"],
                               tau=hp["tau"], l_ra=hp["l_ra"], l_js=hp["l_js"])  # Eq. 12-16
        terms = {name: t[key] for name, key in (("l_cls", "loss_cls"), ("l_ra", "loss_ra"), ("l_js", "loss_js"))
                 if key in t}
        return loss, terms, lo
