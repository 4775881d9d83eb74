"""The audit tables of docs/privacy.md, on the default data (the shards and pools of `dvc repro`).

First, `fedccrl audit`'s one-run canary audit of the engine's uploads (pipeline/fedccrl_pipeline/audit.py
`engine_audit`), without DP and with train.privacy at its defaults, per seed (the seed draws the canaries, their
coins and, without DP, Eq. 8's samples; with DP the sample and the noise come from the OS): guesses, correct ones,
the statistics channel's epsilon, the p-value there, the epsilon refuted.

Then the membership measurement of real images (fedccrl_core/privacy/audit.py `audit`, a replay of the engine's
draw), every client, params.yaml's train.rounds, train.fedccrl.r and upload, every client, params.yaml's train.rounds, train.fedccrl.r and upload, without DP
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
import math
from pathlib import Path

import numpy as np

from fedccrl_core.algorithm_params.fedccrl import resolve_variant
from fedccrl_core.privacy.audit import audit, release
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_pipeline.audit import engine_audit, load_audit_clients
from fedccrl_pipeline.params import load_config

ROOT = Path(__file__).resolve().parents[1]
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


def main(data: Path, seeds: tuple[int, ...]) -> None:
    cfg = load_config(ROOT / "params.yaml")
    clients = load_audit_clients(data / "shards", data / "pools")
    r, rounds = cfg.train.fedccrl.r, cfg.train.rounds
    upload = resolve_variant(cfg.train.fedccrl).upload
    settings = (("off", PrivacySettings()), ("defaults (z_s = 1)", PrivacySettings(enabled=True)))
    print(
        "| DP | seed | slots | guesses | correct | epsilon (statistics) | p-value at epsilon | epsilon refuted | verdict |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, privacy in settings:
        for seed in seeds:
            a = engine_audit(cfg, data / "shards", data / "pools", seed, privacy)
            verdict = "DP violated" if a["violated"] else ("no DP claim" if a["privacy"] is None else "consistent")
            print(
                f"| {label} | {seed} | {a['slots']} | {a['guesses']} | {a['correct']} | "
                f"{ms([a['epsilon_statistics']], '.2f').split(' ')[0]} | {a['p_value']:.3g} | "
                f"{a['epsilon_lower_bound']:.2f} | {verdict} |"
            )
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
