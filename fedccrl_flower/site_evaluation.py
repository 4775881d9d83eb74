"""An evaluation-only federated run: the ServerApp asks sites to evaluate a trained model on their own images,
without training (`fedccrl evaluate-sites`, pipeline/fedccrl_pipeline/evaluate_sites.py), and the launcher that
submits it to a SuperLink and follows it.

The ServerApp (server_app.py's `main` hands a run whose run config says TASK_SITE_EVAL to `serve_site_evaluation`)
reads the model (`read_model`: downloaded from the MLflow run the operator logged it to, or, sharing the operator's
disk, at the spec's path; refused unless its bytes have the spec's sha256; tensors and plain data only:
model_file.torch_load) before anything is sent to a site, then over the Grid:
  1. SITE_EVAL_QUERY to every connected SuperNode: each answers with its client id, or refuses by its client id with
     the reason its data does not fit the model (site_eval_client.py: the training run's check_site_data; read as a
     training's QUERY reply, replies.py read_query_reply and SiteRefusal);
  2. SITE_EVAL to each site the operator asked for that answered and fits: the model's weights (an ArrayRecord,
     never a pickle) and the split the operator's command chose for it ("val" | "all"); each returns counts
     (evalsets.py SiteCounts, checked by read_eval_reply).
A site asked for that does not answer (not connected, a timeout, gone) is dropped; one whose ClientApp raised, or
whose reply is malformed, is refused; both by client id (node id where it never said) with the reason (replies sorted
by replies.py `triage`, as a training's phases sort theirs). The outcome (`SiteEvalOutcome`) goes to
<work_dir>/run-<run id>/ beside status.json and server.log (report.py) and, with the spec's `report_to`, with the
status to that MLflow run (tracked_report.py), where the launcher follows it without the SuperLink host's disk.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from fedccrl_core.data.checksums import require_sha256
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_flower import messages as M
from fedccrl_flower.evalsets import read_eval_reply
from fedccrl_flower.federation import LOG, Federation
from fedccrl_flower.processes import FlowerRunError
from fedccrl_flower.replies import Unusable, read_query_reply, triage
from fedccrl_flower.report import FolderReader, RunReport
from fedccrl_flower.spec import ClientSpec, SiteEvalSpec, report_dir
from fedccrl_flower.tracked_report import TrackedReader, TrackedWriter, fetch_artifact
from fedccrl_flower.transport import exchange, phase_config, wait_for_nodes

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


def read_outcome(path: str | Path) -> SiteEvalOutcome:
    """The outcome file at `path` (the report folder's OUTCOME_FILE, or its download); DataError naming it."""
    return parse_record(SiteEvalOutcome, json.loads(Path(path).read_text()), str(path))


def read_model(spec: SiteEvalSpec) -> dict[str, torch.Tensor]:
    """The model's weights, before anything is sent to a site: the file downloaded from the tracking server
    (`model_artifact` of report_to's run) or read at `model_file`, its bytes refused unless they have
    `model_sha256` (naming both digests), loaded with the weights-only unpickler (tensors and plain data only)."""
    from fedccrl_core.algorithms import load_model

    with tempfile.TemporaryDirectory(prefix="fedccrl-site-eval-") as tmp:
        if spec.report_to is not None and spec.model_artifact:
            path = fetch_artifact(spec.report_to, spec.model_artifact, spec.model_sha256, tmp)
        else:
            path = Path(spec.model_file)
            if not path.is_file():
                raise DataError(
                    f"{path}: the spec's model_file is not a file on the ServerApp's host (an operator who does not "
                    "share its disk sends the model through MLflow: fedccrl evaluate-sites --mlflow)"
                )
            require_sha256(path, spec.model_sha256, f"{path} (the spec's model_file)")
        model, _ = load_model(path)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


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
        cfg = phase_config(self.spec.client_spec, 1, cid)
        content = RecordDict({M.CONFIG: cfg})
        if cid is not None:
            cfg[M.F_SPLIT] = self.spec.splits[cid]
            content[M.WEIGHTS] = weights
        return Message(content, dst_node_id=node, message_type=kind, group_id="site-eval")

    def _issue(self, into: list[SiteIssue], who: str, reason: str, what: str) -> None:
        into.append(SiteIssue(client=who, reason=reason))
        self.log(f"{what} {who}: {reason}")

    def _unusable(self, who: str, got: Unusable, malformed: str) -> None:
        """A reply of `who` that cannot be used: dropped when its node is gone; refused when its ClientApp raised, the
        site refused (a site asked for, by its client id) or the reply is malformed (`malformed`: what it is)."""
        if got.kind == "error":
            self._issue(self.dropped if got.reason != "error" else self.refused, who, got.detail, got.reason)
        elif got.kind == "refusal":  # the site's own check, by its client id with its reason
            if got.client in self.spec.splits:
                self._issue(self.refused, str(got.client), f"its data does not fit the model: {got.detail}", "REFUSED")
        else:
            self._issue(self.refused, who, f"{malformed}: {got.detail}", "REFUSED")

    def who(self, nodes: list[int]) -> dict[str, int]:
        """Phase 1: {client id: node} of the asked sites that answered and fit the model."""
        msgs = [self._message(n, M.SITE_EVAL_QUERY) for n in nodes]
        replies, missing, _ = exchange(self.grid, msgs, self.spec.reply_timeout_s, "query", self.clock, self.sleep)
        self.log(f"{len(replies)} of {len(nodes)} SuperNode(s) answered who they are")
        node_of: dict[str, int] = {}
        for node, got in triage(replies, lambda n, r: read_query_reply(r)):
            if isinstance(got, Unusable):
                self._unusable(f"node {node}", got, "malformed reply")
                continue
            cid = got[0]
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
        for node, got in triage(replies, lambda n, r: read_eval_reply(r, cid_of[n], self.client.num_classes)):
            cid = cid_of[node]
            if isinstance(got, Unusable):
                self._unusable(cid, got, "malformed counts")
                continue
            out[cid] = Counts(labels=got.val_labels, correct=got.val_correct, predicted=got.val_predicted)
            self.log(f"{cid}: {sum(got.val_correct)} of {sum(got.val_labels)} right ({self.spec.splits[cid]})")
        for node in sorted(missing):
            self._issue(self.dropped, cid_of[node], missing[node][1], "dropped")
        return out

    def run(self) -> SiteEvalOutcome:
        weights = M.arrays_to_record(read_model(self.spec))
        s = self.spec
        nodes = wait_for_nodes(self.grid, 1, len(s.splits), 1, s.wait_for_clients_s, self.clock, self.sleep)
        node_of = self.who(nodes)
        counts = self.counts(node_of, weights) if node_of else {}
        named = {p.client for p in self.refused + self.dropped} | set(counts)
        for cid in sorted(set(s.splits) - named):
            self._issue(self.dropped, cid, "did not answer (not connected, or its node was dropped above)", "dropped")
        return SiteEvalOutcome(counts=counts, refused=self.refused, dropped=self.dropped)


def serve_site_evaluation(grid: Grid, context: Context) -> None:
    """The ServerApp's `main` for a run config of TASK_SITE_EVAL: the run, its outcome and status in its report
    (with the spec's `report_to`, also in that MLflow run: tracked_report.py)."""
    spec = parse_record(SiteEvalSpec, json.loads(str(context.run_config[M.RUN_SPEC])), "run config 'spec'", ValueError)
    tracked = TrackedWriter(spec.report_to, context.run_id) if spec.report_to is not None else None
    report = RunReport(report_dir(spec.work_dir, context.run_id), tracked)
    try:
        report.status("running")
        outcome = SiteEvaluation(grid, spec, report.log).run()
        write_text(report.folder / OUTCOME_FILE, json.dumps(outcome.model_dump(mode="json")))
        if tracked is not None:
            tracked.result(report.folder / OUTCOME_FILE)  # its digest goes with `completed`
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
    """Submit the evaluation-only run to the SuperLink at `superlink` and follow it to its outcome: through the MLflow
    run of the spec's `report_to` (nothing is read on the SuperLink's host), or without one in its work folder, its
    server log on stderr; FlowerRunError when it fails, is stopped or outlives `timeout_s` (0: no limit)."""
    work = Path(spec.work_dir)
    with Federation(work / "federation", superlink, root_certificates, log=log) as fed:
        run_id = fed.submit(spec, {M.RUN_TASK: M.TASK_SITE_EVAL})
        log(f"evaluate-sites: run {run_id} on SuperLink {superlink}")
        folder, seen, t0 = report_dir(work, run_id), 0, time.monotonic()
        reader = TrackedReader(spec.report_to, run_id) if spec.report_to is not None else FolderReader(folder)
        while True:
            if spec.report_to is None:
                seen = _echo_log(folder, seen, log)
            st = reader.status()
            if st.get("status") == "completed":
                with tempfile.TemporaryDirectory(prefix="fedccrl-site-eval-") as tmp:
                    return read_outcome(reader.fetch(OUTCOME_FILE, tmp))
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
