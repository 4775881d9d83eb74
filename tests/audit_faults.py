"""Faults of the statistics mechanism (fedccrl_core/privacy/dp.py) that `fedccrl audit` must catch: test-only, each
injected by replacing dp.py's module functions in this process (pytest's monkeypatch, or `injected` below for
scripts/privacy_audit.py). No params key or command-line switch weakens the mechanism.

  noise/<d>      the rows' noise std cut to 1/d of z_s D (the first and second clip kept)
  skipped clip   the rows noised without the first clip (the second, post-processing, kept)
  moments exact  stats_release moments: the sums of the rows and of their squares released without noise
"""

from __future__ import annotations

import contextlib

import numpy as np

import fedccrl_core.privacy.dp as dp

STATS_NOISE_STD = dp.stats_noise_std


def noise_cut(divisor: float):
    return {"stats_noise_std": lambda s, channels: STATS_NOISE_STD(s, channels) / divisor}


def _no_first_clip(mu, sigma, s, rng):
    dtype = np.asarray(mu).dtype
    std = dp.stats_noise_std(s, np.asarray(mu).shape[1])
    nmu = np.asarray(mu, np.float64) + rng.normal(0.0, std, size=np.shape(mu))
    nsig = np.asarray(sigma, np.float64) + rng.normal(0.0, std, size=np.shape(sigma))
    out_mu, out_sig = dp.clip_rows(nmu, nsig, s)
    return out_mu.astype(dtype), out_sig.astype(dtype)


def _exact_moments(rows, s, rng):
    mean = rows.mean(0)
    return mean, np.maximum((rows**2).mean(0) - mean**2, 0.0)


FAULTS = {
    "noise/2": noise_cut(2),
    "noise/4": noise_cut(4),
    "noise/10": noise_cut(10),
    "noise/30": noise_cut(30),
    "skipped clip": {"privatize_rows": _no_first_clip},
    "moments exact": {"noisy_moments": _exact_moments},
}


def inject(monkeypatch, fault: str) -> None:
    """The fault in dp.py for one test (pytest's monkeypatch undoes it)."""
    for name, fn in FAULTS[fault].items():
        monkeypatch.setattr(dp, name, fn)


@contextlib.contextmanager
def injected(fault: str | None):
    """The fault in dp.py inside the block (None: the intact mechanism)."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for name, fn in FAULTS[fault].items() if fault is not None else ():
            stack.enter_context(mock.patch.object(dp, name, fn))
        yield
