"""`fedccrl export`: a trained model -> one self-contained ONNX file + parity.json + its model card, logged to MLflow.

The export and its parity check are pipeline/fedccrl_pipeline/checked_export.py's `export_checked` (fails below
--min-agreement, and no output then); the model card is pipeline/fedccrl_pipeline/model_card.py's, from the records
card_records.py reads; the MLflow side, after parity passed, is pipeline/fedccrl_pipeline/model_registry.py.
"""

from __future__ import annotations

from pathlib import Path

import click

from fedccrl_pipeline.export_run import export
from fedccrl_pipeline.export_sweep import export_sweep
from fedccrl_pipeline.quantize import CALIBRATION_IMAGES, MAX_DROP_POINTS, Int8Settings
from fedccrl_pipeline.stage_runtime import run_stage


def _check_usage(model_path, models, shards, deploy_path, federation, sites) -> None:
    """The options that go together, before any work (click.UsageError)."""
    if (model_path is None) == (models is None):
        raise click.UsageError("give exactly one of --model and --models")
    if (federation is not None or sites is not None) and models is not None:
        raise click.UsageError("--federation and --sites-evaluation are one run's: give one --model")
    if deploy_path is not None and (models is not None or federation is None):
        raise click.UsageError("--deploy is a deployment's, whose export takes one --model and its --federation")
    if shards is None and deploy_path is None:
        raise click.UsageError("--shards: required, unless --deploy names a deployment")


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
    _check_usage(model_path, models, shards, deploy_path, federation, sites)
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
