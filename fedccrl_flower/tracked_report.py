"""A ServerApp run's report through the team's MLflow tracking server, for an operator who does not share the
SuperLink host's disk (`fedccrl federate`): the spec's `report_to` (spec.py ReportTo) names the tracking server
and the MLflow run (the operator's child run of the training) to report to.

In that run, per Flower run id:
- artifacts under flower/run-<run id>/, the report folder's names: rounds.jsonl (one round record per line,
  JSON: a RoundRecord, or the SpentRecord of a round stopped after a release; uploaded whole after each round, a
  few kB) and result.pt (`FlowerResult`: tensors and plain data only,
  read with the weights-only unpickler, report.py read_result);
- one tag, fedccrl.flower.run-<run id>: JSON {status, records, error, sha256}, set after the artifacts it counts
  are uploaded, so that a reader that sees it finds them whole: `records` the number of round records uploaded,
  `sha256` the result.pt's digest (set with `completed`), which the reader checks.

`TrackedWriter` is the ServerApp's side (report.py RunReport mirrors every write to it), `TrackedReader` the
operator's (follow.py wait_for_result). An evaluation-only run (site_evaluation.py) reports the same way, its result
site_eval.json; its ServerApp also fetches the model file the operator logged to that run (`fetch_artifact`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fedccrl_core.data.checksums import require_sha256, sha256_file
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord, parse_round
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_flower.flower_result import FlowerResult, read_result
from fedccrl_flower.spec import ReportTo

MAX_ERROR_CHARS = 4000  # a tag's value holds at most 8000 characters (MLflow 3)


def _client(target: ReportTo):
    from mlflow import MlflowClient

    # a download per round record: no progress bar on the operator's stderr per file, unless one is asked for
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    return MlflowClient(tracking_uri=target.tracking_uri)


def artifact_dir(run_id: int) -> str:
    """flower/run-<run id>: the Flower run's artifacts in the MLflow run."""
    return contract.flower_report_dir("flower", run_id).as_posix()


STATUS_TAG_PREFIX = "fedccrl.flower.run-"


def status_tag(run_id: int) -> str:
    return f"{STATUS_TAG_PREFIX}{run_id}"


def reported_runs(tags: dict[str, str]) -> list[int]:
    """The Flower run ids that reported to an MLflow run with `tags` (each has its status tag), in order."""
    ids = [name.removeprefix(STATUS_TAG_PREFIX) for name in tags if name.startswith(STATUS_TAG_PREFIX)]
    return sorted(int(i) for i in ids if i.isdigit())


class TrackedWriter:
    """The ServerApp's side: each round record, the status and the result of Flower run `run_id` to `target`."""

    def __init__(self, target: ReportTo, run_id: int):
        self.target, self.client = target, _client(target)
        self.dir, self.tag = artifact_dir(run_id), status_tag(run_id)
        self.state: dict[str, Any] = {"status": "running", "records": 0}
        self.lines: list[str] = []  # rounds.jsonl's

    def _publish(self) -> None:
        self.client.set_tag(self.target.run_id, self.tag, json.dumps(self.state))

    def status(self, status: str, error: str | None = None) -> None:
        self.state["status"] = status
        if error is not None:
            self.state["error"] = error[-MAX_ERROR_CHARS:]
        self._publish()

    def append_record(self, rec: RoundRecord | SpentRecord) -> None:
        self.lines.append(json.dumps(rec.to_dict()) + "\n")
        self.client.log_text(self.target.run_id, "".join(self.lines), f"{self.dir}/{contract.FLOWER_ROUNDS_FILE}")
        self.state["records"] = len(self.lines)
        self._publish()

    def result(self, path: Path) -> None:
        """Upload the result.pt at `path`; its digest goes with the `completed` status."""
        self.client.log_artifact(self.target.run_id, str(path), self.dir)
        self.state["sha256"] = sha256_file(path)


class TrackedReader:
    """The operator's side: the records, status and result of Flower run `run_id`, as the ServerApp reported them
    to `target`. Reads nothing on the SuperLink's host."""

    def __init__(self, target: ReportTo, run_id: int):
        self.target, self.client = target, _client(target)
        self.dir, self.tag = artifact_dir(run_id), status_tag(run_id)
        self.where = f"MLflow run {target.run_id} at {target.tracking_uri}, {self.dir}"

    def status(self) -> dict[str, Any]:
        """The last status the ServerApp reported ({} before its first)."""
        raw = self.client.get_run(self.target.run_id).data.tags.get(self.tag)
        if raw is None:
            return {}
        try:
            state = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{self.where}: tag {self.tag} is not JSON ({e})") from None
        if not isinstance(state, dict) or not isinstance(state.get("records", 0), int):
            raise DataError(f"{self.where}: tag {self.tag}: not a report status: {raw[:200]}")
        return state

    def new_records(self, seen: int) -> list[RoundRecord | SpentRecord]:
        """The round records after the first `seen`, in order, of those the status counts."""
        count = int(self.status().get("records", 0))
        if count <= seen:
            return []
        where = f"{self.where}/{contract.FLOWER_ROUNDS_FILE}"
        with tempfile.TemporaryDirectory(prefix="fedccrl-rounds-") as tmp:
            name = f"{self.dir}/{contract.FLOWER_ROUNDS_FILE}"
            lines = Path(self.client.download_artifacts(self.target.run_id, name, tmp)).read_text().splitlines()
        if len(lines) < count:
            raise DataError(f"{where}: {len(lines)} record(s), the status reports {count}")
        out = []
        for i in range(seen, count):
            try:
                data = json.loads(lines[i])
            except json.JSONDecodeError as e:
                raise DataError(f"{where} line {i + 1}: not JSON ({e})") from None
            out.append(parse_round(data, f"{where} line {i + 1}"))
        return out

    def fetch(self, name: str, into: str | Path) -> Path:
        """The report file `name` (the result the ServerApp uploaded last) downloaded into the folder `into`, checked
        against the digest the ServerApp reported (fetch_artifact)."""
        return fetch_artifact(self.target, f"{self.dir}/{name}", self.status().get("sha256"), into)

    def result(self) -> FlowerResult:
        """The completed run's result.pt, checked against the digest the ServerApp reported, read without
        unpickling code (report.py read_result); DataError naming the artifact otherwise."""
        with tempfile.TemporaryDirectory(prefix="fedccrl-result-") as tmp:
            return read_result(self.fetch(contract.FLOWER_RESULT_FILE, tmp).parent)


def fetch_artifact(target: ReportTo, name: str, sha256: str | None, into: str | Path) -> Path:
    """The artifact `name` of the MLflow run `target` names, downloaded into the folder `into`, its bytes checked
    against `sha256`; DataError naming the run, the artifact and both digests when they differ, or the run and the
    artifact when it cannot be downloaded (no such run or artifact, the server unreachable)."""
    from mlflow.exceptions import MlflowException

    where = f"MLflow run {target.run_id} at {target.tracking_uri}, artifact {name}"
    try:
        local = Path(_client(target).download_artifacts(target.run_id, name, str(into)))
    except (MlflowException, OSError) as e:
        raise DataError(f"{where}: cannot be downloaded ({e.__class__.__name__}: {e})") from None
    require_sha256(local, sha256, where)
    return local


__all__ = ["TrackedReader", "TrackedWriter", "artifact_dir", "fetch_artifact", "reported_runs", "status_tag"]
