"""CCDT: cross-client domain transfer, i.e. MixStyle from the statistics pool (FedCCRL Alg. 2).

FedCCRL v2 calls this step MixStyle, v1 calls it CCDT (Cross-Client Domain Transfer). For
every sample x of a normalized batch X [B, C, H, W], independently:

    mu(x), sigma(x)                       Eq. 6-7 (``statistics.channel_stats``, eps inside sqrt)
    x_tilde = (x - mu(x)) / sigma(x)      Alg. 2 line 4
    (mu', sigma') ~ U(F_pool^i)           Alg. 2 line 5: one row of the pool, with replacement
    lambda ~ Beta(alpha, alpha)           Alg. 2 line 6
    mu_mix    = lambda mu'    + (1 - lambda) mu(x)
    sigma_mix = lambda sigma' + (1 - lambda) sigma(x)
    x_hat = sigma_mix * x_tilde + mu_mix

Reading of Alg. 2 (a departure from the printed text). As printed, lines 7-9 name
gamma_mix = lambda mu' + (1 - lambda) mu(x) (built from the MEANS) and beta_mix from the STDS,
then compute x_hat = gamma_mix * x_tilde + beta_mix: the image would be scaled by a mixed mean
and shifted by a mixed std. That cannot be meant. A scale must be a std (positive, same unit
as the spread of x), but the mean of a normalized image is often negative, which would give
a negative scale (a contrast inversion), and x_hat would have std |mu_mix| and mean sigma_mix,
so the style statistics would land on the wrong moments. MixStyle (Zhou et al., ICLR 2021),
which Alg. 2 adapts and which the authors' reference code imports, scales by the mixed std and
shifts by the mixed mean, so that x_hat has exactly the mixed statistics. We implement that
reading. ``tests/test_augment.py`` pins it: with lambda = 1 the output statistics equal the
pool row (mu', sigma').

Normalized versus pixel space. Let x = (p - m) / s per channel (the eval normalization). Then
mu(x) = (mu(p) - m) / s, sigma(x) = sigma(p) / s and x_tilde is unchanged, so with the pool
statistics expressed in the same space, MixStyle in normalized space equals MixStyle in pixel
space followed by the normalization (up to the eps inside the square root, which is scaled by
s^2). The pool holds statistics of normalized samples (``statistics.py``), so we mix there.

Reference-code switches (params.yaml train.fedccrl.mixstyle_var, pool_draw), so the reference code's runs can be reproduced. The
authors' MixStyle (SanphouWang/FedCCRL 60b2d9b model/models.py:271-273) takes the UNBIASED
variance (divides by HW - 1), and its pool draw (algorithm/client/fedccrl.py:55-63) takes B
DISTINCT rows (a random permutation's first B) when the pool holds at least B rows, with
replacement only otherwise. Alg. 2 line 5 draws each sample's row on its own, i.e. with
replacement, which is what ``pool_draw="with_replacement"`` (the default) does.

Random draws. All randomness comes from an optional ``torch.Generator`` on x's device, so a
seeded generator gives reproducible draws on CPU and CUDA. ``torch.distributions.Beta`` and
``torch._standard_gamma`` take no generator, so Beta is sampled here as a ratio of two Gamma
variates, and Gamma by Marsaglia-Tsang (2000) on the device: a FIXED number of proposals per
variate is drawn at once and the first accepted one is kept. No data-dependent loop, no host
sync (no ``.item()``, no ``nonzero``). The acceptance probability of Marsaglia-Tsang is at
least ~0.95 for shape >= 1, so with 8 proposals a variate has no accepted proposal with
probability < 0.05**8 ~ 4e-11; that variate then takes log(d) (d = shape - 1/3, about the
mode), a bias far below anything measurable. Shapes below 1 use the boost
Gamma(a) = Gamma(a + 1) * U**(1/a). Everything is kept in log space (log-Gamma, Beta as
sigmoid of a log-Gamma difference, Dirichlet as a softmax), because with alpha = 0.1 the boost
U**10 underflows float32 and a plain G1 / (G1 + G2) would give 0/0.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math
from typing import Any

import torch

from fedccrl_core.learning.statistics import channel_stats

# Proposals per Gamma variate in the vectorized Marsaglia-Tsang sampler (see module docstring).
_MT_PROPOSALS = 8


# ---------------------------------------------------------------------------------------------
# Generator-friendly samplers (device-side, no host sync)
# ---------------------------------------------------------------------------------------------
def sample_log_gamma(
    concentration: float,
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """log of Gamma(concentration, rate=1) variates of the given shape (Marsaglia-Tsang).

    For a >= 1, with d = a - 1/3 and c = 1/sqrt(9d): draw z ~ N(0,1), u ~ U(0,1), t = 1 + c z,
    v = t^3; accept when t > 0 and log u < z^2/2 + d - d v + d log v; then G = d v.
    For a < 1, G(a) = G(a + 1) * U^(1/a), i.e. log G(a) = log G(a + 1) + log(U) / a.
    """
    a = float(concentration)
    if not a > 0.0:
        raise ValueError(f"Gamma concentration must be > 0, got {concentration}")
    shape = tuple(shape)
    boost = a < 1.0
    d = (a + 1.0 if boost else a) - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    tiny = torch.finfo(dtype).tiny

    z = torch.randn((_MT_PROPOSALS, *shape), generator=generator, device=device, dtype=dtype)
    u = torch.rand((_MT_PROPOSALS, *shape), generator=generator, device=device, dtype=dtype)
    t = 1.0 + c * z
    v = t * t * t
    log_v = torch.log(v.clamp_min(tiny))
    accepted = (t > 0) & (torch.log(u) < 0.5 * z * z + d - d * v + d * log_v)
    first = accepted.to(dtype).argmax(dim=0, keepdim=True)  # argmax returns the first maximum
    log_g = math.log(d) + log_v.gather(0, first).squeeze(0)
    log_g = torch.where(accepted.any(dim=0), log_g, torch.full_like(log_g, math.log(d)))

    if boost:
        u_boost = torch.rand(shape, generator=generator, device=device, dtype=dtype)
        log_g = log_g + torch.log(u_boost.clamp_min(tiny)) / a
    return log_g


def sample_gamma(concentration: float, shape: tuple[int, ...], **kwargs) -> torch.Tensor:
    """Gamma(concentration, 1) variates; see ``sample_log_gamma`` (same keyword arguments)."""
    return sample_log_gamma(concentration, shape, **kwargs).exp()


def sample_beta(
    a: float,
    b: float,
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Beta(a, b) variates: X/(X+Y) with X ~ Gamma(a), Y ~ Gamma(b), computed as
    sigmoid(log X - log Y) so that it never divides 0 by 0."""
    kw: dict[str, Any] = dict(generator=generator, device=device, dtype=dtype)
    log_x = sample_log_gamma(a, shape, **kw)
    log_y = sample_log_gamma(b, shape, **kw)
    return torch.sigmoid(log_x - log_y)


