"""One run's export (`fedccrl export --model`): the ONNX model checked against the trained one, its model card and,
with MLflow, its registered version (checked_export.py does the work; this module gathers what the card and the
registry take)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_pipeline.deploy_params import test_shards
from fedccrl_pipeline.quantize import Int8Settings

if TYPE_CHECKING:
    from fedccrl_pipeline.checked_export import ExportParity


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
) -> ExportParity:
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
        return (lambda meta, result: render(sources.records(meta, result))), sources.history.private

    def publish(onnx_path, meta, result, example_u8, card_text):
        log_to_mlflow(onnx_path, meta, result, example_u8, registered_model, alias, card_text)

    publisher = publish if use_mlflow else None
    shards = test_shards(deploy, shards)
    return checked_export.export_checked(
        model_path,
        shards,
        out,
        min_agreement,
        batch_size,
        publisher,
        traces,
        int8,
        card_maker=card_maker,
        study_images=deploy is None,  # a deployment's test folder: the operator's images, no site's
    )
