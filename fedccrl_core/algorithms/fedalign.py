"""FedAlign (Gupta, Sutar, Singh & Sethi, fedalign.txt), Algorithm 1 and sections 3.2-3.7.

Client k, each round (the statistics exchange is FedCCRL's, which FedAlign builds on, Fig. 2):
  upload     ceil(r n_k) of its own per-sample style statistics (mu, sigma) (Table 1: r = 0.1)
  payload    the pool of every other client's statistics (server_payloads, as FedCCRL)
  Sec. 3.3   enhanced MixStyle M from the pool, with the paper's two changes:
             clustering  - the pool's style vectors s_j = (mu_j, sigma_j) in R^6 are grouped by k-means
                           (`kmeans`, scikit-learn's KMeans), once per client-round, on the client, over the
                           pool it samples from;
             weights     - cluster c is drawn with probability p_c = v_c / sum_c' v_c', v_c the variance of
                           its style vectors (`cluster_variance`), then a row uniformly inside it, i.e.
                           row j has probability q_j = p_c(j) / n_c(j) (`style_sampling_probabilities`);
             then Eq. 7-11 with lambda ~ Beta(alpha, alpha) (`mixstyle`).
  Eq. 3      X1 = M(X), X2 = M(X), independent draws
  Eq. 5-6    Z = h(X), Y_hat = g(Z) for the three views (one concatenated batch through h, as FedCCRL)
  Alg. 1     L_CLS = 1/B sum_i l(y_hat_i, y_i): cross-entropy on the ORIGINAL view (Alg. 1 line 17)
  Eq. 12     L_SC = 1/2 (L_SC(Z1, Z) + L_SC(Z2, Z))   (losses.representation_alignment_loss)
  Eq. 13     L_RC = MSE between h(X) and h(X_aug), both augmented views (`representation_consistency_loss`)
  Eq. 15     L_JS over the three softmax outputs       (losses.js_loss)
  Eq. 16     L = L_CLS + lambda1 (L_SC + L_RC) + lambda2 L_JS
  Sec. 3.4   a domain discriminator D (FC + batch norm + dropout + non-linearity) tells original (0)
             from augmented (1) representations; h is trained to fool it through a gradient reversal
             layer (DANN, Ganin & Lempitsky 2015, cited in Sec. 2.1), so the step minimizes
             Eq. 16 + L_ADV(D(GRL_{lambda_adv}(Z))): D descends L_ADV, h ascends lambda_adv L_ADV.

Departures and choices (each also in params.yaml train.fedalign and docs/algorithms/fedalign.md):
  * Eq. 16 has no adversarial term although Sec. 3.4 trains D; we add it as above (`adv: false` gives
    exactly Eq. 16 and leaves D untouched).
  * Eq. 11 prints x_aug = gamma_mix x_tilde + beta_mix with gamma from the MEANS (Eq. 9) and beta from
    the STDS (Eq. 10); as for FedCCRL's Alg. 2 (augment/ccdt.py) we scale by the mixed std and shift by
    the mixed mean, as MixStyle does. Eq. 9-10 put lambda on the sample's own statistics; we do too.
  * D is part of the model's state_dict and is aggregated with Eq. 2 (Alg. 1 line 9 averages every
    parameter theta_k a client trains, Fig. 2 "clients share local model parameters"; D's task,
    original vs. augmented, is the same on every client). `build_model` adds it, so checkpoints
    rebuild it; `forward` is g . h only, so D is never part of inference or the ONNX export.
  * M is MixStyle only (Eq. 3, Sec. 3.2 "M represents the MixStyle module"); `difp: true` adds
    FedCCRL's per-sample AugMix after it (the abstract's "domain-invariant feature perturbation").


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithm_params.fedalign import FedAlignParams
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.algorithms.fedccrl import StatisticsExchange
from fedccrl_core.augment.augmix import augmix
from fedccrl_core.augment.ccdt import mixstyle, sample_beta
from fedccrl_core.foundation import contract
from fedccrl_core.learning.losses import js_loss, representation_alignment_loss
from fedccrl_core.learning.models import FedModel
from fedccrl_core.learning.statistics import denormalize, normalize

KMEANS_RESTARTS = 4  # k-means++ initializations; the lowest within-cluster sum of squares wins
KMEANS_MAX_ITERS = 100  # Lloyd iterations at most per initialization


# ---- Sec. 3.3, change 1: clustering of the style statistics ------------------------------------
def kmeans(
    points: np.ndarray,
    k: int,
    rng: np.random.Generator,
    restarts: int = KMEANS_RESTARTS,
    max_iters: int = KMEANS_MAX_ITERS,
) -> tuple[np.ndarray, np.ndarray]:
    """k-means on points [P, D]: scikit-learn's KMeans (Lloyd, k-means++ seeding of Arthur & Vassilvitskii
    2007, `restarts` initializations), seeded by one draw from `rng`.

    Returns (labels [P] int64 in 0..k'-1, centers [k', D]) with k' = min(k, P, distinct points);
    labels are renumbered by first appearance so that a cluster id never refers to an empty cluster."""
    from sklearn.cluster import KMeans  # imported here: only FedAlign with n_clusters > 1 clusters

    x = np.asarray(points, dtype=np.float64)
    n = x.shape[0]
    if n == 0:
        raise ValueError("kmeans: no points")
    k = max(1, min(int(k), len(np.unique(x, axis=0))))  # more clusters than distinct points cannot be filled
    km = KMeans(
        n_clusters=k,
        init="k-means++",
        n_init=max(1, restarts),
        max_iter=max_iters,
        random_state=int(rng.integers(2**31 - 1)),
    ).fit(x)
    labels, centers = km.labels_, km.cluster_centers_
    used, relabel = np.unique(labels, return_inverse=True)  # drop empty clusters
    order = np.argsort([np.flatnonzero(relabel == c)[0] for c in range(len(used))])
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[relabel].astype(np.int64), centers[used][order]


# ---- Sec. 3.3, change 2: probabilistic sampling weights by cluster variance --------------------
def cluster_variance(points: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """v_c = 1/n_c sum_{j in c} ||s_j - s_bar_c||^2: the total variance (trace of the covariance)
    of cluster c's style vectors, for c = 0..max(labels)."""
    x = np.asarray(points, dtype=np.float64)
    k = int(labels.max()) + 1
    return np.array([((x[labels == c] - x[labels == c].mean(0)) ** 2).sum(1).mean() for c in range(k)])


