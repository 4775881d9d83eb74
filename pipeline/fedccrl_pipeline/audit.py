"""`fedccrl audit`: what FedCCRL's statistics upload reveals, measured (fedccrl_core/privacy/audit.py).

Reads the clients' statistics (pools stage) and their domains (the shards' manifest), replays the uploads of
train.rounds rounds at train.seeds[0] with train.fedccrl.r and train.fedccrl.upload (and train.privacy when on),
and writes
  --out    results/audit.json  one record per round (released share, the statistics channel's epsilon, and per
                               attack, nearest-row and likelihood-ratio, TPR and FPR at FPR 0.1 % and 1 % on the
                               evaluation split with Clopper-Pearson intervals, the bound e^eps FPR + delta, AUC)
                               and the attribution of round 1's rows to their domain and client, against chance
  --table  results/audit.md    the same as a table
  --plot   results/audit.png   membership TPR and the released share over the rounds
`--mlflow-run ID` also logs them to that MLflow run (metrics per round as steps, the files as artifacts).
With train.privacy on, a TPR whose interval lies above the bound is a failure of the DP claim: the outputs are
written, the failure is printed, and the command exits with status 1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from fedccrl_core.foundation.fsio import atomic_file, write_text
from fedccrl_pipeline.stage_runtime import run_stage


def load_audit_clients(shards: Path, pools: Path):
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.privacy.audit import Client

    manifest = load_manifest(shards)
    out = []
    for entry in manifest.clients:
        mu, sigma = load_pool(pools, entry.id)
        out.append(Client(entry.id, entry.domain, mu, sigma, manifest.image_size**2))
    return out


def _rate(rec: dict, attack: str, what: str, f: float) -> str:
    """'0.012 [0.003, 0.030]': a rate on the evaluation split with its Clopper-Pearson interval."""
    k = f"{attack}/{what}"
    return f"{rec[f'{k}@{f:g}']:.3f} [{rec[f'{k}_lo@{f:g}']:.3f}, {rec[f'{k}_hi@{f:g}']:.3f}]"


def table(result: dict) -> list[str]:
    from fedccrl_core.privacy.audit import ATTACKS

    att = result["attribution"]
    lines = [
        "| round | released share | 1 - (1 - r)^t | epsilon (statistics) | attack | TPR @ FPR 0.1 % | "
        "TPR @ FPR 1 % [95 % CI] | FPR [95 % CI] | bound e^eps FPR + delta | AUC |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rec in result["rounds"]:
        eps = rec["epsilon_statistics"]
        for attack in (a for a in ATTACKS if f"{a}/auc" in rec):
            over = " **above: DP violated**" if rec[f"{attack}/violated@0.01"] else ""
            lines.append(
                f"| {rec['round']} | {rec['released_share']:.3f} | {rec['expected_share']:.3f} | "
                f"{'∞' if not math.isfinite(eps) else format(eps, '.2f')} | {attack} | "
                f"{rec[f'{attack}/tpr@0.001']:.3f} | {_rate(rec, attack, 'tpr', 0.01)} | "
                f"{_rate(rec, attack, 'fpr', 0.01)} | {rec[f'{attack}/bound@0.01']:.3f}{over} | "
                f"{rec[f'{attack}/auc']:.3f} |"
            )
    last = result["rounds"][-1]
    lines += [
        "",
        f"Attribution of round 1's {att['rows']} released rows (5-NN, 5-fold): domain "
        f"{att['domain_accuracy']:.3f} (chance {att['domain_chance']:.3f}), client "
        f"{att['client_accuracy']:.3f} (chance {att['client_chance']:.3f}).",
        f"Evaluation split: {last['members']} members, {last['non_members']} non-members; thresholds from a "
        "separate calibration split. The bound uses the upper end of the FPR's interval.",
        f"r = {result['r']}, upload {result['upload']}, seed {result['seed']}, noise: {result['noise']}, "
        "privacy: " + ("off" if not result["privacy"] else json.dumps(result["privacy"], sort_keys=True)),
    ]
    if result["violated"]:
        lines.append("FAILURE: a membership TPR lies above what the release's epsilon allows")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedccrl_core.privacy.audit import ATTACKS

    recs = result["rounds"]
    rounds = [r["round"] for r in recs]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(rounds, [r["released_share"] for r in recs], "k-", label="released share")
    ax.plot(rounds, [r["expected_share"] for r in recs], "k:", label="1 - (1 - r)^t")
    for attack, style in zip(ATTACKS, ("o-", "s--")):
        if f"{attack}/auc" in recs[0]:
            ax.plot(rounds, [r[f"{attack}/tpr@0.01"] for r in recs], style, label=f"TPR @ FPR 1 % ({attack})")
    if math.isfinite(recs[0]["epsilon_statistics"]):
        ax.plot(
            rounds,
            [r["lr/bound@0.01" if "lr/bound@0.01" in r else "nearest/bound@0.01"] for r in recs],
            "r-.",
            label="bound e^eps FPR + delta",
        )
    ax.set_xlabel("round")
    ax.set_ylim(0, 1.02)
    ax.set_title("membership from the released statistics")
    ax.legend(fontsize=8)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


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
    from fedccrl_core.algorithm_params.fedccrl import resolve_variant
    from fedccrl_core.privacy.audit import audit

    upload = resolve_variant(cfg.train.fedccrl).upload
    result = audit(
        load_audit_clients(shards, pools),
        cfg.train.fedccrl.r,
        cfg.train.rounds,
        cfg.train.seeds[0],
        cfg.train.privacy,
        upload,
    )
    write_text(out, json.dumps(result, indent=1))
    lines = table(result)
    write_text(table_out, "\n".join(lines) + "\n")
    plot(result, plot_out)
    print("\n".join(lines), file=sys.stderr)
    if mlflow_run:
        from fedccrl_pipeline.tracking import mlflow_module

        client = mlflow_module().MlflowClient()
        client.set_tag(mlflow_run, "audit.noise", result["noise"])
        for rec in result["rounds"]:
            for k, v in rec.items():
                if k != "round" and math.isfinite(float(v)):
                    client.log_metric(mlflow_run, f"audit/{k}".replace("@", "_at_fpr_"), float(v), step=rec["round"])
        for k, v in result["attribution"].items():
            client.log_metric(mlflow_run, f"audit/attribution_{k}", v)
        for f in (out, table_out, plot_out):
            client.log_artifact(mlflow_run, str(f), artifact_path="audit")
    if result["violated"]:
        click.echo(
            f"error: the membership audit's TPR lies above e^eps FPR + delta: the DP claim fails (see {table_out})",
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
    """Membership (TPR at FPR 0.1 % / 1 %, AUC), attribution and accumulation over rounds of the statistics."""
    run_stage(run_audit, shards, pools, out, table_out, plot_out, params_path, mlflow_run)
