"""The model card's Markdown tables, and its accuracy rows: each accuracy with its count and a 95 % Wilson score
interval computed from it (`wilson_interval`)."""

from __future__ import annotations

import math
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)  # the two-sided 95 % normal quantile, 1.95996...


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion correct/n (Wilson 1927, J. Am. Stat. Assoc. 22, eq. for the limits of
    p): (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: {correct} correct of {n}")
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def correct_of(accuracy: float, n: int) -> int | None:
    """The count behind an accuracy measured on n images: accuracy x n, rounded (a float32 mean is off by far less
    than WHOLE); None when it is no whole count (records that disagree)."""
    k = accuracy * n
    return round(k) if abs(k - round(k)) <= WHOLE else None


WHOLE = 0.01  # how far accuracy x n may lie from a whole count


def pct(x: float) -> str:
    """A proportion as a percentage with two decimals."""
    return f"{100 * x:.2f} %"


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A Markdown table's lines, and a blank line after it."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def acc_row(what: str, accuracy: float, n: int) -> tuple:
    """One row of ACC_HEADER: the accuracy, its count and its 95 % Wilson interval."""
    k = correct_of(accuracy, n)
    if k is None:
        return (what, pct(accuracy), f"not a whole count ({accuracy:g} x {n})", n, "not computed")
    lo, hi = wilson_interval(k, n)
    return (what, pct(accuracy), k, n, f"{pct(lo)} – {pct(hi)}")


ACC_HEADER = ("measure", "accuracy", "correct", "images", "95 % interval (Wilson)")
