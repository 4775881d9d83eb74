"""The audit tables of docs/privacy.md, on the default data (the shards and pools of `dvc repro`).

First, `fedccrl audit`'s one-run canary audit of the engine's uploads (pipeline/fedccrl_pipeline/audit.py
`engine_audit`, its default copies) on the mechanism as it is and with the faults of tests/audit_faults.py
injected into privacy/dp.py in this process (the rows' noise cut to 1/2 .. 1/30, the first clip skipped, the moment
sums released exactly): without DP, with train.privacy at its defaults (rows), and with stats_release moments, per
seed (the seed draws the coins and, without DP, Eq. 8's samples; with DP the sample and the noise come from the
OS). Per row: the eps the mechanism really has (the accountant at the cut noise; inf where a clip or the noise is
gone), the claimed eps, guesses and correct ones, the eps lower bound, the reach, the verdict.

Then the membership measurement of real images (fedccrl_core/privacy/audit.py `audit`, a replay of the engine's
draw), every client, params.yaml's train.rounds, train.fedccrl.r and upload, without DP
and with train.privacy at its defaults (enabled, z_s = 1), over several seeds (the seed draws Eq. 8's samples
without DP and splits members and non-members into reference, calibration and evaluation sets; with DP the sample
and the noise come from the OS). Prints, per setting and round, mean ± std over the seeds of: the released share,
the statistics channel's epsilon, each attack's TPR at FPR 1 % (threshold from the calibration split), the FPR
measured on the evaluation split, the bound e^eps FPR_hi + delta, AUC; then round 1's attribution accuracy, and
how many (seed, round, attack) cells have a TPR interval above the bound; and, for a range of z_s, the share of the
released coordinates that the rows mechanism puts on a face of the clipping box (mu, sigma).
Usage:  OMP_NUM_THREADS=1 python scripts/privacy_audit.py [DATA (data)] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import numpy as np

from fedccrl_core.algorithm_params.fedccrl import resolve_variant
from fedccrl_core.privacy.audit import audit, release, statistics_epsilon
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_pipeline.audit import engine_audit, load_audit_clients
from fedccrl_pipeline.params import load_config

ROOT = Path(__file__).resolve().parents[1]


def _test_faults():
    """tests/audit_faults.py, loaded from its file: the faults are the tests' (test-only: no switch of the product)."""
    spec = importlib.util.spec_from_file_location("audit_faults", ROOT / "tests" / "audit_faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


injected = _test_faults().injected

# (label, train.privacy, fault, the noise divisor: the true eps is the accountant's at z_s / divisor; 0: unbounded)
CASES = (
    ("off", {}, None, 1),
    ("defaults (rows, z_s = 1)", {"enabled": True}, None, 1),
    ("rows, noise cut to 1/2", {"enabled": True}, "noise/2", 2),
    ("rows, noise cut to 1/4", {"enabled": True}, "noise/4", 4),
    ("rows, noise cut to 1/10", {"enabled": True}, "noise/10", 10),
    ("rows, noise cut to 1/30", {"enabled": True}, "noise/30", 30),
    ("rows, first clip skipped", {"enabled": True}, "skipped clip", 0),
    ("moments", {"enabled": True, "stats_release": "moments"}, None, 1),
    ("moments, sums without noise", {"enabled": True, "stats_release": "moments"}, "moments exact", 0),
)
FACE_Z = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.07,
    2.76,
    4.0,
    13.07,
)  # 2.07, 13.07: the trade-off's z_s at eps 8, 1; 2.76: eps 1 on the statistics alone


