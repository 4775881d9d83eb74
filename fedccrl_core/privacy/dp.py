"""The two mechanisms, each a Gaussian mechanism on a clipped quantity (Dwork & Roth 2014, Thm. A.1).

Statistics (Eq. 6-8's upload): each released row (mu_1..C, sigma_1..C) of one image is clipped into the box
`stats_mu_range`^C x `stats_sigma_range`^C; replacing the image moves the row by at most the box's diameter D
(PrivacySettings.stats_sensitivity), so N(0, (z_s D)^2) is added to every coordinate. The noisy row is then
clipped into the box again (post-processing: sigma stays a non-negative std for CCDT).
With `stats_release: moments` the client instead releases the sums of its k clipped rows and of their squares,
each coordinate noised with std z_s D_m (D_m the sensitivity of the stacked sums); the k rows it uploads are drawn
from a Gaussian per coordinate with the mean and variance those noisy sums give, clipped into the box
(post-processing of the noisy sums: the same privacy event; the mean's noise is z_s D_m / k, not z_s D per row).

Weights (Eq. 2's aggregate): client-level DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent
Language Models", ICLR 2018, Alg. 1 with the fixed denominator): each sampled client's update
Delta_i = w_i - w (all floating-point state-dict entries as one vector) is clipped to L2 norm S, the clipped
updates are averaged with equal weight over the m sampled clients, and N(0, (z S / m)^2) is added to every
coordinate. A noised BatchNorm running variance is clamped to a small positive floor (post-processing).
Integer buffers (BatchNorm's num_batches_tracked) keep the global value: they are not released.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math

import numpy as np
import torch

from fedccrl_core.privacy.settings import PrivacySettings

RUNNING_VAR_FLOOR = 1e-5  # BatchNorm's default eps: a noised running variance is clamped to it


def clip_rows(mu: np.ndarray, sigma: np.ndarray, s: PrivacySettings) -> tuple[np.ndarray, np.ndarray]:
    """Each row clipped into the stated box (float64)."""
    (mu_lo, mu_hi), (sigma_lo, sigma_hi) = s.stats_mu_range, s.stats_sigma_range
    return (
        np.clip(np.asarray(mu, np.float64), mu_lo, mu_hi),
        np.clip(np.asarray(sigma, np.float64), sigma_lo, sigma_hi),
    )


def stats_noise_std(s: PrivacySettings, channels: int) -> float:
    """z_s x D: the std of the noise on each coordinate of a released row."""
    return s.stats_noise_multiplier * s.stats_sensitivity(channels)


def privatize_rows(
    mu: np.ndarray, sigma: np.ndarray, s: PrivacySettings, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The released rows: clipped, noised (one draw per coordinate from `rng`), clipped into the box again.
    The dtype of the input is kept (float32 on the wire)."""
    dtype = np.asarray(mu).dtype
    cmu, csig = clip_rows(mu, sigma, s)
    std = stats_noise_std(s, cmu.shape[1])
    nmu = cmu + rng.normal(0.0, std, size=cmu.shape)
    nsig = csig + rng.normal(0.0, std, size=csig.shape)
    out_mu, out_sig = clip_rows(nmu, nsig, s)
    return out_mu.astype(dtype), out_sig.astype(dtype)


