"""The privacy trade-off table and plot of docs/privacy.md: epsilon in {inf, 8, 4, 1}, on the default data (the
shards and pools of `dvc repro`), one held-out domain, params.yaml's training settings, in-process on the CPU with
one torch thread, over several seeds. Three configurations, each with DP on every channel it releases (a channel
left unnoised is refused): FedCCRL (statistics and weights) with the statistics released as rows, then as moments
(train.privacy.stats_release), and FedAvg (weights). For each finite epsilon the noise multipliers are set by
bisection so that the accountant (fedccrl_core/privacy/accountant.py) reaches epsilon after train.rounds rounds;
with both channels z_w = 2 z_s (the same Gaussian on both, the weights channel seeing a sensitivity 2 S).
The noise comes from the OS (privacy/noise.py): a DP cell is not bit-reproducible, hence mean +- std over seeds.
Prints one markdown row per cell: target accuracy of the last round, the audit's likelihood-ratio membership TPR at
FPR 1 % after the last round (fedccrl audit, rows release only; the nearest-row score for moments) with the bound
e^eps FPR + delta of the statistics channel's epsilon, epsilon spent; and draws accuracy and TPR against epsilon.
Usage:  OMP_NUM_THREADS=1 python scripts/privacy_tradeoff.py [DATA (data)] [HELD_OUT (sketch)] [PLOT.png]
                [--rounds N (params.yaml's train.rounds)] [--epsilons inf,8,4,1] [--seeds 0,1,2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from fedccrl_core.algorithm_params.fedccrl import resolve_variant
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.federation.driver import RunData, held_out_run, load_clients, train
from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_core.privacy import accountant as A
from fedccrl_core.privacy.audit import audit
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_pipeline.audit import load_audit_clients
from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.training import run_settings

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = (float("inf"), 8.0, 4.0, 1.0)
SEEDS = (0, 1, 2)


CONFIGS = (  # (label, algorithm, statistics channel, weights channel, stats_release)
    ("FedCCRL, both channels (rows)", "fedccrl", True, True, "rows"),
    ("FedCCRL, both channels (moments)", "fedccrl", True, True, "moments"),
    ("FedAvg, weights", "fedavg", False, True, "rows"),
)


def calibrate(
    target: float, stats: bool, weights: bool, release: str, rounds: int, n_clients: int, sizes: dict
) -> dict:
    """train.privacy whose epsilon after `rounds` is `target` (bisection on z_s, z_w = 2 z_s)."""

    def settings(z):
        return PrivacySettings(
            enabled=True,
            statistics=stats,
            weights=weights,
            stats_release=release,
            stats_noise_multiplier=z,
            weights_noise_multiplier=2 * z,
        )

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


def _ms(xs: list, spec: str = ".3f") -> str:
    """mean ± std (sample std, ddof 1) over the seeds; '-' when there is nothing to average."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{np.mean(xs):{spec}} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0.0:{spec}}"