def style_sampling_probabilities(points: np.ndarray, labels: np.ndarray, variance_weights: bool = True) -> np.ndarray:
    """q_j, the probability of drawing pool row j: a cluster c with p_c = v_c / sum v (uniform 1/k with
    `variance_weights=False`, or when every cluster has zero variance), then a row uniformly in it,
    so q_j = p_c(j) / n_c(j). A one-row cluster has v_c = 0 and is never drawn with variance weights."""
    labels = np.asarray(labels)
    k = int(labels.max()) + 1
    counts = np.bincount(labels, minlength=k).astype(np.float64)
    v = cluster_variance(points, labels) if variance_weights else np.ones(k)
    p = v / v.sum() if v.sum() > 0 else np.full(k, 1.0 / k)
    return (p[labels] / counts[labels]).astype(np.float64)


def style_pool_distribution(
    mu: np.ndarray, sigma: np.ndarray, n_clusters: int, rng: np.random.Generator, variance_weights: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster the pool's style vectors s_j = [mu_j, sigma_j] (R^{2C}, both in the normalized image's
    units, so unscaled) and return (q [P], labels [P]). n_clusters = 1 gives the uniform pool (FedCCRL)."""
    s = np.concatenate([mu, sigma], axis=1)
    labels = kmeans(s, n_clusters, rng)[0] if n_clusters > 1 else np.zeros(len(s), dtype=np.int64)
    return style_sampling_probabilities(s, labels, variance_weights), labels


# ---- Sec. 3.3, Eq. 7-11: MixStyle with a pool row (augment/ccdt.py `mixstyle`, lambda on the sample's own) --
def clustered_mixstyle(
    x: torch.Tensor,
    pool_mu: torch.Tensor,
    pool_sigma: torch.Tensor,
    q: torch.Tensor,
    alpha: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """M(X) of Sec. 3.3 on a normalized batch: each sample draws its own pool row j ~ q (cluster by
    variance weight, then uniform inside it) and its own lambda ~ Beta(alpha, alpha); no host sync."""
    b = x.shape[0]
    j = torch.multinomial(q, b, replacement=True, generator=generator)
    lam = sample_beta(alpha, alpha, (b,), generator=generator, device=x.device)
    return mixstyle(x, pool_mu.index_select(0, j), pool_sigma.index_select(0, j), lam, lam_weighs="own")


# ---- Sec. 3.5, Eq. 13: representation consistency ---------------------------------------------
def representation_consistency_loss(z: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """L_RC = 1/|mix_feat| sum ||h(X) - h(X_aug)||^2 over both augmented views (Eq. 13), as a mean
    squared error ("Mean Squared Error", Sec. 3.2/3.5): the mean over every element of Z^(1) and
    Z^(2), i.e. 1/2 (MSE(Z^(1), Z) + MSE(Z^(2), Z)). Gradients reach both sides."""
    z = z.float()
    return 0.5 * (F.mse_loss(z1.float(), z) + F.mse_loss(z2.float(), z))


# ---- Sec. 3.4: the adversarial domain discriminator --------------------------------------------
class _GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coeff * grad, None


def grad_reverse(x: torch.Tensor, coeff: float) -> torch.Tensor:
    """Identity forward, gradient times -coeff backward (Ganin & Lempitsky 2015)."""
    return _GradientReversal.apply(x, coeff)


class DomainDiscriminator(nn.Module):
    """D(z): logit that z is an augmented (not an original) representation. Sec. 3.4: "fully connected
    layers with dropout, batch normalization, and non-linear activations"; two hidden layers."""

    def __init__(self, feature_dim: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(feature_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )

    def forward(self, z):
        return self.net(z).squeeze(1)


def adversarial_loss(d_orig: torch.Tensor, d_aug1: torch.Tensor, d_aug2: torch.Tensor) -> torch.Tensor:
    """L_ADV: binary cross-entropy of D's logits, original = 0, augmented = 1, the two classes weighted
    equally: 1/2 (BCE(D(Z), 0) + 1/2 (BCE(D(Z^(1)), 1) + BCE(D(Z^(2)), 1)))."""
    bce = F.binary_cross_entropy_with_logits
    d_orig, d_aug1, d_aug2 = d_orig.float(), d_aug1.float(), d_aug2.float()
    return 0.5 * (
        bce(d_orig, torch.zeros_like(d_orig))
        + 0.5 * (bce(d_aug1, torch.ones_like(d_aug1)) + bce(d_aug2, torch.ones_like(d_aug2)))
    )


# ---- Eq. 16 -----------------------------------------------------------------------------------
def fedalign_loss(
    logits,
    logits1,
    logits2,
    z,
    z1,
    z2,
    y,
    lambda1=0.1,
    lambda2=0.1,
    tau=0.1,
    l_sc=True,
    l_rc=True,
    l_js=True,
    l_adv=None,
):
    """L = L_CLS + lambda1 (L_SC + L_RC) + lambda2 L_JS (Eq. 16), plus L_ADV when given (Sec. 3.4;
    already routed through the gradient reversal layer by the caller). A switched-off term is
    neither computed nor reported. Returns (L, {term: detached tensor})."""
    loss_cls = F.cross_entropy(logits.float(), y)  # Alg. 1 line 17: the original view only
    total, terms = loss_cls, {contract.L_CLS: loss_cls}
    if l_sc:
        terms[contract.L_SC] = representation_alignment_loss(z, z1, z2, y, tau)  # Alg. 1 line 17 / Eq. 12
        total = total + lambda1 * terms[contract.L_SC]
    if l_rc:
        terms[contract.L_RC] = representation_consistency_loss(z, z1, z2)  # Eq. 13
        total = total + lambda1 * terms[contract.L_RC]
    if l_js:
        terms[contract.L_JS] = js_loss(logits, logits1, logits2)  # Eq. 15
        total = total + lambda2 * terms[contract.L_JS]
    if l_adv is not None:
        terms[contract.L_ADV] = l_adv
        total = total + l_adv
    return total, {k: v.detach() for k, v in terms.items()}


class FedAlign(StatisticsExchange, Algorithm):
    """Statistics upload and pool payload: FedCCRL's (StatisticsExchange); clustering is the client's."""

    name = "fedalign"
    Params = FedAlignParams
    hp: FedAlignParams

    @classmethod
    def extend_model(cls, model, num_classes, hp) -> FedModel:
        """f = g . h plus the discriminator D (aggregated, never used by forward)."""
        model.discriminator = DomainDiscriminator(model.feature_dim, int(hp.disc_hidden), float(hp.disc_dropout))
        return model

    def _pool(self, ctx, device):
        """Once per client-round: cluster the received pool and move it with q to the device. The k-means
        seed is a checksum of the pool itself: the clustering is a function of the pool, identical on
        every engine, with no device sync and no draw from the augmentation generator."""
        if ctx.state is None:  # the scratch is the pool: (mu, sigma, q)
            mu = np.ascontiguousarray(ctx.payload["mu"], dtype=np.float32)
            sigma = np.ascontiguousarray(ctx.payload["sigma"], dtype=np.float32)
            rng = np.random.default_rng(zlib.crc32(mu.tobytes() + sigma.tobytes()))  # k-means seeded by the pool
            q, _ = style_pool_distribution(mu, sigma, self.hp.n_clusters, rng, self.hp.variance_weights)
            ctx.state = (
                torch.as_tensor(mu, device=device),
                torch.as_tensor(sigma, device=device),
                torch.as_tensor(q, dtype=torch.float32, device=device),
            )
        return ctx.state

    def augment(self, x, pool, generator):
        """M(X) (Eq. 3): clustered MixStyle, then optionally FedCCRL's per-sample AugMix (difp)."""
        pool_mu, pool_sigma, q = pool
        out = clustered_mixstyle(x, pool_mu, pool_sigma, q, self.hp.alpha, generator)
        if self.hp.difp:
            mean, std = self.local.mean, self.local.std
            out = normalize(
                augmix(denormalize(out, mean, std).clamp(0, 1), self.hp.beta, self.hp.severity, generator), mean, std
            )
        return out

    def train_step(self, model, x, y, ctx):
        hp = self.hp
        pool = self._pool(ctx, x.device)
        x1, x2 = self.augment(x, pool, ctx.generator), self.augment(x, pool, ctx.generator)  # Eq. 3
        b = x.shape[0]
        z_all = model.h(torch.cat([x, x1, x2]))  # Eq. 5
        logits_all = model.g(z_all)  # Eq. 6
        z, z1, z2 = z_all[:b], z_all[b : 2 * b], z_all[2 * b :]
        lo, lo1, lo2 = logits_all[:b], logits_all[b : 2 * b], logits_all[2 * b :]
        l_adv = None
        if hp.adv:  # Sec. 3.4: D learns original vs. augmented, h unlearns it through the reversal
            d = model.discriminator(grad_reverse(z_all, hp.lambda_adv))
            l_adv = adversarial_loss(d[:b], d[b : 2 * b], d[2 * b :])
        loss, terms = fedalign_loss(
            lo, lo1, lo2, z, z1, z2, y, hp.lambda1, hp.lambda2, hp.tau, hp.l_sc, hp.l_rc, hp.l_js, l_adv
        )  # Eq. 16
        return loss, terms, lo
