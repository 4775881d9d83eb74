"""`fedccrl evaluate`: one trained run on its held-out domain (leave-one-domain-out).

Reports the final-round target accuracy and the target accuracy of the global model at the round
with the best source-validation accuracy (DomainBed's training-domain validation), each
re-computed here from the saved models, plus per-class accuracy and the confusion matrix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import atomic_dir, write_text
from fedccrl_pipeline.params import load_config, run_dirs
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def evaluate(shards: Path, model_dir: Path, out: Path, params_path: Path, cfg=None) -> dict:
    """One run (fedccrl_core.outcomes.results.evaluate_run) -> out (JSON)."""
    from fedccrl_core.foundation.fastpath import resolve_device
    from fedccrl_core.outcomes.runs import evaluate_run

    cfg = cfg or load_config(params_path)
    doc = evaluate_run(shards, model_dir, cfg.evaluate.batch_size, resolve_device(cfg.train.device))
    write_text(out, json.dumps(doc, indent=1))
    print(
        f"{doc['algorithm']} s{doc['seed']} {doc['held_out_domain']}: final {doc[contract.FINAL_TARGET_ACC]:.4f} "
        f"best-val {doc[contract.BEST_VAL_TARGET_ACC]:.4f} (round {doc[contract.BEST_ROUND]})",
        file=sys.stderr,
    )
    return doc


def evaluate_all(shards: Path, models: Path, out: Path, params_path: Path) -> list[dict]:
    """Every trained run under models/<algorithm>/s<seed>/d<held_out> -> out/<algorithm>/s<seed>/d<held_out>.json,
    written into a temp folder renamed into place at the end."""
    folders_apart({"shards": shards, "models": models}, {"out": out})
    cfg = load_config(params_path)
    wanted = trained_runs(cfg, models)
    with atomic_dir(out) as tmp:
        return [evaluate(shards, d, contract.result_file(tmp, models, d), params_path, cfg) for d in wanted]


def trained_runs(cfg, models: Path) -> list[Path]:
    """The run folders of the current sweep (stale folders of older sweeps are skipped); FileNotFoundError naming
    the first ones that the train stages have not finished."""
    wanted = run_dirs(cfg, models)
    missing = [str(d) for d in wanted if not (d / contract.HISTORY_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"trained runs missing (run the train stages first): {', '.join(missing[:4])}")
    return wanted


@click.command("evaluate")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option(
    "--models",
    type=click.Path(path_type=Path),
    required=True,
    help="the train stages' output root: models/<algorithm>/s<seed>/d<held_out>",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="results folder, one JSON per run")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(shards, models, out, params_path):
    """Evaluate every trained run on its held-out domain (one process for all runs)."""
    run_stage(evaluate_all, shards, models, out, params_path)
