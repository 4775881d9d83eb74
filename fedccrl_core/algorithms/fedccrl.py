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
switch of its own (VARIANT_SWITCHES, beside the hyperparameters in
fedccrl_core/algorithm_params/fedccrl.py: key -> (paper reading, reference reading)); a switch left at `auto`
follows `variant`. docs/algorithms/fedccrl.md lists them with the reference's file:line.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np
import torch

from fedccrl_core.algorithm_params.fedalign import FedAlignParams
from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams, resolve_variant
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.augment.compose import fedccrl_augment
from fedccrl_core.data.pools import REBUILD, sample_statistics, unbiased_sigma, upload_size
from fedccrl_core.foundation import contract, fastpath
from fedccrl_core.learning.losses import fedccrl_loss
from fedccrl_core.privacy.dp import privatize
from fedccrl_core.privacy.noise import private_rng


def pool_without(uploads: dict[str, dict], client_id: str) -> tuple[np.ndarray, np.ndarray]:
    """F_pool^i = F_pool \\ F_i: the concatenated statistics of every other client (Algorithm 1, line 7)."""
    others = [u for cid, u in uploads.items() if cid != client_id and u is not None]
    if not others:
        raise ValueError(f"FedCCRL: client {client_id} has no other client's statistics (needs >= 2 clients)")
    return (
        np.concatenate([u["mu"] for u in others]).astype(np.float32),
        np.concatenate([u["sigma"] for u in others]).astype(np.float32),
    )


class StatisticsExchange:
    """Algorithm 1 lines 3-7, shared with FedAlign (which builds on FedCCRL's exchange, its Fig. 2)."""

    rounding = "ceil"  # Eq. 8
    # what the Algorithm it is mixed into (FedCCRL, FedAlign) has
    local: LocalConfig
    hp: FedCCRLParams | FedAlignParams

    def client_upload(self, data, rng):
        """Eq. 8: a fresh uniform subset of ceil(r n_i) of the client's own per-sample statistics."""
        if data.stats_mu is None:
            raise ValueError(f"{type(self).__name__}: client {data.client_id} has no statistics (no pools: {REBUILD})")
        rng = self.upload_rng(data, rng)
        mu, sigma = sample_statistics(data.stats_mu, data.stats_sigma, self.hp.r, rng)
        return self.released({"mu": mu, "sigma": sigma}, rng)

    @staticmethod
    def upload_rows(upload) -> int | None:
        """k_i of an upload as it left a client: the rows of F_i (Eq. 8) when it is this exchange's statistics,
        None for any other upload."""
        return len(upload["mu"]) if isinstance(upload, dict) and "mu" in upload else None

    def released_rows(self, n: int) -> int:
        """k_i, the rows a client of n_i images releases per round (Eq. 8): announced before the round, for the
        privacy budget (federation/loop.py)."""
        return upload_size(n, self.hp.r, self.rounding)

    def upload_rng(self, data, rng: np.random.Generator) -> np.random.Generator:
        """The generator of Eq. 8's draw and of the noise: the run seed's (the paper), or with
        train.privacy.statistics on the OS's entropy (privacy/noise.py): the sample and the noise stay secret."""
        s = self.local.privacy
        if s is None or not s.on_statistics:
            return rng
        keys = () if s.noise_seed is None else (data.client_id, int(rng.integers(2**62)))  # tests: round's draw
        return private_rng(s, "statistics", *keys)

    def released(self, upload: dict, rng) -> dict:
        """F_i as it leaves the client: as drawn (the paper), or each row clipped and noised when
        train.privacy.statistics is on (privacy/dp.py), with draws from upload_rng after Eq. 8's."""
        s = self.local.privacy
        if s is None or not s.on_statistics:
            return upload
        mu, sigma = privatize(upload["mu"], upload["sigma"], s, rng)
        return {"mu": mu, "sigma": sigma}

    def server_payloads(self, uploads):
        """Line 7: every client receives F_pool^i, the statistics of every other client."""
        return {cid: dict(zip(("mu", "sigma"), pool_without(uploads, cid))) for cid in uploads}