def ms(xs: list[float], spec: str = ".3f") -> str:
    """mean ± std (ddof 1) over the seeds; ∞ for an infinite epsilon; '-' for nothing."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if any(math.isinf(x) for x in xs):
        return "∞"
    return f"{np.mean(xs):{spec}} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0.0:{spec}}"


def canary_table(cfg, data: Path, clients: list, seeds: tuple[int, ...]) -> None:
    """One row per mechanism (CASES) and seed: the canary audit of what the engine uploaded."""
    r, rounds, upload = cfg.train.fedccrl.r, cfg.train.rounds, resolve_variant(cfg.train.fedccrl).upload
    print(
        "| mechanism | epsilon it has | epsilon claimed | seed | slots | guesses | correct | epsilon lower bound | "
        "epsilon reach | verdict |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, settings, fault, divisor in CASES:
        privacy = PrivacySettings(**settings)
        true = math.inf
        if privacy.enabled and divisor:  # the accountant at the noise the faulty mechanism really adds
            cut = privacy.model_copy(update={"stats_noise_multiplier": privacy.stats_noise_multiplier / divisor})
            true = statistics_epsilon(clients, r, rounds, cut, upload)
        for seed in seeds:
            with injected(fault):
                a = engine_audit(cfg, data / "shards", data / "pools", seed, privacy)
            print(
                f"| {label} | {eps_text(true, '.2f')} | {eps_text(a.epsilon_statistics, '.2f')} | {seed} | "
                f"{a.slots} | {a.guesses} | {a.correct} | {a.epsilon_lower_bound:.2f} | "
                f"{a.epsilon_reach:.2f} | {a.verdict()} |"
            )


def eps_text(x: float, spec: str) -> str:
    return "∞" if math.isinf(x) else format(x, spec)


def main(data: Path, seeds: tuple[int, ...]) -> None:
    cfg = load_config(ROOT / "params.yaml")
    clients = load_audit_clients(data / "shards", data / "pools")
    r, rounds = cfg.train.fedccrl.r, cfg.train.rounds
    upload = resolve_variant(cfg.train.fedccrl).upload
    settings = (("off", PrivacySettings()), ("defaults (z_s = 1)", PrivacySettings(enabled=True)))
    canary_table(cfg, data, clients, seeds)
    print()
    print(
        f"{len(clients)} clients of {', '.join(str(len(c.mu)) for c in clients)} images, r = {r}, upload "
        f"{upload}, {rounds} rounds, seeds {','.join(map(str, seeds))}; DP noise from the OS"
    )
    print(
        "| DP | round | released share | epsilon (statistics) | nearest: TPR @ FPR 1 % | LR: TPR @ FPR 1 % | "
        "FPR (LR, evaluation) | bound e^eps FPR_hi + delta | AUC nearest | AUC LR |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tails = []
    for label, privacy in settings:
        runs = [audit(clients, r, rounds, seed, privacy, upload) for seed in seeds]
        for t in range(rounds):
            recs = [run["rounds"][t] for run in runs]

            def col(key, recs=recs):
                return [rec.get(key) for rec in recs]

            fpr_key = "lr/fpr@0.01" if "lr/auc" in recs[0] else "nearest/fpr@0.01"
            bound_key = "lr/bound@0.01" if "lr/auc" in recs[0] else "nearest/bound@0.01"
            print(
                f"| {label} | {t + 1} | {ms(col('released_share'))} | {ms(col('epsilon_statistics'), '.2f')} | "
                f"{ms(col('nearest/tpr@0.01'))} | {ms(col('lr/tpr@0.01'))} | {ms(col(fpr_key))} | "
                f"{ms(col(bound_key))} | {ms(col('nearest/auc'))} | {ms(col('lr/auc'))} |"
            )
        att = [run["attribution"] for run in runs]
        above = sum(v for run in runs for rec in run["rounds"] for k, v in rec.items() if "/violated@" in k)
        tails.append(
            f"DP {label}: attribution of round 1's rows: domain {ms([a['domain_accuracy'] for a in att])} "
            f"(chance {att[0]['domain_chance']:.3f}), client {ms([a['client_accuracy'] for a in att])} "
            f"(chance {att[0]['client_chance']:.3f}); TPR intervals above the bound: {above}; evaluation "
            f"split {runs[0]['rounds'][0]['members']} members, {runs[0]['rounds'][0]['non_members']} "
            "non-members"
        )
    print("", *tails, sep="\n")
    print("\n| z_s | noise std per coordinate | mu on a face of the box | sigma on a face of the box |")
    print("|---:|---:|---:|---:|")
    for z in FACE_Z:
        p = PrivacySettings(enabled=True, stats_noise_multiplier=z)
        rows = np.concatenate([release(c, r, 0, 1, p, upload)[0] for c in clients])
        lo = np.r_[[p.stats_mu_range[0]] * 3, [p.stats_sigma_range[0]] * 3]
        hi = np.r_[[p.stats_mu_range[1]] * 3, [p.stats_sigma_range[1]] * 3]
        face = (rows <= lo + 1e-6 * np.maximum(1, np.abs(lo))) | (rows >= hi - 1e-6 * np.maximum(1, np.abs(hi)))
        print(f"| {z:g} | {z * p.stats_sensitivity(3):.2f} | {face[:, :3].mean():.3f} | {face[:, 3:].mean():.3f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=ROOT / "data")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each cell is their mean ± std")
    a = ap.parse_args()
    try:
        seeds = tuple(int(x) for x in a.seeds.split(","))
    except ValueError:
        ap.error(f"--seeds {a.seeds!r}: comma-separated integers, e.g. 0,1,2")
    main(a.data, seeds)
