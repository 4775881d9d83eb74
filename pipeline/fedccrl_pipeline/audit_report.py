"""`fedccrl audit`'s report (pipeline/fedccrl_pipeline/audit.py) of a one-run canary audit (Steinke, Nasr, Jagielski,
NeurIPS 2023; its record: fedccrl_core/privacy/canary_audit.py `CanaryAudit`): its Markdown table with the verdict,
and the plot of the guesses' scores by coin."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_core.privacy.canary_audit import CanaryAudit


def _num(x: float, fmt: str = ".3f") -> str:
    return "∞" if not math.isfinite(x) else format(x, fmt)


def table(a: CanaryAudit) -> list[str]:
    """The audit's Markdown table and what it means, a FAILURE or WARNING line when there is one."""
    lines = [
        "| rounds | attack | slots m | guesses r | correct v | precision v / r [95 % CI] | DP allows e^eps / (1 + e^eps) | "
        "epsilon claimed (statistics) | p-value at epsilon | epsilon lower bound (95 %) | epsilon reach | verdict |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {a.rounds} | {a.attack} | {a.slots} | {a.guesses} | {a.correct} | {a.precision:.3f} "
        f"[{a.precision_lo:.3f}, {a.precision_hi:.3f}] | {a.precision_bound:.4f} | "
        f"{_num(a.epsilon_statistics, '.2f')} | {a.p_value:.3g} | {_num(a.epsilon_lower_bound, '.2f')} | "
        f"{_num(a.epsilon_reach, '.2f')} | **{a.verdict()}** |",
        "",
        f"Canaries: {a.copies} copies of the {a.clients} clients (their sizes), each holding {a.slots_per_client} "
        "canary slots outside the clipping box and fillers; each slot holds one of two rows by a fair coin. The "
        f"engine's uploads of {a.rounds} rounds (r = {a.r}, upload {a.upload}, seed {a.seed}, noise: "
        f"{a.noise}) were captured; the auditor ({a.attack} attack) guessed the coin of the {a.guesses} "
        f"slots it scored highest (r fixed before the release: {a.guess_share} of the slots expected to be "
        f"released). One-run audit (Steinke et al. 2023), level {a.alpha}, delta {a.delta:g}: the DP claim "
        "fails when the epsilon lower bound exceeds the claimed epsilon; the reach is the bound r correct of r give.",
        "privacy: " + ("off" if not a.privacy else json.dumps(a.privacy, sort_keys=True)),
    ]
    if a.violated:
        lines.append("FAILURE: the guesses are more accurate than the statistics channel's epsilon allows")
    elif a.privacy is not None and not a.testable:
        lines.append("WARNING: the claimed epsilon is beyond this audit's reach; use more --copies to test it")
    return lines


def plot(result: CanaryAudit, path: Path) -> None:
    """The histogram of the guesses' scores by coin, written as a PNG to `path` (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = np.clip(np.asarray(result.scores), -10, 10)  # scores count rows or rounds
    coin = np.asarray(result.coins, bool)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    bins = [float(x) for x in np.arange(-10.5, 11.0)]
    ax.hist(s[coin], bins=bins, alpha=0.6, label="coin: plus")
    ax.hist(s[~coin], bins=bins, alpha=0.6, label="coin: minus")
    ax.set_xlabel(f"{result.attack} score (plus minus minus)")
    ax.set_ylabel("slots")
    ax.set_title(f"{result.correct} of {result.guesses} guesses correct")
    ax.legend(fontsize=8)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