def sample_dirichlet(
    concentration: float,
    shape: tuple[int, ...],
    active: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Symmetric Dirichlet(concentration) weights over the last dim of ``shape``.

    ``active`` (bool, broadcastable to ``shape``) restricts each row to its True entries: the
    row is then Dirichlet(concentration, ..., concentration) over those entries and 0 elsewhere
    (normalized Gamma variates, computed as a softmax of log-Gamma variates).
    """
    log_g = sample_log_gamma(concentration, shape, generator=generator, device=device, dtype=dtype)
    if active is not None:
        log_g = log_g.masked_fill(~active, float("-inf"))
    return torch.softmax(log_g, dim=-1)


# ---------------------------------------------------------------------------------------------
# CCDT / MixStyle from the pool (Alg. 2)
# ---------------------------------------------------------------------------------------------
def mixstyle(
    x: torch.Tensor,
    mu_p: torch.Tensor,
    sigma_p: torch.Tensor,
    lam: torch.Tensor,
    eps: float = 1e-6,
    unbiased: bool = False,
    lam_weighs: str = "pool",
) -> torch.Tensor:
    """MixStyle with given draws, the one implementation (FedCCRL's CCDT, FedAlign's M): x [B, C, H, W],
    style rows mu_p, sigma_p [B, C] (from the pool), lambda [B].

    mu(x), sigma(x)                       FedCCRL Eq. 6-7 / FedAlign Eq. 7-8 (statistics.channel_stats)
    x_tilde = (x - mu(x)) / sigma(x)
    mu_mix, sigma_mix                     lambda on the pool row (lam_weighs="pool": FedCCRL Alg. 2 lines 7-8)
                                          or on the sample's own (lam_weighs="own": FedAlign Eq. 9-10)
    x_hat = sigma_mix * x_tilde + mu_mix  (Alg. 2 line 9; FedAlign Eq. 11 read as MixStyle)
    """
    mu, sigma = channel_stats(x, eps, unbiased)  # [B, C]
    lam = lam.reshape(-1, 1).to(x.dtype)
    mu_p, sigma_p = mu_p.to(x.dtype), sigma_p.to(x.dtype)
    if lam_weighs == "pool":
        mu_mix = lam * mu_p + (1.0 - lam) * mu
        sigma_mix = lam * sigma_p + (1.0 - lam) * sigma
    elif lam_weighs == "own":
        mu_mix = lam * mu + (1.0 - lam) * mu_p
        sigma_mix = lam * sigma + (1.0 - lam) * sigma_p
    else:
        raise ValueError(f"lam_weighs must be 'pool' or 'own', got {lam_weighs!r}")
    x_tilde = (x - mu[:, :, None, None]) / sigma[:, :, None, None]
    return sigma_mix[:, :, None, None] * x_tilde + mu_mix[:, :, None, None]


def ccdt(
    x: torch.Tensor,
    pool_mu: torch.Tensor,
    pool_sigma: torch.Tensor,
    alpha: float = 0.1,
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    unbiased: bool = False,
    pool_draw: str = "with_replacement",
) -> torch.Tensor:
    """Alg. 2 on a normalized batch x [B, C, H, W]; returns x_hat of the same shape.

    pool_mu, pool_sigma [P, C] (or [P, C, 1, 1]) are F_pool^i = F_pool minus the client's own
    F_i (Eq. 8); keep them on x's device to avoid a copy per call. Each sample draws its own
    pool row (uniformly, with replacement) and its own lambda ~ Beta(alpha, alpha).
    unbiased / pool_draw="reference": the reference code's statistics and draw (module docstring).
    """
    if x.dim() != 4:
        raise ValueError(f"ccdt expects a [B, C, H, W] batch, got shape {tuple(x.shape)}")
    n_pool = pool_mu.shape[0]
    if n_pool == 0 or pool_sigma.shape[0] != n_pool:
        raise ValueError(
            f"statistics pool must be non-empty with matching rows, got mu {tuple(pool_mu.shape)} "
            f"and sigma {tuple(pool_sigma.shape)}"
        )
    batch, channels = x.shape[:2]
    pool_mu = pool_mu.reshape(n_pool, -1).to(device=x.device, dtype=x.dtype)
    pool_sigma = pool_sigma.reshape(n_pool, -1).to(device=x.device, dtype=x.dtype)
    if pool_mu.shape[1] != channels or pool_sigma.shape[1] != channels:
        raise ValueError(f"pool has {pool_mu.shape[1]} channels, batch has {channels}")

    idx = pool_rows(n_pool, batch, pool_draw, generator, x.device)  # Alg. 2 line 5
    lam = sample_beta(alpha, alpha, (batch,), generator=generator, device=x.device)  # line 6
    return mixstyle(x, pool_mu.index_select(0, idx), pool_sigma.index_select(0, idx), lam, eps, unbiased)


def pool_rows(
    n_pool: int, batch: int, pool_draw: str = "with_replacement", generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """Indices of the pool rows of a batch: "with_replacement" (Alg. 2 line 5, each sample on its
    own) or "reference" (distinct rows when n_pool >= batch, with replacement otherwise)."""
    if pool_draw == "reference" and n_pool >= batch:
        return torch.randperm(n_pool, generator=generator, device=device)[:batch]
    if pool_draw not in ("with_replacement", "reference"):
        raise ValueError(f"pool_draw must be 'with_replacement' or 'reference', got {pool_draw!r}")
    return torch.randint(n_pool, (batch,), generator=generator, device=device)
