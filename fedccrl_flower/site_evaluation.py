"""An evaluation-only federated run: the ServerApp asks sites to evaluate a trained model on their own images,
without training (`fedccrl evaluate-sites`, pipeline/fedccrl_pipeline/evaluate_sites.py), and the launcher that
submits it to a SuperLink and follows it.

The ServerApp (server_app.py's `main` hands a run whose run config says TASK_SITE_EVAL to `serve_site_evaluation`)
reads the model file named by the spec (tensors and plain data only: model_file.torch_load), then over the Grid:
  1. SITE_EVAL_QUERY to every connected SuperNode: each answers with its client id, or refuses by its client id with
     the reason its data does not fit the model (site_eval_client.py: the training run's check_site_data; read as a
     training's QUERY reply, replies.py read_query_reply and SiteRefusal);
  2. SITE_EVAL to each site the operator asked for that answered and fits: the model's weights (an ArrayRecord,
     never a pickle) and the split the operator's command chose for it ("val" | "all"); each returns counts
     (evalsets.py SiteCounts, checked by read_eval_reply).
A site asked for that does not answer (not connected, a timeout, gone) is dropped; one whose ClientApp raised, or
whose reply is malformed, is refused; both by client id (node id where it never said) with the reason. The outcome
(`SiteEvalOutcome`) goes to <work_dir>/run-<run id>/ beside status.json and server.log (report.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_flower import messages as M
from fedccrl_flower.evalsets import read_eval_reply
from fedccrl_flower.federation import LOG, Federation
from fedccrl_flower.processes import FlowerRunError
from fedccrl_flower.replies import BAD_REPLY, SiteRefusal, read_query_reply
from fedccrl_flower.report import RunReport
from fedccrl_flower.spec import ClientSpec, SiteEvalSpec, report_dir
from fedccrl_flower.transport import error_reason, exchange, wait_for_nodes

OUTCOME_FILE = "site_eval.json"  # in the run's report folder: the SiteEvalOutcome


class Counts(Record):
    """A site's counts per class k: images of class k, of them right, images predicted as k."""

    labels: list[int]
    correct: list[int]
    predicted: list[int]


class SiteIssue(Record):
    client: str
    reason: str


class SiteEvalOutcome(Record):
    counts: dict[str, Counts]
    refused: list[SiteIssue]
    dropped: list[SiteIssue]


def read_outcome(folder: str | Path) -> SiteEvalOutcome:
    path = Path(folder) / OUTCOME_FILE
    return parse_record(SiteEvalOutcome, json.loads(path.read_text()), str(path))


class SiteEvaluation:
    """The ServerApp's evaluation-only run over `grid` (clock and sleep: the tests' simulated ones)."""

    def __init__(
        self, grid: Grid, spec: SiteEvalSpec, log: Callable[[str], None], clock=time.monotonic, sleep=time.sleep
    ):
        self.grid, self.spec, self.log, self.clock, self.sleep = grid, spec, log, clock, sleep
        self.client = ClientSpec.from_json(spec.client_spec, "site-eval spec 'client_spec'")
        self.refused: list[SiteIssue] = []
        self.dropped: list[SiteIssue] = []

    def _message(self, node: int, kind: str, cid: str | None = None, weights=None) -> Message:
        cfg = ConfigRecord({M.F_SPEC: self.spec.client_spec, M.F_ROUND: 1})
        content = RecordDict({M.CONFIG: cfg})
        if cid is not None:
            cfg[M.F_CLIENT_ID], cfg[M.F_SPLIT] = cid, self.spec.splits[cid]
            content[M.WEIGHTS] = weights
        return Message(content, dst_node_id=node, message_type=kind, group_id="site-eval")

    def _issue(self, into: list[SiteIssue], who: str, reason: str, what: str) -> None:
        into.append(SiteIssue(client=who, reason=reason))
        self.log(f"{what} {who}: {reason}")

    def who(self, nodes: list[int]) -> dict[str, int]:
        """Phase 1: {client id: node} of the asked sites that answered and fit the model."""
        msgs = [self._message(n, M.SITE_EVAL_QUERY) for n in nodes]
        replies, missing, _ = exchange(self.grid, msgs, self.spec.reply_timeout_s, "query", self.clock, self.sleep)
        self.log(f"{len(replies)} of {len(nodes)} SuperNode(s) answered who they are")
        node_of: dict[str, int] = {}
        for node, r in sorted(replies.items()):
            if r.has_error():
                reason, detail = error_reason(r)
                self._issue(self.dropped if reason != "error" else self.refused, f"node {node}", detail, reason)
                continue
            try:
                cid, _, _ = read_query_reply(r)
            except SiteRefusal as e:  # the site's own check, by its client id with its reason
                if e.client in self.spec.splits:
                    self._issue(self.refused, e.client, f"its data does not fit the model: {e}", "REFUSED")
                continue
            except BAD_REPLY as e:
                self._issue(self.refused, f"node {node}", f"malformed reply: {e}", "REFUSED")
                continue
            if cid not in self.spec.splits:
                self.log(f"{cid} (node {node}) is not asked to evaluate")
            elif cid in node_of:
                self._issue(self.refused, cid, f"answered from two SuperNodes ({node_of[cid]}, {node})", "REFUSED")
                node_of.pop(cid)
            elif not any(p.client == cid for p in self.refused):
                node_of[cid] = node
        for node in sorted(missing):
            self._issue(self.dropped, f"node {node}", missing[node][1], "dropped")
        return node_of

    def counts(self, node_of: dict[str, int], weights) -> dict[str, Counts]:
        """Phase 2: the model on each site's images: its counts, checked."""
        msgs = [self._message(node_of[c], M.SITE_EVAL, c, weights) for c in sorted(node_of)]
        replies, missing, _ = exchange(self.grid, msgs, self.spec.reply_timeout_s, "evaluate", self.clock, self.sleep)
        cid_of = {n: c for c, n in node_of.items()}
        out = {}
        for node, r in sorted(replies.items()):
            cid = cid_of[node]
            if r.has_error():
                reason, detail = error_reason(r)
                self._issue(self.dropped if reason != "error" else self.refused, cid, detail, reason)
                continue
            try:
                c = read_eval_reply(r, cid, self.client.num_classes)
            except BAD_REPLY as e:
                self._issue(self.refused, cid, f"malformed counts: {e}", "REFUSED")
                continue
            out[cid] = Counts(labels=c.val_labels, correct=c.val_correct, predicted=c.val_predicted)
            self.log(f"{cid}: {sum(c.val_correct)} of {sum(c.val_labels)} right ({self.spec.splits[cid]})")
        for node in sorted(missing):
            self._issue(self.dropped, cid_of[node], missing[node][1], "dropped")
        return out

    def run(self) -> SiteEvalOutcome:
        from fedccrl_core.algorithms import load_model

        model, _ = load_model(self.spec.model_file)
        weights = M.arrays_to_record({k: v.detach().cpu() for k, v in model.state_dict().items()})
        s = self.spec
        nodes = wait_for_nodes(self.grid, 1, len(s.splits), 1, s.wait_for_clients_s, self.clock, self.sleep)
        node_of = self.who(nodes)
        counts = self.counts(node_of, weights) if node_of else {}
        named = {p.client for p in self.refused + self.dropped} | set(counts)
        for cid in sorted(set(s.splits) - named):
            self._issue(self.dropped, cid, "did not answer (not connected, or its node was dropped above)", "dropped")
        return SiteEvalOutcome(counts=counts, refused=self.refused, dropped=self.dropped)


