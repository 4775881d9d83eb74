"""A saved run as an evaluation result (the evaluate stage), from the files the train stage wrote
(fedccrl_core/foundation/contract.py's run layout): `evaluate_run` re-computes a run's accuracies on the held-out
domain's images; `deployed_run_result` reads a deployment's run (`fedccrl federate`), whose accuracies the sites
measured where the images are.

Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory

# what `deployed_run_result` says of a deployment's numbers (the result's "evaluated_on")
BY_THE_SITES = "the federation's evaluation sites (held-out domain) and source sites (validation)"


def evaluate_run(shards: Path, run: Path, batch_size: int, device) -> dict:
    """The final-round target accuracy and that of the model of the best source-validation round (DomainBed's
    training-domain validation), each re-computed from the saved models, with per-class accuracy and the
    confusion matrix; plus the training history's communication and per-round accuracies."""
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.federation.history import load_history

    history = load_history(run)
    detail, n_test = _scored(shards, run, batch_size, device)
    doc = _result_doc(history, detail, n_test)
    doc["partition"] = {k: v for k, v in load_manifest(shards).params.items() if k.startswith("partition.")}
    recorded = history.rounds[-1].target_acc
    if abs(recorded - doc[contract.FINAL_TARGET_ACC]) > 1e-6 and _on_cpu(device):
        print(
            f"warning: re-evaluated final accuracy {doc[contract.FINAL_TARGET_ACC]:.4f} differs from the one "
            f"recorded in training {recorded:.4f}",
            file=sys.stderr,
        )
    return doc


def deployed_run_result(run: Path, test_shards: Path | None, batch_size: int, device) -> dict:
    """A deployment's run: the final and val-selected target accuracy as the evaluation sites measured them (the
    round records, Σ correct / Σ n over the sites: fedccrl_flower/evalsets.py), over `n_test` = the sites' count of
    held-out images. With `test_shards`, the operator's own test folder of the held-out domain, `detail` adds the
    per-class accuracy and the confusion matrix on those images (`detail_n_test` of them); without it, `detail`
    holds the sites' accuracies only (a site returns no per-class counts of the held-out domain)."""
    from fedccrl_core.federation.history import load_history

    history = load_history(run)
    final, best = history.rounds[-1], history.at(history.best_round)
    sites = {
        "final": {contract.TARGET_ACC: final.target_acc, contract.ROUND: final.round},
        "best_val": {contract.TARGET_ACC: best.target_acc, contract.ROUND: best.round},
    }
    n_sites = final.metric(contract.TARGET_N)
    doc = _result_doc(history, sites, int(n_sites) if n_sites is not None else None)
    doc["evaluated_on"] = BY_THE_SITES
    doc["partition"] = {}  # each site split its own images (fedccrl site prepare): no central partition
    if test_shards is not None:
        detail, n_test = _scored(test_shards, run, batch_size, device)
        doc["detail"], doc["detail_n_test"] = detail, n_test
        doc["detail_on"] = str(test_shards)
    return doc


def _result_doc(history: RunHistory, detail: dict, n_test: int | None) -> dict:
    """The result of a run whose final and val-selected target accuracies are `detail`'s."""
    meta, rounds = history.meta, history.rounds
    return {
        "dataset": meta.dataset,
        "algorithm": meta.algorithm,
        "seed": meta.seed,
        "held_out_domain": meta.held_out_domain,
        "held_out_index": meta.held_out_index,
        "classes": meta.classes,
        "platform": meta.platform,
        "n_test": n_test,
        "mlflow_run_id": meta.mlflow_run_id,
        contract.FINAL_TARGET_ACC: detail["final"][contract.TARGET_ACC],
        contract.BEST_VAL_TARGET_ACC: detail["best_val"][contract.TARGET_ACC],
        contract.BEST_ROUND: detail["best_val"][contract.ROUND],
        "final_val_acc": rounds[-1].val_acc,
        "detail": detail,
        "bytes_up_per_round": sum(r.bytes_up for r in rounds) / len(rounds),
        "bytes_down_per_round": sum(r.bytes_down for r in rounds) / len(rounds),
        "per_round": [
            {contract.ROUND: r.round, contract.TARGET_ACC: r.target_acc, contract.VAL_ACC: r.val_acc} for r in rounds
        ],
    }


def _scored(shards: Path, run: Path, batch_size: int, device) -> tuple[dict, int]:
    """The final and the val-selected model of `run` scored on the held-out domain's images in `shards`: per
    selection its target accuracy, round, per-class accuracy and confusion matrix; and the number of images."""
    import numpy as np
    import torch

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.learning.accuracy import predict
    from fedccrl_core.learning.confusion import confusion_matrix
    from fedccrl_core.learning.model_file import ModelMeta

    final, final_meta = load_model(run / contract.MODEL_FILE)
    best, meta = load_model(run / contract.BEST_FILE)
    final_meta.require(run / contract.MODEL_FILE, "round")
    meta.require(run / contract.BEST_FILE, "round", "held_out_domain", "dataset", "algorithm", "seed")
    same = _same_weights(best, final)  # the best round is the last: the same predictions
    x, y = load_domain_test(shards, meta.held_out_domain)
    x_t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous().to(device)
    y_t = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)

    def scored(model, m: ModelMeta) -> dict:
        pred = predict(model.to(device), x_t, batch_size, m.mean, m.std)
        cm = confusion_matrix(y, pred.cpu().numpy(), m.num_classes)
        per_class = (np.diag(cm).astype(np.float32) / np.maximum(cm.sum(1), 1).astype(np.float32)).tolist()
        return {
            contract.TARGET_ACC: float((pred == y_t).float().mean()),
            contract.ROUND: m.round,
            "per_class_acc": dict(zip(m.classes, per_class)),
            "confusion": cm.tolist(),
        }

    result = {"final": scored(final, final_meta)}
    result["best_val"] = {**result["final"], contract.ROUND: meta.round} if same else scored(best, meta)
    return result, len(y)


def _on_cpu(device) -> bool:
    import torch

    return torch.device(device).type == "cpu"


def _same_weights(a, b) -> bool:
    """Two models of one architecture holding the same values in every state entry."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
