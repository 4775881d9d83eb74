"""`fedccrl evaluate-sites`' MLflow run (evaluate_sites.py): in the model's experiment, linked to the model's run.
It is opened before the run is submitted: the model file travels to the ServerApp as one of its artifacts
(`log_model`), and the ServerApp reports its status and outcome to it (fedccrl_flower/tracked_report.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedccrl_core.learning.model_meta import ModelMeta
    from fedccrl_core.outcomes.site_scores import SitesEvaluated
    from fedccrl_flower.spec import ReportTo, SiteEvalSpec

MODEL_DIR = "model"  # the run's artifact folder of the model file the sites evaluate


@contextmanager
def sites_run(meta: ModelMeta, dataset: str, enabled: bool) -> Iterator[ReportTo | None]:
    """The evaluation's MLflow run (None when not `enabled`), opened in the model's experiment
    (fedccrl-<dataset>-evaluate-sites when the store lacks the model's run), tagged with the model's MLflow run id
    and run key; marked FAILED when the evaluation raises, left to `finish_run` otherwise."""
    if not enabled:
        yield None
        return
    from fedccrl_flower.spec import ReportTo
    from fedccrl_pipeline.mlflow_store import find_run, mlflow_module, set_experiment
    from fedccrl_pipeline.train_tracking import RUN_KEY_TAG

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
    tags = {"fedccrl.stage": "evaluate-sites", RUN_KEY_TAG: meta.params_hash or ""}
    if meta.mlflow_run_id:
        tags["fedccrl.model_run_id"] = meta.mlflow_run_id
    client = mlflow.MlflowClient()
    run = client.create_run(exp_id, tags=tags, run_name=f"evaluate-sites {meta.algorithm} {meta.held_out_domain}")
    try:
        yield ReportTo(tracking_uri=mlflow.get_tracking_uri(), run_id=run.info.run_id)
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise


def carry_model(spec: SiteEvalSpec, run: ReportTo, model_file: Path) -> SiteEvalSpec:
    """`spec` with the model file (whose sha256 it names) logged to `run`: the ServerApp downloads it from there
    (MODEL_DIR/<file name>) instead of reading the path, and reports its status and outcome to that run."""
    from mlflow import MlflowClient

    from fedccrl_flower.spec import SiteEvalSpec

    MlflowClient(tracking_uri=run.tracking_uri).log_artifact(run.run_id, str(model_file), MODEL_DIR)
    fields = spec.model_dump(exclude={"model_file", "report_to"})
    return SiteEvalSpec(**{**fields, "model_artifact": f"{MODEL_DIR}/{model_file.name}"}, report_to=run)


def finish_run(run: ReportTo, result: SitesEvaluated, files: list[Path]) -> None:
    """Each site's and domain's accuracy, n and 95 % interval, and `files`, logged to `run`, which then finishes."""
    from mlflow import MlflowClient

    metrics: dict[str, float] = {"sites_refused": len(result.refused), "sites_dropped": len(result.dropped)}
    rows = [(f"site/{s.client}", s.score) for s in result.sites] + [
        (f"domain/{d.domain}", d.score) for d in result.domains
    ]
    for name, s in [*rows, ("pooled", result.pooled)]:
        metrics[f"{name}/n"] = s.n
        if s.accuracy is not None and s.ci95 is not None:
            metrics.update({f"{name}/acc": s.accuracy, f"{name}/ci95_low": s.ci95[0], f"{name}/ci95_high": s.ci95[1]})
    client = MlflowClient(tracking_uri=run.tracking_uri)
    for k, v in metrics.items():
        client.log_metric(run.run_id, k, float(v))
    for f in files:
        client.log_artifact(run.run_id, str(f), artifact_path="evaluate-sites")
    client.set_terminated(run.run_id)
