"""The privacy trade-off table and plot of docs/privacy.md: epsilon in {inf, 8, 4, 1}, on the default data (the
shards and pools of `dvc repro`), one held-out domain, params.yaml's training settings, in-process on the CPU with
one torch thread. Four configurations: FedCCRL with DP on both channels, FedCCRL with DP on the statistics alone
(rows, then moments: train.privacy.stats_release), FedAvg (weights). For each finite epsilon the noise
multipliers are set by bisection so that the accountant (fedccrl_core/privacy/accountant.py) reaches epsilon after
train.rounds rounds; with both channels z_w = 2 z_s (the same Gaussian on both, the weights channel seeing a
sensitivity 2 S). Prints one markdown row per cell: target accuracy of the last round, the audit's membership TPR
at FPR 1 % after the last round, epsilon spent; and draws both against epsilon into the plot.
Usage:  OMP_NUM_THREADS=1 python scripts/privacy_tradeoff.py [DATA (data)] [HELD_OUT (sketch)] [PLOT.png]
                [--rounds N (params.yaml's train.rounds)] [--epsilons inf,8,4,1]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from fedccrl_core import contract
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.audit import audit
from fedccrl_core.data.shards import load_domain_test, load_manifest
from fedccrl_core.federation.client import ClientData
from fedccrl_core.federation.engine import EvalSets, InProcessEngine
from fedccrl_core.federation.jobs import load_clients
from fedccrl_core.fsio import atomic_file
from fedccrl_core.privacy import accountant as A
from fedccrl_core.privacy.settings import PrivacySettings
from pipeline.audit import load_audit_clients
from pipeline.params import load_config
from pipeline.train import run_settings

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = (float("inf"), 8.0, 4.0, 1.0)


CONFIGS = (  # (label, algorithm, statistics channel, weights channel, stats_release)
    ("FedCCRL, both channels", "fedccrl", True, True, "rows"),
    ("FedCCRL, statistics only (rows)", "fedccrl", True, False, "rows"),
    ("FedCCRL, statistics only (moments)", "fedccrl", True, False, "moments"),
    ("FedAvg, weights", "fedavg", False, True, "rows"),
)


def calibrate(target: float, stats: bool, weights: bool, release: str, rounds: int, n_clients: int,
              sizes: dict) -> dict:
    """train.privacy whose epsilon after `rounds` is `target` (bisection on z_s, z_w = 2 z_s)."""
    def settings(z):
        return PrivacySettings(enabled=True, statistics=stats, weights=weights, stats_release=release,
                               stats_noise_multiplier=z, weights_noise_multiplier=2 * z)

    def eps(z):
        s = settings(z)
        per_round = []
        if s.on_weights:
            per_round.append(A.weights_event(s, n_clients, n_clients))
        if s.on_statistics:
            per_round.append(A.statistics_event(s, sizes))
        return A.epsilon_of(per_round * rounds, s.delta)

    lo, hi = 0.05, 200.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return settings(hi).model_dump()


def _eps(e: float, spec: str) -> str:
    """An epsilon as the table prints it: no DP is the infinite epsilon, written as the symbol."""
    return "∞" if e == float("inf") else format(e, spec)


def plot(rows: list[dict], path: Path, epsilons: tuple[float, ...]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = {e: i for i, e in enumerate(sorted(epsilons))}  # 1, 4, 8, inf as evenly spaced categories
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, *_ in CONFIGS:
        mine = [r for r in rows if r["label"] == label]
        x = [xs[r["epsilon"]] for r in mine]
        axes[0].plot(x, [r["acc"] for r in mine], "o-", label=label)
        if mine[0]["tpr"] is not None:
            axes[1].plot(x, [r["tpr"] for r in mine], "o-", label=label)
    for ax, title in zip(axes, ("target accuracy, last round", "membership TPR at FPR 1 %, last round")):
        ax.set_xticks(list(xs.values()), [f"{e:g}" if e != float("inf") else "no DP" for e in xs])
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(0.01, color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:  # no half-written PNG; a link or FIFO at the path is not replaced
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def main(data: Path, held_out: str, plot_path: Path | None, rounds: int | None = None,
         epsilons: tuple[float, ...] = EPSILONS) -> None:
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "params.yaml")
    settings = run_settings(cfg)
    manifest = load_manifest(data / "shards")
    sources = [d for d in manifest["domains"] if d != held_out]
    rounds, r = rounds or cfg.train.rounds, cfg.train.fedccrl.r
    print("| configuration | epsilon target | z_s | z_w | target acc | membership TPR @ FPR 1 % | epsilon spent |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    tx, ty = load_domain_test(data / "shards", held_out)
    audit_clients = [c for c in load_audit_clients(data / "shards", data / "pools") if c.domain in sources]
    results = []
    for label, name, stats, weights, release in CONFIGS:
        clients = load_clients(data / "shards", data / "pools", sources, "cpu")
        sizes = {c.client_id: (c.n_train, int(np.ceil(r * c.n_train))) for c in clients}
        for target in epsilons:
            prior = [x for x in results if x["algorithm"] == name and x["epsilon"] == target == float("inf")]
            if prior:  # without DP the configurations of one algorithm are the same run
                results.append({**prior[0], "label": label})
                continue
            privacy = None if target == float("inf") else calibrate(target, stats, weights, release, rounds,
                                                                    len(clients), sizes)
            local = settings.local.model_copy(update={"privacy": privacy})
            ev = EvalSets(torch.cat([c.val_x for c in clients]), torch.cat([c.val_y for c in clients]),
                          ClientData.from_numpy("t", held_out, tx, ty, tx[:0], ty[:0], "cpu").train_x,
                          torch.from_numpy(np.asarray(ty, dtype=np.int64)), 256)
            alg = build_algorithm(name, local, getattr(cfg.train, name).model_dump())
            torch.manual_seed(0)
            model = alg.build_model(settings.backbone, len(manifest["classes"]), settings.pretrained, alg.hp)
            res = InProcessEngine(alg, model, clients, ev, rounds=rounds, seed=0, log=lambda m: None,
                                  client_fraction=cfg.train.client_fraction).run()
            last = res.history[-1]
            ps = PrivacySettings.from_mapping(privacy)
            tpr = None  # FedAvg releases no statistics
            if name == "fedccrl":
                tpr = audit(audit_clients, r, rounds, 0, ps)["rounds"][-1]["tpr_at_fpr_0.01"]
            results.append({"label": label, "algorithm": name, "epsilon": target, "acc": last[contract.TARGET_ACC],
                            "tpr": tpr, "spent": last.get(contract.DP_EPSILON, float("inf")),
                            "z_s": ps.stats_noise_multiplier if privacy and ps.on_statistics else 0.0,
                            "z_w": ps.weights_noise_multiplier if privacy and ps.on_weights else 0.0})
        for x in results[-len(epsilons):]:
            print(f"| {x['label']} | {_eps(x['epsilon'], 'g')} | {x['z_s']:.2f} | {x['z_w']:.2f} | {x['acc']:.3f} | "
                  f"{'-' if x['tpr'] is None else format(x['tpr'], '.3f')} | {_eps(x['spent'], '.2f')} |", flush=True)
    if plot_path is not None:
        plot(results, plot_path, epsilons)
        print(f"wrote {plot_path}", file=sys.stderr)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=ROOT / "data")
    ap.add_argument("held_out", nargs="?", default="sketch")
    ap.add_argument("plot", nargs="?", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every run (default: train.rounds)")
    ap.add_argument("--epsilons", default="inf,8,4,1", help="comma-separated targets; inf = no DP")
    a = ap.parse_args()
    try:
        eps = tuple(float(e) for e in a.epsilons.split(","))
    except ValueError:
        ap.error(f"--epsilons {a.epsilons!r}: comma-separated numbers or inf, e.g. inf,8,4,1")
    if a.rounds is not None and a.rounds < 1 or any(not e > 0 for e in eps):
        ap.error("--rounds must be >= 1 and every epsilon > 0")
    main(a.data, a.held_out, a.plot, a.rounds, eps)