def serve_site_evaluation(grid: Grid, context: Context) -> None:
    """The ServerApp's `main` for a run config of TASK_SITE_EVAL: the run, its outcome and status in its report."""
    spec = parse_record(SiteEvalSpec, json.loads(str(context.run_config[M.RUN_SPEC])), "run config 'spec'", ValueError)
    report = RunReport(report_dir(spec.work_dir, context.run_id))
    try:
        report.status("running")
        outcome = SiteEvaluation(grid, spec, report.log).run()
        write_text(report.folder / OUTCOME_FILE, json.dumps(outcome.model_dump(mode="json")))
        report.status("completed")
    except BaseException as e:
        report.log(f"FAILED: {e.__class__.__name__}: {e}")
        report.status("failed", error=f"{e.__class__.__name__}: {e}")
        raise
    finally:
        report.close()


def evaluate_on_superlink(
    spec: SiteEvalSpec, superlink: str, root_certificates: str, timeout_s: float, log=LOG, poll_s: float = 0.5
) -> SiteEvalOutcome:
    """Submit the evaluation-only run to the SuperLink at `superlink` and follow it, its server log on stderr, to
    its outcome; FlowerRunError when it fails, is stopped or outlives `timeout_s` (0: no limit)."""
    work = Path(spec.work_dir)
    with Federation(work / "federation", superlink, root_certificates, log=log) as fed:
        run_id = fed.submit(spec, {M.RUN_TASK: M.TASK_SITE_EVAL})
        log(f"evaluate-sites: run {run_id} on SuperLink {superlink}")
        folder, seen, t0 = report_dir(work, run_id), 0, time.monotonic()
        while True:
            seen = _echo_log(folder, seen, log)
            st_path = folder / contract.FLOWER_STATUS_FILE
            st = json.loads(st_path.read_text()) if st_path.is_file() else {}
            if st.get("status") == "completed":
                return read_outcome(folder)
            if st.get("status") in ("failed", "stopped"):
                raise FlowerRunError(f"evaluate-sites run {run_id} {st['status']}: {st.get('error')}")
            fed.check_alive()
            if timeout_s and time.monotonic() - t0 > timeout_s:
                fed.stop_run(run_id)
                raise FlowerRunError(f"evaluate-sites run {run_id} did not finish within {timeout_s:.0f}s")
            time.sleep(poll_s)


def _echo_log(folder: Path, seen: int, log) -> int:
    """The server log's lines after the first `seen`, on stderr (the operator's progress); the new count."""
    path = folder / contract.FLOWER_LOG_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines[seen:]:
        log(line)
    return len(lines)
