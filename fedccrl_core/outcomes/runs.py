"""A saved run re-evaluated on its held-out domain (the evaluate stage), from the files the train stage wrote
(fedccrl_core/foundation/contract.py's run layout).

Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys
from pathlib import Path

from fedccrl_core.foundation import contract


def evaluate_run(shards: Path, run: Path, batch_size: int, device) -> dict:
    """The final-round target accuracy and that of the model of the best source-validation round (DomainBed's
    training-domain validation), each re-computed from the saved models, with per-class accuracy and the
    confusion matrix; plus the training history's communication and per-round accuracies."""
    import numpy as np
    import torch

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test, load_manifest
    from fedccrl_core.federation.history import load_history
    from fedccrl_core.learning.accuracy import predict
    from fedccrl_core.learning.confusion import confusion_matrix
    from fedccrl_core.learning.model_file import ModelMeta

    rounds = load_history(run).rounds
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
    doc = {
        "dataset": meta.dataset,
        "algorithm": meta.algorithm,
        "seed": meta.seed,
        "held_out_domain": meta.held_out_domain,
        "held_out_index": meta.held_out_index,
        "classes": meta.classes,
        "platform": meta.platform,
        "n_test": len(y),
        "mlflow_run_id": meta.mlflow_run_id,
        contract.FINAL_TARGET_ACC: result["final"][contract.TARGET_ACC],
        contract.BEST_VAL_TARGET_ACC: result["best_val"][contract.TARGET_ACC],
        contract.BEST_ROUND: result["best_val"][contract.ROUND],
        "final_val_acc": rounds[-1].val_acc,
        "detail": result,
        "bytes_up_per_round": sum(r.bytes_up for r in rounds) / len(rounds),
        "bytes_down_per_round": sum(r.bytes_down for r in rounds) / len(rounds),
        "per_round": [
            {contract.ROUND: r.round, contract.TARGET_ACC: r.target_acc, contract.VAL_ACC: r.val_acc} for r in rounds
        ],
        "partition": {k: v for k, v in load_manifest(shards).params.items() if k.startswith("partition.")},
    }
    recorded = rounds[-1].target_acc
    if abs(recorded - doc[contract.FINAL_TARGET_ACC]) > 1e-6 and torch.device(device).type == "cpu":
        print(
            f"warning: re-evaluated final accuracy {doc[contract.FINAL_TARGET_ACC]:.4f} differs from the one "
            f"recorded in training {recorded:.4f}",
            file=sys.stderr,
        )
    return doc


def _same_weights(a, b) -> bool:
    """Two models of one architecture holding the same values in every state entry."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
