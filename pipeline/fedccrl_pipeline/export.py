"""`fedccrl export`: a trained model -> one self-contained ONNX file + parity.json + its model card, logged to MLflow.

The export and its parity check are pipeline/fedccrl_pipeline/checked_export.py's `export_checked` (fails below
--min-agreement, and no output then); the model card is pipeline/fedccrl_pipeline/model_card.py's, from the records
card_records.py reads; the MLflow side, after parity passed, is pipeline/fedccrl_pipeline/model_registry.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text
from fedccrl_pipeline.deploy_params import test_shards
from fedccrl_pipeline.quantize import CALIBRATION_IMAGES, MAX_DROP_POINTS, Int8Settings
from fedccrl_pipeline.stage_runtime import run_stage


def export(
    model_path: Path,
    shards: Path | None,
    out: Path,
    min_agreement: float,
    batch_size: int,
    registered_model: str | None,
    alias: str | None,
    use_mlflow: bool,
    traces: dict | None = None,
    int8: Int8Settings | None = None,
    results: Path | None = None,
    federation: Path | None = None,
    deploy: Path | None = None,
    sites: Path | None = None,
) -> dict:
    """One run's export; into its card: results, the evaluate stage's root (the run's contract.result_file), federation,
    a deployment's federation file (the training data), sites, `fedccrl evaluate-sites`' result of the model; deploy:
    a deployment's params file, whose deploy.test_shards stands for `shards` when that is None (both None: the parity
    check on generated images)."""
    from fedccrl_pipeline import checked_export
    from fedccrl_pipeline.card_records import read_sources
    from fedccrl_pipeline.model_card import render
    from fedccrl_pipeline.model_registry import log_to_mlflow

    def card_maker(model_file: Path):
        sources = read_sources(model_file, shards, results, federation, use_mlflow, sites)
        return lambda meta, result: render(sources.records(meta, result))

    def publish(onnx_path, meta, result, example_u8, card_text):
        log_to_mlflow(onnx_path, meta, result, example_u8, registered_model, alias, card_text)

    publisher = publish if use_mlflow else None
    shards = test_shards(deploy, shards)
    return checked_export.export_checked(
        model_path, shards, out, min_agreement, batch_size, publisher, traces, int8, card_maker=card_maker
    )


def export_sweep(
    models: Path,
    params_path: Path,
    shards: Path,
    out: Path,
    summary: Path,
    min_agreement: float,
    batch_size: int,
    registered_model: str | None,
    use_mlflow: bool,
    int8: Int8Settings | None = None,
    results: Path | None = None,
) -> dict:
    """Every run of the current sweep (params train.algorithms x seeds x held_out), in one process:
    out/<algorithm>/s<seed>/d<held_out>/{model.onnx, parity.json, the card}, and the worst parity over them in
    `summary`. int8, results: as export's (each run's INT8 copy beside its model.onnx)."""
    from fedccrl_pipeline.params import load_config, run_dirs

    done: dict = {}
    traces: dict = {}  # one trace per architecture, reused by its further models (onnx_export.export_onnx)
    for run in run_dirs(load_config(params_path), models):  # the whole params file validated first
        key = run.relative_to(models).as_posix()
        done[key] = export(
            run / contract.MODEL_FILE,
            shards,
            out / key,
            min_agreement,
            batch_size,
            registered_model,
            None,
            use_mlflow,
            traces,
            int8,
            results,
        )
    worst = min(r["top1_agreement"] for r in done.values())
    # the compact DVC metric: the worst figures over every run (each run's own numbers: out/<run>/parity.json)
    doc = {
        "min_top1_agreement": worst,
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in done.values()),
        "runs": len(done),
    }
    if int8 is not None:  # the largest INT8 accuracy drop, in points (each run's figures: its parity.json "int8")
        doc["max_int8_drop_points"] = max(r["int8"]["accuracy_drop_points"] for r in done.values())
    write_text(summary, json.dumps(doc, indent=1) + "\n")
    return doc


@click.command("export")
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=None,
    help="one model.pt written by the train stage (or its folder)",
)
@click.option(
    "--models",
    type=click.Path(path_type=Path),
    default=None,
    help="instead of --model: every run of the sweep in params.yaml under this root (one process)",
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option(
    "--summary",
    type=click.Path(path_type=Path),
    default=None,
    help="with --models: a JSON of every run's parity (a DVC metric)",
)
@click.option(
    "--shards",
    type=click.Path(path_type=Path),
    default=None,
    help="the partition stage output (with --deploy, optional: the operator's test folder)",
)
@click.option(
    "--deploy",
    "deploy_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="a deployment's params file (with --model and --federation): its test folder deploy.test_shards, or "
    "none: the parity check on generated images",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="folder for model.onnx and parity.json (with --models: the root of <algorithm>/s<seed>/d<i>)",
)
@click.option(
    "--min-agreement",
    type=click.FloatRange(0.0, 1.0),
    default=0.999,
    show_default=True,
    help="fail when ONNX and PyTorch agree on fewer top-1 predictions than this",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--int8",
    type=bool,
    default=False,
    show_default=True,
    metavar="true|false",
    help="also write model.int8.onnx: static INT8 (QDQ, per channel), calibrated on source-domain images (params "
    "export.int8)",
)
@click.option(
    "--int8-max-drop",
    type=click.FloatRange(-100.0, 100.0),
    default=MAX_DROP_POINTS,
    show_default=True,
    help="refuse the INT8 model when its held-out accuracy is more than this many points below float32's",
)
@click.option(
    "--int8-calibration-images",
    type=click.IntRange(min=1),
    default=CALIBRATION_IMAGES,
    show_default=True,
    help="source-domain training images that calibrate the INT8 activation ranges",
)
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="the evaluate stage's results root: each run's result goes into its card (else: the parity check only)",
)
@click.option(
    "--federation",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="a deployment's federation file: the model card's training data (the sites), instead of the shards'",
)
@click.option(
    "--sites-evaluation",
    "sites",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="fedccrl evaluate-sites' result of the model (sites.json or its folder): the card's sites' evaluation",
)
@click.option(
    "--registered-model", default=None, help="MLflow registered model name [default: fedccrl-<dataset>-<algorithm>]"
)
@click.option("--alias", default=None, help="MLflow alias of the version [default: s<seed>-heldout-<domain>]")
@click.option(
    "--mlflow/--no-mlflow",
    "use_mlflow",
    default=True,
    show_default=True,
    help="log to the training run recorded in the model (skipped with a notice when it has none)",
)
def command(
    model_path,
    models,
    params_path,
    summary,
    shards,
    deploy_path,
    out,
    min_agreement,
    batch_size,
    int8,
    int8_max_drop,
    int8_calibration_images,
    results,
    federation,
    sites,
    registered_model,
    alias,
    use_mlflow,
):
    """Export trained models to ONNX with a model card, check parity on the held-out domain, register in MLflow."""
    if (model_path is None) == (models is None):
        raise click.UsageError("give exactly one of --model and --models")
    if (federation is not None or sites is not None) and models is not None:
        raise click.UsageError("--federation and --sites-evaluation are one run's: give one --model")
    if deploy_path is not None and (models is not None or federation is None):
        raise click.UsageError("--deploy is a deployment's, whose export takes one --model and its --federation")
    if shards is None and deploy_path is None:
        raise click.UsageError("--shards: required, unless --deploy names a deployment")
    int8_settings = Int8Settings(int8_calibration_images, int8_max_drop) if int8 else None
    # SIGTERM ends the stage as SystemExit (run_stage), so the finally blocks remove the temporary files
    if models is not None:
        run_stage(
            export_sweep,
            models,
            params_path,
            shards,
            out,
            summary or out / "parity.json",
            min_agreement,
            batch_size,
            registered_model,
            use_mlflow,
            int8_settings,
            results,
        )
    else:
        run_stage(
            export,
            model_path,
            shards,
            out,
            min_agreement,
            batch_size,
            registered_model,
            alias,
            use_mlflow,
            None,
            int8_settings,
            results,
            federation,
            deploy_path,
            sites,
        )
