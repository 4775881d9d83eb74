"""`fedccrl evaluate`: one trained run on its held-out domain (leave-one-domain-out).

Reports the final-round target accuracy and the target accuracy of the global model at the round
with the best source-validation accuracy (DomainBed's training-domain validation), each
re-computed here from the saved models, plus per-class accuracy and the confusion matrix.

With `--deploy` (the operator's project, `fedccrl deploy init`) the runs are a deployment's (`fedccrl federate`, the
deploy file's deploy.algorithms x seeds x held_out): their accuracies are the ones the sites measured, read from
each run's history, and `--shards`, when given, is the operator's own test folder of the held-out domain(s), where
the per-class accuracy and the confusion matrix are computed (fedccrl_core/outcomes/runs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.foundation.fsio import atomic_dir
from fedccrl_core.outcomes.evaluated import EvaluatedRun
from fedccrl_pipeline.deploy_params import deployed_run_dirs, load_deploy, test_shards
from fedccrl_pipeline.params import load_config, run_dirs
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def evaluate(shards: Path, model_dir: Path, out: Path, params_path: Path, cfg=None) -> EvaluatedRun:
    """One run (fedccrl_core.outcomes.results.evaluate_run) -> out (JSON)."""
    from fedccrl_core.foundation.fastpath import resolve_device
    from fedccrl_core.outcomes.runs import evaluate_run

    cfg = cfg or load_config(params_path)
    doc = evaluate_run(shards, model_dir, cfg.evaluate.batch_size, resolve_device(cfg.train.device))
    return _written(doc, out, "")


def evaluate_deployed(test_shards: Path | None, model_dir: Path, out: Path, cfg) -> EvaluatedRun:
    """One run of a deployment (fedccrl_core.outcomes.runs.deployed_run_result) -> out (JSON)."""
    from fedccrl_core.foundation.fastpath import resolve_device
    from fedccrl_core.outcomes.runs import deployed_run_result

    doc = deployed_run_result(model_dir, test_shards, cfg.evaluate.batch_size, resolve_device(cfg.train.device))
    return _written(doc, out, ", measured by the sites")


def _written(result: EvaluatedRun, out: Path, how: str) -> EvaluatedRun:
    """A run's result written to `out`, and its line on stderr."""
    from fedccrl_core.outcomes.evaluated import write_result

    write_result(result, out)
    print(result.line(how), file=sys.stderr)
    return result


def evaluate_all(
    shards: Path | None, models: Path, out: Path, params_path: Path, deploy_path: Path | None = None
) -> list[EvaluatedRun]:
    """Every trained run under models/<algorithm>/s<seed>/d<held_out> -> out/<algorithm>/s<seed>/d<held_out>.json,
    written into a temp folder renamed into place at the end."""
    if deploy_path is None and shards is None:
        raise ParamError("--shards: required (the held-out domains' images), unless --deploy names a deployment")
    shards = test_shards(deploy_path, shards)
    folders_apart({"shards": shards, "models": models}, {"out": out})
    cfg = load_config(params_path, downloads=deploy_path is None)  # a deployment downloads nothing
    wanted = trained_runs(cfg, models, deploy_path)
    with atomic_dir(out) as tmp:
        if deploy_path is not None or shards is None:
            return [evaluate_deployed(shards, d, contract.result_file(tmp, models, d), cfg) for d in wanted]
        return [evaluate(shards, d, contract.result_file(tmp, models, d), params_path, cfg) for d in wanted]


def trained_runs(cfg, models: Path, deploy_path: Path | None = None) -> list[Path]:
    """The run folders of the current sweep (stale folders of older sweeps are skipped), or of the deployment that
    the deploy file `deploy_path` names; FileNotFoundError naming the first ones that are not finished."""
    wanted = run_dirs(cfg, models) if deploy_path is None else deployed_run_dirs(load_deploy(deploy_path), models)
    missing = [str(d) for d in wanted if not (d / contract.HISTORY_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"trained runs missing (run the train stages first): {', '.join(missing[:4])}")
    return wanted


@click.command("evaluate")
@click.option(
    "--shards",
    type=click.Path(path_type=Path),
    default=None,
    help="the held-out domains' images (a shard folder); with --deploy, optional: the operator's test folder",
)
@click.option(
    "--models",
    type=click.Path(path_type=Path),
    required=True,
    help="the train stages' output root: models/<algorithm>/s<seed>/d<held_out>",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="results folder, one JSON per run")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option(
    "--deploy",
    "deploy_path",
    type=click.Path(path_type=Path),
    default=None,
    help="a deployment's params file (its deploy group): its runs, with the accuracies the sites measured, and its test folder",
)
def command(shards, models, out, params_path, deploy_path):
    """Evaluate every trained run on its held-out domain (one process for all runs)."""
    run_stage(evaluate_all, shards, models, out, params_path, deploy_path)
