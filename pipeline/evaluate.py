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

from fedccrl_core import contract
from fedccrl_core.fsio import atomic_dir, write_text
from pipeline.cli import run_stage
from pipeline.params import load_config, run_dirs


def evaluate(shards: Path, model_dir: Path, out: Path, params_path: Path, cfg=None) -> dict:
    import numpy as np
    import torch

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test, load_manifest
    from fedccrl_core.evaluation import confusion_matrix, predict
    from fedccrl_core.federation.engine import resolve_device

    cfg = cfg or load_config(params_path)
    bs = cfg.evaluate.batch_size
    device = resolve_device(cfg.train.device)
    hist_path = model_dir / contract.HISTORY_FILE
    if not hist_path.is_file():
        raise FileNotFoundError(f"{hist_path}: missing (was the train stage interrupted?)")
    history = json.loads(hist_path.read_text())
    result = {}
    for tag, fname in (("final", contract.MODEL_FILE), ("best_val", contract.BEST_FILE)):
        model, meta = load_model(model_dir / fname)
        model.to(device)
        x, y = load_domain_test(shards, meta["held_out_domain"])
        x_t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous().to(device)
        y_t = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)
        pred = predict(model, x_t, bs, meta["mean"], meta["std"])
        cm = confusion_matrix(pred, y_t, meta["num_classes"]).cpu()
        per_class = (cm.diag().float() / cm.sum(1).clamp(min=1).float()).tolist()
        result[tag] = {contract.TARGET_ACC: float((pred == y_t).float().mean()), contract.ROUND: int(meta["round"]),
                       "per_class_acc": dict(zip(meta["classes"], per_class)), "confusion": cm.tolist()}
    rounds = history["rounds"]
    out_doc = {"dataset": meta["dataset"], "algorithm": meta["algorithm"], "seed": meta["seed"],
               "held_out_domain": meta["held_out_domain"], "held_out_index": meta.get("held_out_index"),
               "classes": meta["classes"], "n_test": int(len(y)), "mlflow_run_id": meta.get("mlflow_run_id"),
               contract.FINAL_TARGET_ACC: result["final"][contract.TARGET_ACC],
               contract.BEST_VAL_TARGET_ACC: result["best_val"][contract.TARGET_ACC],
               contract.BEST_ROUND: result["best_val"][contract.ROUND],
               "final_val_acc": rounds[-1][contract.VAL_ACC], "detail": result,
               "bytes_up_per_round": sum(r[contract.BYTES_UP] for r in rounds) / len(rounds),
               "bytes_down_per_round": sum(r[contract.BYTES_DOWN] for r in rounds) / len(rounds),
               "per_round": [{k: r[k] for k in (contract.ROUND, contract.TARGET_ACC, contract.VAL_ACC)}
                             for r in rounds],
               "partition": {k: v for k, v in load_manifest(shards).get("params", {}).items()
                             if k.startswith("partition.")}}
    recorded = rounds[-1][contract.TARGET_ACC]
    if abs(recorded - out_doc[contract.FINAL_TARGET_ACC]) > 1e-6 and device.type == "cpu":
        print(f"warning: re-evaluated final accuracy {out_doc[contract.FINAL_TARGET_ACC]:.4f} differs from the one "
              f"recorded in training {recorded:.4f}", file=sys.stderr)
    write_text(out, json.dumps(out_doc, indent=1))
    print(f"{meta['algorithm']} s{meta['seed']} {meta['held_out_domain']}: final {out_doc[contract.FINAL_TARGET_ACC]:.4f} "
          f"best-val {out_doc[contract.BEST_VAL_TARGET_ACC]:.4f} (round {out_doc[contract.BEST_ROUND]})", file=sys.stderr)
    return out_doc


def evaluate_all(shards: Path, models: Path, out: Path, params_path: Path) -> list[dict]:
    """Every trained run under models/<algorithm>/s<seed>/d<held_out> -> out/<algorithm>/s<seed>/d<held_out>.json,
    written into a temp folder renamed into place at the end."""
    cfg = load_config(params_path)  # only the runs of the current sweep: stale folders of older sweeps are skipped
    wanted = run_dirs(cfg, models)
    missing = [str(d) for d in wanted if not (d / contract.HISTORY_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"trained runs missing (run the train stages first): {', '.join(missing[:4])}")
    with atomic_dir(out) as tmp:
        return [evaluate(shards, d, contract.result_file(tmp, models, d), params_path, cfg)
                for d in wanted]


@click.command("evaluate")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option("--models", type=click.Path(path_type=Path), required=True,
              help="the train stages' output root: models/<algorithm>/s<seed>/d<held_out>")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="results folder, one JSON per run")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(shards, models, out, params_path):
    """Evaluate every trained run on its held-out domain (one process for all runs)."""
    run_stage(evaluate_all, shards, models, out, params_path)
