"""`fedccrl audit`: does the statistics upload the engine actually sends keep the DP claim? A one-run canary audit
(Steinke, Nasr, Jagielski, NeurIPS 2023; fedccrl_core/privacy/audit.py `one_run_audit`) of what the in-process
engine uploaded (fedccrl_core/federation/capture.py `capture_statistics`).

Reads params.yaml (the whole file, before any data), the shards and the pools. Every training row of every client
becomes a canary slot: it holds one of two canary rows chosen by a fair coin per slot (the sizes stay the run's).
The engine's own uploads phase (InProcessTransport.collect_uploads: FedCCRL's `client_upload`, Eq. 8, with
train.privacy's clip and noise when on) runs train.rounds rounds at train.seeds[0], and what it uploaded is
captured and accounted by the round loop's ledger. The auditor sees only those uploads, guesses the coin of the r
slots it is surest of, and counts its correct guesses. It writes
  --out    results/audit.json  slots, guesses, correct, precision with its Clopper-Pearson interval, the precision
                               (eps, delta)-DP allows (e^eps / (1 + e^eps)), the p-value at the statistics channel's
                               eps, the eps the guesses refute, and `violated`
  --table  results/audit.md    the same as a table
  --plot   results/audit.png   the guesses' scores by coin
`--mlflow-run ID` also logs them to that MLflow run. With train.privacy on, a p-value below 0.05 at the run's eps
is a failure of the DP claim: the outputs are written, the failure is printed, and the command exits with status 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import click

from fedccrl_core.foundation.fsio import atomic_file, write_text
from fedccrl_pipeline.stage_runtime import run_stage


def _num(x: float, fmt: str = ".3f") -> str:
    return "∞" if not math.isfinite(x) else format(x, fmt)


def table(result: dict) -> list[str]:
    a = result
    lines = [
        "| rounds | slots m | guesses r | correct v | precision v / r [95 % CI] | DP allows e^eps / (1 + e^eps) | "
        "epsilon (statistics) | p-value at epsilon | epsilon refuted (95 %) | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {a['rounds']} | {a['slots']} | {a['guesses']} | {a['correct']} | {a['precision']:.3f} "
        f"[{a['precision_lo']:.3f}, {a['precision_hi']:.3f}] | {a['precision_bound']:.4f} | "
        f"{_num(a['epsilon_statistics'], '.2f')} | {a['p_value']:.3g} | {_num(a['epsilon_lower_bound'], '.2f')} | "
        + ("**DP violated**" if a["violated"] else ("no DP claim" if a["privacy"] is None else "consistent"))
        + " |",
        "",
        f"Canary slots: every training row of the {a['clients']} clients; each holds one of two rows by a fair coin. "
        f"The engine's uploads of {a['rounds']} rounds (r = {a['r']}, upload {a['upload']}, seed {a['seed']}, noise: "
        f"{a['noise']}) were captured; the auditor guessed the coin of the {a['guesses']} slots whose nearest "
        "released rows favour one canary most (r fixed before the release: "
        f"{a['guess_share']} of the slots expected to be released). One-run audit (Steinke et al. 2023), "
        f"level {a['alpha']}, delta {a['delta']:g}.",
        "privacy: " + ("off" if not a["privacy"] else json.dumps(a["privacy"], sort_keys=True)),
    ]
    if a["violated"]:
        lines.append("FAILURE: the guesses are more accurate than the statistics channel's epsilon allows")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = np.asarray(result["scores"])
    coin = np.asarray(result["coins"], bool)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    bins = [float(x) for x in np.linspace(-30, 30, 61)]  # scores clipped to +-30 (an exact row: about +-15)
    ax.hist(np.clip(s[coin], -30, 30), bins=bins, alpha=0.6, label="coin: plus")
    ax.hist(np.clip(s[~coin], -30, 30), bins=bins, alpha=0.6, label="coin: minus")
    ax.set_xlabel("log(d_minus / d_plus)")
    ax.set_ylabel("slots")
    ax.set_title(f"{result['correct']} of {result['guesses']} guesses correct")
    ax.legend(fontsize=8)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def load_audit_clients(shards: Path, pools: Path):
    """Every client's statistics (the pools) and domain (the shards' manifest), for the membership measurement of
    fedccrl_core/privacy/audit.py `audit` (scripts/privacy_audit.py)."""
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.privacy.audit import Client

    manifest = load_manifest(shards)
    out = []
    for entry in manifest.clients:
        mu, sigma = load_pool(pools, entry.id)
        out.append(Client(entry.id, entry.domain, mu, sigma, manifest.image_size**2))
    return out


def engine_audit(cfg, shards: Path, pools: Path, seed: int | None = None, privacy=None) -> dict:
    """The canary audit of the statistics the in-process engine uploads (the module's docstring), at `seed`
    (default train.seeds[0]: the canaries, their coins and, without DP, Eq. 8's draws) and `privacy` (default
    train.privacy)."""
    import numpy as np

    from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams
    from fedccrl_core.algorithms.fedccrl import FedCCRL
    from fedccrl_core.data.pools import unbiased_sigma
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.federation.capture import capture_statistics
    from fedccrl_core.federation.jobs import load_clients
    from fedccrl_core.federation.loop import privacy_of
    from fedccrl_core.foundation.seeding import numpy_rng
    from fedccrl_core.privacy.audit import GUESS_SHARE, canary_scores, make_canaries, one_run_audit, planned_guesses

    hp = FedCCRL.validated(cfg.train.fedccrl)  # FedCCRL's variant read (its upload rounding)
    assert isinstance(hp, FedCCRLParams)
    seed = cfg.train.seeds[0] if seed is None else seed
    s = cfg.train.privacy if privacy is None else privacy
    alg = FedCCRL(cfg.local.model_copy(update={"privacy": s if s.enabled else None}), hp)
    privacy_of(alg)  # a setting the round loop refuses is refused here too, before any data is read
    rounds = cfg.train.rounds
    clients = load_clients(shards, pools, list(load_manifest(shards).domains), "cpu")
    channels = clients[0].stats_mu.shape[1]
    canaries = make_canaries({c.client_id: c.n_train for c in clients}, channels, s, numpy_rng(seed, "audit-canaries"))
    placed = []
    for c in clients:
        held = canaries.rows_of(c.client_id)
        placed.append(dataclasses.replace(c, stats_mu=held[:, :channels], stats_sigma=held[:, channels:]))
    hw = {c.client_id: c.image_hw[0] * c.image_hw[1] for c in clients}

    def as_uploaded(rows: np.ndarray) -> np.ndarray:  # the sigma FedCCRL's upload sends (floor_unbiased: unbiased)
        out = rows.astype(np.float64)
        if hp.upload != "ceil":
            for cid, pixels in hw.items():
                at = canaries.client == cid
                out[at, channels:] = unbiased_sigma(rows[at, channels:], pixels)
        return out

    r = planned_guesses({c.client_id: (c.n_train, alg.released_rows(c.n_train)) for c in placed}, rounds)
    cap = capture_statistics(alg, placed, seed, rounds)
    scores = canary_scores(as_uploaded(canaries.plus), as_uploaded(canaries.minus), canaries.client, cap.rows)
    result = one_run_audit(canaries, scores, r, cap.epsilon, s.delta)
    result.update(
        rounds=rounds,
        clients=len(clients),
        r=hp.r,
        upload=hp.upload,
        seed=seed,
        guess_share=GUESS_SHARE,
        noise=s.noise_source() if s.enabled else "off",
        privacy=s.model_dump() if s.enabled else None,
        scores=[float(x) for x in scores],
        coins=[bool(x) for x in canaries.coin],
    )
    return result


def run_audit(
    shards: Path,
    pools: Path,
    out: Path,
    table_out: Path,
    plot_out: Path,
    params_path: Path,
    mlflow_run: str | None = None,
) -> dict:
    from fedccrl_pipeline.params import load_config

    cfg = load_config(params_path)  # the whole file, before any data is read
    result = engine_audit(cfg, shards, pools)
    lines = table(result)
    write_text(out, json.dumps(result, indent=1))
    write_text(table_out, "\n".join(lines) + "\n")
    plot(result, plot_out)
    print("\n".join(lines), file=sys.stderr)
    if mlflow_run:
        from fedccrl_pipeline.tracking import mlflow_module

        client = mlflow_module().MlflowClient()
        client.set_tag(mlflow_run, "audit.noise", result["noise"])
        for k, v in result.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                client.log_metric(mlflow_run, f"audit/{k}", float(v))
        client.log_metric(mlflow_run, "audit/violated", float(result["violated"]))
        for f in (out, table_out, plot_out):
            client.log_artifact(mlflow_run, str(f), artifact_path="audit")
    if result["violated"]:
        click.echo(
            f"error: the canary audit's guesses are more accurate than epsilon {result['epsilon_statistics']:.3f} "
            f"allows (p-value {result['p_value']:.3g}): the DP claim fails (see {table_out})",
            err=True,
        )
        sys.exit(1)
    return result


@click.command("audit")
@click.option("--shards", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--pools", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/audit.json"), show_default=True)
@click.option(
    "--table", "table_out", type=click.Path(path_type=Path), default=Path("results/audit.md"), show_default=True
)
@click.option(
    "--plot", "plot_out", type=click.Path(path_type=Path), default=Path("results/audit.png"), show_default=True
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--mlflow-run", default=None, help="an MLflow run id to log the audit to")
def command(shards, pools, out, table_out, plot_out, params_path, mlflow_run):
    """One-run canary audit of the statistics the engine uploads: exits 1 when they beat the DP claim."""
    run_stage(run_audit, shards, pools, out, table_out, plot_out, params_path, mlflow_run)
