"""Evaluation where the data is: each site evaluates the aggregated global model on its own images and returns
counts, never images; the ServerApp pools them. The SuperLink's host holds no site's file.

A site's part (`site_counts`, run by the ClientApp on an EVALUATE message):
  - source validation: its val split outside the held-out domain (`load_client(exclude_domain=held_out)`, the rows
    the in-process engine's EvalSets concatenate), when it is a source client of the run: per class k, its val
    images of class k, how many of them the global model gets right, and how many images it predicts as k;
  - target: its rows of the held-out domain, train + val, under train.privacy val only (`load_client_domain`, its
    share of `load_domain_test`; data/shards.py held_out_parts): how many, and how many right. An evaluation-only site (a client of the held-out domain, which never trains)
    returns only these; a mixed-domain (feddg_bench) source client returns both.

The server's part (`pool`): val accuracy = Σ correct / Σ n over the sites that answered, target accuracy likewise,
each as the float32 mean the central evaluation takes (learning/accuracy.py `pooled_accuracy`), so with every
source site and every site of the held-out domain answering, both equal the in-process engine's numbers. Which
sites evaluate: every site that answered the round's QUERY (every connected source site, sampled or not, and every
evaluation-only site), because the in-process engine validates on every source client's val split. A site that
does not answer is dropped from that round's evaluation (the round record's `val_n`, `target_n`, `eval_sites` say
over what the numbers were taken).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Message

from fedccrl_core.federation.loop import Evaluation
from fedccrl_core.foundation import contract
from fedccrl_core.learning.accuracy import class_counts, pooled_accuracy
from fedccrl_flower import messages as M

VAL_N, TARGET_N, EVAL_SITES = contract.VAL_N, contract.TARGET_N, contract.EVAL_SITES  # the round record's fields
EVAL_MISSING = contract.EVAL_MISSING


@dataclass(frozen=True)
class SiteCounts:
    """One site's evaluation counts (messages.py F_VAL_* / F_TARGET_*)."""

    val_labels: list[int]
    val_correct: list[int]
    val_predicted: list[int]
    target_n: int
    target_correct: int

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                M.F_VAL_LABELS: self.val_labels,
                M.F_VAL_CORRECT: self.val_correct,
                M.F_VAL_PREDICTED: self.val_predicted,
                M.F_TARGET_N: self.target_n,
                M.F_TARGET_CORRECT: self.target_correct,
            }
        )


def site_counts(model, val_x, val_y, target_x, target_y, num_classes: int, batch_size: int, local) -> SiteCounts:
    """The counts of one site's images (uint8 NCHW tensors on the model's device, int64 labels)."""
    labels = [int(v) for v in torch.bincount(val_y, minlength=num_classes).tolist()]
    right, predicted = class_counts(model, val_x, val_y, num_classes, batch_size, local.mean, local.std, local.fast)
    t_right, _ = class_counts(model, target_x, target_y, num_classes, batch_size, local.mean, local.std, local.fast)
    return SiteCounts(labels, right, predicted, len(target_y), int(sum(t_right)))


def _ints(cfg: ConfigRecord, key: str, length: int | None, what: str) -> list[int]:
    v = cfg[key]
    vals = v if isinstance(v, list) else [v]
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in vals):
        raise M.MalformedUpdate(f"{what}: '{key}' holds something other than counts")
    if length is not None and (not isinstance(v, list) or len(v) != length):
        raise M.MalformedUpdate(f"{what}: '{key}' has {len(vals)} entries, expected one per class ({length})")
    return [int(x) for x in vals]


def read_eval_reply(r: Message, cid: str, num_classes: int) -> SiteCounts:
    """The counts of `cid`'s EVALUATE reply, checked: one count per class, non-negative, consistent (correct <= n,
    Σ predicted = Σ labels); MalformedUpdate (or KeyError/TypeError) otherwise."""
    info = M.record(r.content, M.INFO, ConfigRecord)
    if str(info[M.F_CLIENT_ID]) != cid:
        raise M.MalformedUpdate(f"answers as {info[M.F_CLIENT_ID]!s}, expected {cid}")
    what = f"evaluation counts of {cid}"
    cfg = M.record(r.content, M.EVAL, ConfigRecord)
    labels = _ints(cfg, M.F_VAL_LABELS, num_classes, what)
    correct = _ints(cfg, M.F_VAL_CORRECT, num_classes, what)
    predicted = _ints(cfg, M.F_VAL_PREDICTED, num_classes, what)
    (t_n,) = _ints(cfg, M.F_TARGET_N, None, what)
    (t_correct,) = _ints(cfg, M.F_TARGET_CORRECT, None, what)
    if any(c > n for c, n in zip(correct, labels)) or sum(predicted) != sum(labels) or t_correct > t_n:
        raise M.MalformedUpdate(f"{what} do not add up (more correct than images, or predictions than images)")
    return SiteCounts(labels, correct, predicted, t_n, t_correct)


def pool(counts: dict[str, SiteCounts], expected: list[str] | None = None) -> Evaluation:
    """The round's evaluation from the sites' counts: Σ correct / Σ n (the central evaluation's numbers). The sites
    of `expected` (every site of the run) without counts make it partial (Evaluation.missing, EVAL_MISSING in the
    record): best-val selection does not compare it with complete rounds."""
    missing = tuple(sorted(set(expected or ()) - set(counts)))
    k = len(next(iter(counts.values())).val_labels) if counts else 0
    labels = [sum(c.val_labels[j] for c in counts.values()) for j in range(k)]
    predicted = [sum(c.val_predicted[j] for c in counts.values()) for j in range(k)]
    val_n = sum(labels)
    val_correct = sum(sum(c.val_correct) for c in counts.values())
    target_n = sum(c.target_n for c in counts.values())
    target_correct = sum(c.target_correct for c in counts.values())
    return Evaluation(
        val_acc=pooled_accuracy(val_correct, val_n),
        target_acc=pooled_accuracy(target_correct, target_n),
        val_pred_classes=sum(1 for p in predicted if p),
        val_labels=sum(1 for n in labels if n),
        val_n=val_n,
        record={
            VAL_N: val_n,
            TARGET_N: target_n,
            EVAL_SITES: len(counts),
            **({EVAL_MISSING: list(missing)} if missing else {}),
        },
        missing=missing,
    )
