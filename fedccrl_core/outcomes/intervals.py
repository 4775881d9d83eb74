"""The 95 % interval every accuracy in fedccrl's reports carries (the model card's, `fedccrl evaluate-sites`'):
Wilson's score interval of a proportion, from its counts.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)  # the standard normal's 97.5 % quantile (1.95996...): a two-sided 95 % interval


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion p = correct / n (Wilson 1927, J. Am. Stat. Assoc. 22):
    centre = (p + z²/(2n)) / (1 + z²/n)
    half   = z / (1 + z²/n) * sqrt(p (1 - p) / n + z² / (4 n²))
    [centre - half, centre + half], clipped to [0, 1]."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: {correct} correct of {n}")
    p, z2 = correct / n, z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
