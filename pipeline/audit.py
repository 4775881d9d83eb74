"""`fedccrl audit`: what FedCCRL's statistics upload reveals, measured (fedccrl_core/audit.py).

Reads the clients' statistics (pools stage) and their domains (the shards' manifest), replays the uploads of
train.rounds rounds at train.seeds[0] with train.fedccrl.r (and train.privacy when on), and writes
  --out    results/audit.json  one record per round (released share, membership TPR at FPR 0.1 % and 1 %, AUC)
                               and the attribution of round 1's rows to their domain and client, against chance
  --table  results/audit.md    the same as a table
  --plot   results/audit.png    membership TPR and the released share over the rounds
`--mlflow-run ID` also logs them to that MLflow run (metrics per round as steps, the files as artifacts).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fedccrl_core.fsio import atomic_file, write_text
from pipeline.cli import run_stage


def load_audit_clients(shards: Path, pools: Path):
    from fedccrl_core.audit import Client
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.data.shards import load_manifest

    out = []
    for entry in load_manifest(shards)["clients"]:
        mu, sigma = load_pool(pools, entry["id"])
        out.append(Client(entry["id"], entry["domain"], mu, sigma))
    return out


def table(result: dict) -> list[str]:
    att = result["attribution"]
    lines = ["| round | released share | 1 - (1 - r)^t | TPR @ FPR 0.1 % | TPR @ FPR 1 % | AUC |",
             "|---:|---:|---:|---:|---:|---:|"]
    for rec in result["rounds"]:
        lines.append(f"| {rec['round']} | {rec['released_share']:.3f} | {rec['expected_share']:.3f} | "
                     f"{rec['tpr_at_fpr_0.001']:.3f} | {rec['tpr_at_fpr_0.01']:.3f} | {rec['auc']:.3f} |")
    lines += ["", f"Attribution of round 1's {att['rows']} released rows (5-NN, 5-fold): domain "
                  f"{att['domain_accuracy']:.3f} (chance {att['domain_chance']:.3f}), client "
                  f"{att['client_accuracy']:.3f} (chance {att['client_chance']:.3f}).",
              f"r = {result['r']}, seed {result['seed']}, privacy: "
              + ("off" if not result["privacy"] else json.dumps(result["privacy"], sort_keys=True))]
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in result["rounds"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(rounds, [r["released_share"] for r in result["rounds"]], "k-", label="released share")
    ax.plot(rounds, [r["expected_share"] for r in result["rounds"]], "k:", label="1 - (1 - r)^t")
    ax.plot(rounds, [r["tpr_at_fpr_0.01"] for r in result["rounds"]], "o-", label="TPR @ FPR 1 %")
    ax.plot(rounds, [r["tpr_at_fpr_0.001"] for r in result["rounds"]], "s--", label="TPR @ FPR 0.1 %")
    ax.set_xlabel("round")
    ax.set_ylim(0, 1.02)
    ax.set_title("membership from the released statistics")
    ax.legend(fontsize=8)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def run_audit(shards: Path, pools: Path, out: Path, table_out: Path, plot_out: Path, params_path: Path,
              mlflow_run: str | None = None) -> dict:
    from pipeline.params import load_config

    cfg = load_config(params_path)  # the whole file, before any data is read
    from fedccrl_core.audit import audit
    from fedccrl_core.privacy.settings import PrivacySettings

    privacy = PrivacySettings.from_mapping(cfg.train.privacy.model_dump())
    result = audit(load_audit_clients(shards, pools), cfg.train.fedccrl.r, cfg.train.rounds, cfg.train.seeds[0],
                   privacy)
    write_text(out, json.dumps(result, indent=1))
    lines = table(result)
    write_text(table_out, "\n".join(lines) + "\n")
    plot(result, plot_out)
    print("\n".join(lines), file=sys.stderr)
    if mlflow_run:
        from pipeline.tracking import mlflow_module

        client = mlflow_module().MlflowClient()
        for rec in result["rounds"]:
            for k, v in rec.items():
                if k != "round":
                    client.log_metric(mlflow_run, f"audit/{k}", v, step=rec["round"])
        for k, v in result["attribution"].items():
            client.log_metric(mlflow_run, f"audit/attribution_{k}", v)
        for f in (out, table_out, plot_out):
            client.log_artifact(mlflow_run, str(f), artifact_path="audit")
    return result


@click.command("audit")
@click.option("--shards", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--pools", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/audit.json"), show_default=True)
@click.option("--table", "table_out", type=click.Path(path_type=Path), default=Path("results/audit.md"),
              show_default=True)
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), default=Path("results/audit.png"),
              show_default=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--mlflow-run", default=None, help="an MLflow run id to log the audit to")
def command(shards, pools, out, table_out, plot_out, params_path, mlflow_run):
    """Membership (TPR at FPR 0.1 % / 1 %, AUC), attribution and accumulation over rounds of the statistics."""
    run_stage(run_audit, shards, pools, out, table_out, plot_out, params_path, mlflow_run)