def noisy_moments(rows: np.ndarray, s: PrivacySettings, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(mean, variance) per coordinate of k clipped rows [k, 2C], from their sum and their sum of squares, each
    coordinate noised with std z_s D_m (PrivacySettings.moments_sensitivity); the variance floored at 0."""
    k, width = rows.shape
    std = s.stats_noise_multiplier * s.moments_sensitivity(width // 2)
    s1 = rows.sum(0) + rng.normal(0.0, std, size=width)
    s2 = (rows**2).sum(0) + rng.normal(0.0, std, size=width)
    mean = s1 / k
    return mean, np.maximum(s2 / k - mean**2, 0.0)


def privatize_moments(
    mu: np.ndarray, sigma: np.ndarray, s: PrivacySettings, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """k rows drawn from the noisy first and second moments of the k clipped rows (float64 inside, the input's
    dtype out): mean = S1 / k, var = max(S2 / k - mean^2, 0), S1 and S2 noised with std z_s D_m."""
    dtype = np.asarray(mu).dtype
    cmu, csig = clip_rows(mu, sigma, s)
    mean, var = noisy_moments(np.concatenate([cmu, csig], axis=1), s, rng)
    drawn = mean + np.sqrt(var) * rng.standard_normal((len(cmu), mean.size))
    out_mu, out_sig = clip_rows(drawn[:, : cmu.shape[1]], drawn[:, cmu.shape[1] :], s)
    return out_mu.astype(dtype), out_sig.astype(dtype)


def privatize(
    mu: np.ndarray, sigma: np.ndarray, s: PrivacySettings, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The statistics release that train.privacy.stats_release names."""
    return (privatize_moments if s.stats_release == "moments" else privatize_rows)(mu, sigma, s, rng)


def floating_keys(state: dict) -> list[str]:
    return sorted(k for k, v in state.items() if v.is_floating_point())


def clip_update(update: dict[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """update scaled by min(1, S / ||update||) (one L2 norm over every entry); returns it and the norm before."""
    norm = math.sqrt(float(sum((v.to(torch.float64) ** 2).sum() for v in update.values())))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: v.to(torch.float64) * scale for k, v in update.items()}, norm


class DPFedAvgAggregation:
    """One round's DP-FedAvg aggregate, fed one reply at a time like `algorithms.base.Aggregation`.

    `sampled` is m, the number of clients sampled this round (the fixed denominator: a client that drops still
    counts, so the sensitivity stays 2 S / m). `rng` draws the noise (float64, keys in sorted order): the OS's
    entropy (privacy/noise.py), given by the round loop, never the run seed."""

    def __init__(self, global_weights: dict, sampled: int, s: PrivacySettings, rng: np.random.Generator):
        if sampled < 1:
            raise ValueError("DP-FedAvg: no client sampled")
        self.global_weights, self.m, self.s, self.rng = global_weights, int(sampled), s, rng
        self.keys = floating_keys(global_weights)
        self.sum = {k: torch.zeros(global_weights[k].shape, dtype=torch.float64) for k in self.keys}
        self.client_ids: list[str] = []

    def add(self, reply) -> None:
        if reply.upload is not None:
            raise ValueError(
                f"DP-FedAvg: client {reply.client_id} uploads more than weights ({sorted(reply.upload)}); "
                "train.privacy.weights covers the weights only"
            )
        update = {
            k: reply.weights[k].detach().cpu().to(torch.float64)
            - self.global_weights[k].detach().cpu().to(torch.float64)
            for k in self.keys
        }
        clipped, _ = clip_update(update, self.s.weights_clip)
        for k in self.keys:
            self.sum[k] += clipped[k]
        self.client_ids.append(reply.client_id)

    def noise_std(self) -> float:
        return self.s.weights_noise_multiplier * self.s.weights_clip / self.m

    def result(self) -> dict:
        if not self.client_ids:
            raise ValueError("DP-FedAvg: no client update to aggregate")
        std = self.noise_std()
        out = {}
        for k, g in self.global_weights.items():
            if k not in self.sum:
                out[k] = g.clone()
                continue
            noise = torch.from_numpy(self.rng.standard_normal(tuple(self.sum[k].shape))) * std
            new = g.detach().cpu().to(torch.float64) + self.sum[k] / self.m + noise
            if k.endswith("running_var"):  # post-processing: a variance stays positive (BatchNorm divides by it)
                new = new.clamp_min(RUNNING_VAR_FLOOR)
            out[k] = new.to(dtype=g.dtype, device=g.device)
        return out
