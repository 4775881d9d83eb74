"""`fedccrl report`: the leave-one-domain-out table (FedCCRL Table 1 form), mean ± std across seeds.

Reads every results/runs/<algorithm>/s<seed>/d<i>.json and writes
  --metrics  results/metrics.json   DVC metrics: per algorithm and held-out domain, mean and std
                                    over seeds of final and val-selected target accuracy, plus Avg.
  --table    results/table.md       the paper-style table (Table 1 layout: one column per held-out domain)
             results/table.csv      the same numbers, one row per (selection, algorithm)
  --curves   results/curves.csv     per-round target accuracy in long form, one row per (run, held-out domain,
                                    round) with its `series` <algorithm>/s<seed>/<domain> (DVC plots: one line per
                                    series, .dvc/plots/series.json)
  --summary  results/summary.json   the compact DVC metric: per algorithm and held-out domain the mean final target
                                    accuracy over seeds, plus avg (`dvc metrics show` stays narrow)
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

import click

from fedccrl_core.fsio import atomic_file, write_text
from pipeline.cli import run_stage
from pipeline.tracking import timed


# FedCCRL's Table 1 row order, then the other seed papers' methods (FedFD-A's Table 1 frameworks, FedAlign)
PAPER_ORDER = ("fedavg", "fedprox", "fedadg", "ga", "fedsr", "fediir", "ccst", "fedccrl",
               "fedbn", "silobn", "fedfd", "fedfd_a", "fedalign")


def _mean_std(vals: list[float]) -> dict:
    return {"mean": statistics.fmean(vals), "std": statistics.pstdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def report(runs_dir: Path, metrics_out: Path, table_out: Path, curves_out: Path,
           params_path: Path | None = None, summary_out: Path | None = None) -> dict:
    if params_path is not None:  # the stage validates the whole params file first, as every stage does
        from pipeline.params import load_config

        load_config(params_path)
    files = sorted(runs_dir.rglob("*.json"))
    if not files:
        raise FileNotFoundError(f"{runs_dir}: no evaluation results (run the evaluate stage first)")
    runs = [json.loads(f.read_text()) for f in files]
    domains = [d for _, d in sorted({(r.get("held_out_index") or 0, r["held_out_domain"]) for r in runs})]
    runs.sort(key=lambda r: (PAPER_ORDER.index(r["algorithm"]) if r["algorithm"] in PAPER_ORDER else 99,
                             r["algorithm"], r["seed"]))
    by: dict = {}
    for r in runs:
        by.setdefault(r["algorithm"], {}).setdefault(r["held_out_domain"], []).append(r)
    metrics: dict = {}
    for alg, per_dom in by.items():
        m = {}
        for dom, rs in per_dom.items():
            m[dom] = {"final_target_acc": _mean_std([x["final_target_acc"] for x in rs]),
                      "best_val_target_acc": _mean_std([x["best_val_target_acc"] for x in rs]),
                      "seeds": sorted(x["seed"] for x in rs)}
        m["comm_mb_per_round"] = {
            k: statistics.fmean(x[f"bytes_{k}_per_round"] for rs in per_dom.values() for x in rs) / 1e6
            for k in ("up", "down")}
        if len(per_dom) == len(domains):
            m["avg"] = {k: statistics.fmean(m[d][k]["mean"] for d in domains)
                        for k in ("final_target_acc", "best_val_target_acc")}
        metrics[alg] = m
    dataset = runs[0]["dataset"]

    def cell(alg, dom, key):
        if dom not in metrics[alg]:
            return "–"
        s = metrics[alg][dom][key]
        return f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}" if s["n"] > 1 else f"{100 * s['mean']:.2f}"

    lines = []
    parts = sorted({json.dumps(r.get("partition") or {}, sort_keys=True) for r in runs})
    for p in parts:     # the partition the runs were trained on (one line; several if runs were mixed)
        lines += ["Partition: " + (", ".join(f"{k.removeprefix('partition.')}={v}" for k, v in json.loads(p).items())
                                   or "not recorded"), ""]
    for key, title in (("final_target_acc", "final round"), ("best_val_target_acc", "round selected by source validation")):
        lines += [f"### {dataset}: target accuracy (%), {title}", "",
                  "| Algorithm | " + " | ".join(domains) + " | Avg. |", "|---" * (len(domains) + 2) + "|"]
        for alg in metrics:
            avg = metrics[alg].get("avg", {}).get(key)
            avg_cell = f"{100 * avg:.2f}" if avg is not None else "–"
            lines.append(f"| {alg} | " + " | ".join(cell(alg, d, key) for d in domains) + f" | {avg_cell} |")
        lines.append("")
    lines += ["### Communication per round (MB, all clients together): what the papers argue about", "",
              "| Algorithm | up (weights + statistics / style bank) | down |", "|---|---|---|"]
    for alg in metrics:
        c = metrics[alg]["comm_mb_per_round"]
        lines.append(f"| {alg} | {c['up']:.3f} | {c['down']:.3f} |")
    lines.append("")
    for path in (metrics_out, table_out, curves_out):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text(metrics_out, json.dumps(metrics, indent=1))
    if summary_out is not None:
        summary = {alg: {**{d: round(m[d]["final_target_acc"]["mean"], 4) for d in domains if d in m},
                         **({"avg": round(m["avg"]["final_target_acc"], 4)} if "avg" in m else {})}
                   for alg, m in metrics.items()}
        write_text(summary_out, json.dumps(summary, indent=1))
    write_text(table_out, "\n".join(lines))
    csv_rows = [["selection", "algorithm", *[f"{d}_mean" for d in domains], *[f"{d}_std" for d in domains], "avg"]]
    for key in ("final_target_acc", "best_val_target_acc"):
        for alg in metrics:
            get = lambda d, s: metrics[alg][d][key][s] if d in metrics[alg] else ""  # noqa: E731
            csv_rows.append([key, alg, *[get(d, "mean") for d in domains], *[get(d, "std") for d in domains],
                             metrics[alg].get("avg", {}).get(key, "")])
    table_csv = table_out.with_suffix(".csv")
    with atomic_file(table_csv, "w", newline="") as f:
        csv.writer(f).writerows(csv_rows)
    with atomic_file(curves_out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "algorithm", "seed", "held_out", "round", "target_acc"])
        for r in runs:
            for p in sorted(r["per_round"], key=lambda p: p["round"]):
                w.writerow([f"{r['algorithm']}/s{r['seed']}/{r['held_out_domain']}", r["algorithm"], r["seed"],
                            r["held_out_domain"], p["round"], p["target_acc"]])
    print("\n".join(lines), file=sys.stderr)
    _log_to_parent(runs, [metrics_out, table_out, table_csv, curves_out, *([summary_out] if summary_out else [])],
                   metrics)
    return metrics


@timed
def _log_to_parent(runs: list[dict], files: list[Path], metrics: dict) -> None:
    """The table goes to the sweep's MLflow parent run (found through a child run's parent tag)."""
    from pipeline.tracking import mlflow_module

    models_meta = [r.get("mlflow_run_id") for r in runs if r.get("mlflow_run_id")]
    if not models_meta:
        return
    mlflow = mlflow_module()
    client = mlflow.MlflowClient()
    try:
        parent = client.get_run(models_meta[0]).data.tags.get("mlflow.parentRunId")
    except Exception as e:
        print(f"report: MLflow run {models_meta[0]} not found ({e.__class__.__name__}); not logged", file=sys.stderr)
        return
    if not parent:
        return
    for f in files:
        client.log_artifact(parent, str(f), artifact_path="report")
    for alg, m in metrics.items():
        for key, v in m.get("avg", {}).items():
            client.log_metric(parent, f"{alg}.avg_{key}", v)


@click.command("report")
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), required=True)
@click.option("--metrics", "metrics_out", type=click.Path(path_type=Path), required=True)
@click.option("--table", "table_out", type=click.Path(path_type=Path), required=True)
@click.option("--curves", "curves_out", type=click.Path(path_type=Path), required=True)
@click.option("--summary", "summary_out", type=click.Path(path_type=Path), default=None,
              help="the compact DVC metric: mean final target accuracy per algorithm and held-out domain")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(runs_dir, metrics_out, table_out, curves_out, summary_out, params_path):
    """Mean ± std across seeds per held-out domain; the paper-style table."""
    run_stage(report, runs_dir, metrics_out, table_out, curves_out, params_path, summary_out)
