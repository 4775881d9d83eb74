"""`fedccrl evaluate-sites`' MLflow run (evaluate_sites.py): in the model's experiment, linked to the model's run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedccrl_core.learning.model_meta import ModelMeta
    from fedccrl_core.outcomes.site_scores import SitesEvaluated


def log_to_mlflow(result: SitesEvaluated, meta: ModelMeta, files: list[Path], dataset: str) -> str:
    """One MLflow run in the model's experiment (fedccrl-<dataset>-evaluate-sites when the store lacks the model's run), tagged
    with the model's MLflow run id and run key; each site's and domain's accuracy, n and 95 % interval."""
    from fedccrl_pipeline.mlflow_store import find_run, mlflow_module, set_experiment

    mlflow = mlflow_module()
    model_run = find_run(mlflow, meta.mlflow_run_id) if meta.mlflow_run_id else None
    if model_run is not None:  # the model's experiment, as its own run says (an id alone may be another store's)
        exp_id = model_run.info.experiment_id
    else:
        name = f"fedccrl-{dataset}-evaluate-sites"
        print(
            f"evaluate-sites: the model's MLflow run {meta.mlflow_run_id or '(none)'} is not in the tracking store "
            f"{mlflow.get_tracking_uri()}: logged to experiment {name}",
            file=sys.stderr,
        )
        exp_id = set_experiment(name).experiment_id
    tags = {"fedccrl.stage": "evaluate-sites", "fedccrl.run_key": meta.params_hash or ""}
    if meta.mlflow_run_id:
        tags["fedccrl.model_run_id"] = meta.mlflow_run_id
    metrics: dict[str, float] = {"sites_refused": len(result.refused), "sites_dropped": len(result.dropped)}
    rows = [(f"site/{s.client}", s.score) for s in result.sites] + [
        (f"domain/{d.domain}", d.score) for d in result.domains
    ]
    for name, s in [*rows, ("pooled", result.pooled)]:
        metrics[f"{name}/n"] = s.n
        if s.accuracy is not None and s.ci95 is not None:
            metrics.update({f"{name}/acc": s.accuracy, f"{name}/ci95_low": s.ci95[0], f"{name}/ci95_high": s.ci95[1]})
    client = mlflow.MlflowClient()
    run = client.create_run(exp_id, tags=tags, run_name=f"evaluate-sites {meta.algorithm} {meta.held_out_domain}")
    for k, v in metrics.items():
        client.log_metric(run.info.run_id, k, float(v))
    for f in files:
        client.log_artifact(run.info.run_id, str(f), artifact_path="evaluate-sites")
    client.set_terminated(run.info.run_id)
    return run.info.run_id
