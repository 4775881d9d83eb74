"""The EVALUATE phase: the aggregated weights to every site that answered the round's QUERY (every connected source
site, sampled or not, and every evaluation-only site); each returns counts on its own images, which evalsets.py
pools (Σ correct / Σ n: the in-process engine's central numbers). The server reads no data file.

`evaluate_at_sites` needs no round loop: it takes the Grid, the sites' nodes, the weights and the run's spec, so a
model can be evaluated at every site outside a training run too. A site without a valid reply is dropped from the
evaluation (the ledger), not from the run."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedccrl_core.federation.loop import Evaluation
from fedccrl_core.foundation import contract
from fedccrl_flower import messages as M
from fedccrl_flower.evalsets import SiteCounts, pool, read_eval_reply
from fedccrl_flower.replies import Ledger, Unusable, triage
from fedccrl_flower.spec import ServerSpec
from fedccrl_flower.transport import PhaseTimer, phase_config


@dataclass(frozen=True)
class SiteEvaluation:
    """The pooled evaluation and the EVALUATE exchange's bytes on the wire (replies up, messages down)."""

    evaluation: Evaluation
    wire_up: int
    wire_down: int


def evaluate_at_sites(
    grid: Grid,
    sites: dict[str, int],
    weights: dict,
    spec: ServerSpec,
    rnd: int = 0,
    *,
    ledger: Ledger | None = None,
    timer: PhaseTimer | None = None,
    log: Callable[[str], None] | None = None,
) -> SiteEvaluation:
    """EVALUATE `weights` at each site of `sites` (client id -> node) and pool their counts over the run's sites
    (`spec.sources` and `spec.evaluators`: one missing makes the evaluation partial). `ledger`, `timer` and `log`
    default to fresh ones (the spec's timeouts; the log on stderr)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    ledger = ledger or Ledger(log)
    timer = timer or PhaseTimer(spec, log)
    weights_rec = M.arrays_to_record(weights)
    spec_json = spec.client_spec().to_json()
    msgs = [
        Message(
            RecordDict({M.CONFIG: phase_config(spec_json, rnd, cid), M.WEIGHTS: weights_rec}),
            dst_node_id=sites[cid],
            message_type=M.EVALUATE,
            group_id=str(rnd),
        )
        for cid in sorted(sites)
    ]
    ex = timer.exchange(grid, rnd, msgs, "evaluate")
    cid_of = {node: cid for cid, node in sites.items()}
    for node in sorted(ex.missing):
        ledger.drop(rnd, cid_of[node], node, "evaluate", *ex.missing[node])
    counts: dict[str, SiteCounts] = {}
    for node, got in triage(ex.replies, lambda n, r: read_eval_reply(r, cid_of[n], spec.num_classes)):
        if not isinstance(got, Unusable):
            counts[cid_of[node]] = got
        elif got.kind == "error":
            ledger.drop(rnd, cid_of[node], node, "evaluate", got.reason, got.detail)
        else:  # malformed
            ledger.refuse(rnd, cid_of[node], got.detail)
    ev = pool(counts, [*spec.sources, *spec.evaluators])
    if not ev.record[contract.TARGET_N]:
        log(f"round {rnd}: no site holding {spec.held_out} evaluated: target accuracy is NaN")
    return SiteEvaluation(ev, ex.wire_up, ex.wire_down)
