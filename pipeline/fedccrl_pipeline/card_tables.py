"""The model card's Markdown tables, and its accuracy rows: each accuracy with its count and a 95 % Wilson score
interval computed from it (fedccrl_core/outcomes/intervals.py `wilson_interval`)."""

from __future__ import annotations

from fedccrl_core.outcomes.intervals import wilson_interval


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


def count_row(what: str, correct: int, n: int) -> tuple:
    """One row of ACC_HEADER from the counts themselves."""
    if n == 0:
        return (what, "no images", 0, 0, "not computed")
    lo, hi = wilson_interval(correct, n)
    return (what, pct(correct / n), correct, n, f"{pct(lo)} – {pct(hi)}")


ACC_HEADER = ("measure", "accuracy", "correct", "images", "95 % interval (Wilson)")
