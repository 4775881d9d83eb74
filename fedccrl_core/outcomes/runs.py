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
from fedccrl_core.outcomes.evaluated import EvaluatedRun, RoundPoint, Scored, Selections

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory

# what `deployed_run_result` says of a deployment's numbers (the result's "evaluated_on")
BY_THE_SITES = "the federation's evaluation sites (held-out domain) and source sites (validation)"


def evaluate_run(shards: Path, run: Path, batch_size: int, device) -> EvaluatedRun:
    """The final-round target accuracy and that of the model of the best source-validation round (DomainBed's
    training-domain validation), each re-computed from the saved models, with per-class accuracy and the
    confusion matrix; plus the training history's communication and per-round accuracies."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.federation.history import load_history

    history = load_history(run)
    detail, n_test = _scored(shards, run, batch_size, device, history.private)
    if history.private:
        print(
            f"evaluate: {run} trained under train.privacy: scored on the held-out domain's val rows only "
            f"({n_test} images, none a training image of the study: docs/privacy.md)",
            file=sys.stderr,
        )
    partition = {k: v for k, v in load_manifest(shards).params.items() if k.startswith("partition.")}
    result = _evaluated(history, detail, n_test, partition=partition)
    recorded = history.rounds[-1].target_acc
    if abs(recorded - result.final_target_acc) > 1e-6 and _on_cpu(device):
        print(
            f"warning: re-evaluated final accuracy {result.final_target_acc:.4f} differs from the one "
            f"recorded in training {recorded:.4f}",
            file=sys.stderr,
        )
    return result


def deployed_run_result(run: Path, test_shards: Path | None, batch_size: int, device) -> EvaluatedRun:
    """A deployment's run: the final and val-selected target accuracy as the evaluation sites measured them (the
    round records, Σ correct / Σ n over the sites: fedccrl_flower/evalsets.py), over `n_test` = the sites' count of
    held-out images. With `test_shards`, the operator's own test folder of the held-out domain, `detail` adds the
    per-class accuracy and the confusion matrix on those images (`detail_n_test` of them); without it, `detail`
    holds the sites' accuracies only (a site returns no per-class counts of the held-out domain)."""
    from fedccrl_core.federation.history import load_history

    history = load_history(run)
    final, best = history.rounds[-1], history.at(history.best_round)
    sites = Selections(
        final=Scored(target_acc=final.target_acc, round=final.round),
        best_val=Scored(target_acc=best.target_acc, round=best.round),
    )
    n_sites = final.target_n  # the sites' count of held-out images
    if test_shards is None:
        return _evaluated(history, sites, n_sites, evaluated_on=BY_THE_SITES, partition={})
    detail, n_test = _scored(test_shards, run, batch_size, device, private=False)  # the operator's: no site's images
    return _evaluated(
        history,
        detail,
        n_sites,
        evaluated_on=BY_THE_SITES,
        partition={},  # each site split its own images (fedccrl site prepare): no central partition
        detail_n_test=n_test,
        detail_on=str(test_shards),
        sites=sites,
    )


def _evaluated(
    history: RunHistory, detail: Selections, n_test: int | None, *, sites: Selections | None = None, **more
) -> EvaluatedRun:
    """The result of a run whose final and val-selected target accuracies are `sites`' (a deployment's, measured
    by its evaluation sites) or else `detail`'s."""
    meta, rounds = history.meta, history.rounds
    chosen = sites or detail
    assert meta.algorithm is not None and meta.seed is not None and meta.held_out_domain is not None  # load_history
    return EvaluatedRun(
        dataset=meta.dataset,
        algorithm=meta.algorithm,
        seed=meta.seed,
        held_out_domain=meta.held_out_domain,
        held_out_index=meta.held_out_index,
        classes=meta.classes,
        platform=meta.platform,
        n_test=n_test,
        mlflow_run_id=meta.mlflow_run_id,
        final_target_acc=chosen.final.target_acc,
        best_val_target_acc=chosen.best_val.target_acc,
        best_round=chosen.best_val.round if chosen.best_val.round is not None else history.best_round,
        final_val_acc=rounds[-1].val_acc,
        detail=detail,
        bytes_up_per_round=sum(r.bytes_up for r in rounds) / len(rounds),
        bytes_down_per_round=sum(r.bytes_down for r in rounds) / len(rounds),
        per_round=[RoundPoint(round=r.round, target_acc=r.target_acc, val_acc=r.val_acc) for r in rounds],
        **more,
    )


def _scored(shards: Path, run: Path, batch_size: int, device, private: bool) -> tuple[Selections, int]:
    """The final and the val-selected model of `run` scored on the held-out domain's images in `shards` (its val
    rows only for a run under train.privacy, `private`: data/shards.py held_out_parts): per
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
    x, y = load_domain_test(shards, meta.held_out_domain, private)
    x_t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous().to(device)
    y_t = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)

    def scored(model, m: ModelMeta) -> Scored:
        pred = predict(model.to(device), x_t, batch_size, m.mean, m.std)
        cm = confusion_matrix(y, pred.cpu().numpy(), m.num_classes)
        per_class = (np.diag(cm).astype(np.float32) / np.maximum(cm.sum(1), 1).astype(np.float32)).tolist()
        return Scored(
            target_acc=float((pred == y_t).float().mean()),
            round=m.round,
            per_class_acc=dict(zip(m.classes, per_class)),
            confusion=cm.tolist(),
        )

    final_scored = scored(final, final_meta)
    best_scored = final_scored.model_copy(update={"round": meta.round}) if same else scored(best, meta)
    return Selections(final=final_scored, best_val=best_scored), len(y)


def _on_cpu(device) -> bool:
    import torch

    return torch.device(device).type == "cpu"


def _same_weights(a, b) -> bool:
    """Two models of one architecture holding the same values in every state entry."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