def plot(rows: list[dict], path: Path, epsilons: tuple[float, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = {e: i for i, e in enumerate(sorted(epsilons))}  # 1, 4, 8, inf as evenly spaced categories
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, *_ in CONFIGS:
        mine = [r for r in rows if r["label"] == label]
        x = [xs[r["epsilon"]] for r in mine]
        axes[0].errorbar(
            x,
            [np.mean(r["acc"]) for r in mine],
            [np.std(r["acc"], ddof=1) for r in mine],
            fmt="o-",
            capsize=3,
            label=label,
        )
        if mine[0]["tpr"][0] is not None:
            axes[1].errorbar(
                x,
                [np.mean(r["tpr"]) for r in mine],
                [np.std(r["tpr"], ddof=1) for r in mine],
                fmt="o-",
                capsize=3,
                label=label,
            )
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


def one_run(
    cfg,
    settings,
    manifest,
    data: Path,
    held_out: str,
    name: str,
    privacy: dict | None,
    rounds: int,
    seed: int,
    audit_clients: list,
    upload: str,
) -> tuple[float, float | None, float, float | None]:
    """(target accuracy of the last round, the audit's TPR at FPR 1 %, epsilon spent, the audit's bound)."""
    run_data = RunData.load(data / "shards", data / "pools", held_out, "cpu")
    ps = PrivacySettings.from_mapping(privacy)  # train.privacy, validated once here (privacy None: off)
    local = settings.local.model_copy(update={"privacy": ps if privacy else None})
    alg = build_algorithm(name, local, getattr(cfg.train, name).model_dump())
    run = held_out_run(
        alg,
        run_data,
        settings.backbone,
        len(manifest.classes),
        settings.pretrained,
        seed,
        "cpu",
        rounds,
        client_fraction=cfg.train.client_fraction,
    )
    res = train(run, log=lambda m: None)
    last = res.history[-1]
    tpr = bnd = None  # FedAvg releases no statistics
    if name == "fedccrl":
        rec = audit(audit_clients, cfg.train.fedccrl.r, rounds, seed, ps, upload)["rounds"][-1]
        attack = "lr" if "lr/auc" in rec else "nearest"
        tpr, bnd = rec[f"{attack}/tpr@0.01"], rec[f"{attack}/bound@0.01"]
    eps = last.dp_epsilon
    return last.target_acc, tpr, float("inf") if eps is None else eps, bnd


def main(
    data: Path,
    held_out: str,
    plot_path: Path | None,
    rounds: int | None = None,
    epsilons: tuple[float, ...] = EPSILONS,
    seeds: tuple[int, ...] = SEEDS,
) -> None:
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "params.yaml")
    settings = run_settings(cfg)
    manifest = load_manifest(data / "shards")
    sources = [d for d in manifest.domains if d != held_out]
    rounds, r = rounds or cfg.train.rounds, cfg.train.fedccrl.r
    upload = resolve_variant(cfg.train.fedccrl).upload
    print(f"seeds {','.join(map(str, seeds))}; DP noise from the OS: a DP cell is not bit-reproducible")
    print(
        "| configuration | epsilon target | z_s | z_w | target acc | membership TPR @ FPR 1 % | "
        "bound e^eps FPR + delta | epsilon spent |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    audit_clients = [c for c in load_audit_clients(data / "shards", data / "pools") if c.domain in sources]
    results = []
    for label, name, stats, weights, release in CONFIGS:
        clients = load_clients(data / "shards", data / "pools", sources, "cpu")
        sizes = {c.client_id: (c.n_train, int(np.ceil(r * c.n_train))) for c in clients} if stats else {}
        for target in epsilons:
            prior = [x for x in results if x["algorithm"] == name and x["epsilon"] == target == float("inf")]
            if prior:  # without DP the configurations of one algorithm are the same runs
                results.append({**prior[0], "label": label})
                continue
            privacy = (
                None
                if target == float("inf")
                else calibrate(target, stats, weights, release, rounds, len(clients), sizes)
            )
            runs = [
                one_run(cfg, settings, manifest, data, held_out, name, privacy, rounds, seed, audit_clients, upload)
                for seed in seeds
            ]
            ps = PrivacySettings.from_mapping(privacy)
            results.append(
                {
                    "label": label,
                    "algorithm": name,
                    "epsilon": target,
                    "acc": [x[0] for x in runs],
                    "tpr": [x[1] for x in runs],
                    "spent": runs[0][2],
                    "bound": [x[3] for x in runs],
                    "z_s": ps.stats_noise_multiplier if privacy and ps.on_statistics else 0.0,
                    "z_w": ps.weights_noise_multiplier if privacy and ps.on_weights else 0.0,
                }
            )
        for x in results[-len(epsilons) :]:
            print(
                f"| {x['label']} | {_eps(x['epsilon'], 'g')} | {x['z_s']:.2f} | {x['z_w']:.2f} | {_ms(x['acc'])} | "
                f"{_ms(x['tpr'])} | {_ms(x['bound'])} | {_eps(x['spent'], '.2f')} |",
                flush=True,
            )
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
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each cell is their mean ± std")
    a = ap.parse_args()
    try:
        eps = tuple(float(e) for e in a.epsilons.split(","))
        seeds = tuple(int(x) for x in a.seeds.split(","))
    except ValueError:
        ap.error(
            f"--epsilons {a.epsilons!r} / --seeds {a.seeds!r}: comma-separated numbers (inf allowed for "
            "epsilons), e.g. inf,8,4,1 and 0,1,2"
        )
    if (a.rounds is not None and a.rounds < 1) or any(not e > 0 for e in eps) or not seeds:
        ap.error("--rounds must be >= 1, every epsilon > 0, and at least one seed")
    main(a.data, a.held_out, a.plot, a.rounds, eps, seeds)