class FedCCRL(StatisticsExchange, Algorithm):
    name = "fedccrl"
    Params = FedCCRLParams
    hp: FedCCRLParams
    pads_partial_batch = True  # Eq. 12-16 read ctx.real_rows only (learning/static_batch.py)

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.rounding = "ceil" if self.hp.upload == "ceil" else "floor"

    @classmethod
    def validated(cls, hparams):
        """The Params with every `auto` switch read from `variant` (fedccrl_core/algorithm_params/fedccrl.py)."""
        hp = super().validated(hparams)
        assert isinstance(hp, FedCCRLParams)  # cls.Params: FedCCRLParams or a subclass (FedCCRLOMGParams)
        return resolve_variant(hp)

    def client_upload(self, data, rng):
        """Eq. 8 (upload: ceil), or the reference's floor(r n_i) rows with the unbiased std."""
        if self.hp.upload == "ceil":
            return super().client_upload(data, rng)
        if data.stats_mu is None:
            raise ValueError(f"FedCCRL: client {data.client_id} has no statistics (no pools: {REBUILD})")
        rng = self.upload_rng(data, rng)
        mu, sigma = sample_statistics(data.stats_mu, data.stats_sigma, self.hp.r, rng, rounding="floor")
        return self.released({"mu": mu, "sigma": unbiased_sigma(sigma, data.image_hw[0] * data.image_hw[1])}, rng)

    def min_batch(self) -> int:
        return 1 if self.hp.last_batch == "keep" else 2

    def train_step(self, model, x, y, ctx):
        x1, x2 = self.augmented_views(x, ctx)
        return self.loss_from_views(model, x, x1, x2, y, ctx.real_rows)

    def augmented_views(self, x, ctx):
        """Eq. 3: X1 = M(X), X2 = M(X), two independent draws on x's device."""
        if ctx.state is None:  # move F_pool^i to the device once per client-round: the scratch is (mu, sigma)
            ctx.state = (
                torch.as_tensor(ctx.payload["mu"], device=x.device),
                torch.as_tensor(ctx.payload["sigma"], device=x.device),
            )
        pool_mu, pool_sigma = ctx.state
        aug = self.hp
        mean, std = self.local.mean, self.local.std
        if self.views_in_one_draw(x.device):  # one M over [X; X]: every row draws its own, so X1, X2 independent
            both = fedccrl_augment(torch.cat([x, x]), pool_mu, pool_sigma, aug, ctx.generator, mean, std)
            return both[: x.shape[0]], both[x.shape[0] :]
        x1 = fedccrl_augment(x, pool_mu, pool_sigma, aug, ctx.generator, mean, std)  # Eq. 3, first draw
        x2 = fedccrl_augment(x, pool_mu, pool_sigma, aug, ctx.generator, mean, std)  # Eq. 3, independent draw
        return x1, x2

    def views_in_one_draw(self, device) -> bool:
        """Whether Eq. 3's two draws run as one call on the 2B rows [X; X] (half the operators dispatched, kernels
        twice the size): on the CUDA fast path, where M draws per row (per-sample AugMix, pool rows with
        replacement), so the two views have the same distribution as two calls. The draws differ from two calls',
        so the CPU keeps two calls and its numbers."""
        aug = self.hp
        return (
            fastpath.static_batches(self.local.fast, device)
            and aug.augmix == "per_sample"
            and aug.pool_draw == "with_replacement"
        )

    def loss_from_views(self, model, x, x1, x2, y, real_rows: int | None = None):
        """Eq. 4-5 and 12-16 on the three views. Returns (loss, {term: tensor}, logits on x). A padded batch
        (static shapes) is forwarded whole; Eq. 12-16 take its first real_rows rows of each view."""
        hp = self.hp
        b = x.shape[0]
        r = b if real_rows is None else real_rows
        if hp.forward == "joint":
            z_all = model.h(torch.cat([x, x1, x2]))  # Eq. 4
            logits_all = model.g(z_all)  # Eq. 5
            z, z1, z2 = z_all[:r], z_all[b : b + r], z_all[2 * b : 2 * b + r]
            lo, lo1, lo2 = logits_all[:r], logits_all[b : b + r], logits_all[2 * b : 2 * b + r]
        else:  # the reference's three passes (clean first): BN normalizes each view by its own batch
            z, z1, z2 = model.h(x)[:r], model.h(x1)[:r], model.h(x2)[:r]  # Eq. 4
            lo, lo1, lo2 = model.g(z), model.g(z1), model.g(z2)  # Eq. 5
        y = y[:r]
        loss, t = fedccrl_loss(
            lo,
            lo1,
            lo2,
            z,
            z1,
            z2,
            y,
            lambda1=hp.lambda1,
            lambda2=hp.lambda2,
            tau=hp.tau,
            l_ra=hp.l_ra,
            l_js=hp.l_js,
            l_cls=hp.l_cls,
            supcon=hp.supcon,
        )  # Eq. 12-16
        terms = {k: v for k, v in t.items() if contract.is_loss_term(k)}
        return loss, terms, lo
