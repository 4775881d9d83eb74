"""Following a submitted Flower run to its result (`wait_for_result`): its round records as they appear, its status,
then its result, read from the MLflow run the spec's `report_to` names (tracked_report.py: the ServerApp on the
SuperLink's host, no shared disk) or else from its work folder (report.py); a run that fails, stops, ends without
a result or passes its time limit is a FlowerRunError."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fedccrl_core.federation.loop import RunResult
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_flower.federation import Federation
from fedccrl_flower.flower_result import FlowerResult
from fedccrl_flower.processes import FlowerRunError
from fedccrl_flower.report import FolderReader
from fedccrl_flower.spec import ReportTo, report_dir
from fedccrl_flower.tracked_report import TrackedReader


def _completed(res: FlowerResult, run_id: int) -> RunResult:
    """The result the ServerApp reported, with the Flower run's id."""
    return RunResult(
        res.history,
        res.final_weights,
        res.best_weights,
        res.best_round,
        resumed_from=res.resumed_from,
        extra={**res.extra, "run_id": run_id},
    )


def wait_for_result(
    fed: Federation,
    run_id: int,
    work_dir: Path,
    on_round: Callable[[RoundRecord | SpentRecord], None] | None = None,
    timeout: float = 0.0,
    poll_s: float = 0.5,
    status_every_s: float = 15.0,
    report_to: ReportTo | None = None,
) -> RunResult:
    """Follow the run's round records (calling on_round per record) until the ServerApp reports completion: from
    the MLflow run `report_to` names (tracked_report.py; nothing is read under `work_dir`, on the SuperLink's
    host), or without one from <work_dir>/run-<run id>/ (report.py FolderReader: the launcher shares that disk)."""
    on_round = on_round or (lambda rec: None)
    reader = TrackedReader(report_to, run_id) if report_to else FolderReader(report_dir(work_dir, run_id))
    seen, t0, next_status = 0, time.monotonic(), time.monotonic() + status_every_s

    def drain():
        nonlocal seen
        for rec in reader.new_records(seen):
            on_round(rec)
            seen += 1

    while True:
        drain()
        st = reader.status()
        if st.get("status") == "completed":
            drain()
            return _completed(reader.result(), run_id)
        if st.get("status") in ("failed", "stopped"):
            drain()  # a record written just before the status (the epsilon a stopped round spent)
            raise FlowerRunError(f"Flower run {run_id} {st['status']}: {st.get('error')}")
        fed.check_alive()
        now = time.monotonic()
        if now >= next_status:
            next_status = now + status_every_s
            flwr_status = fed.status(run_id).get("status", "")
            if flwr_status.startswith("finished"):
                time.sleep(2.0)  # the ServerApp may be reporting its status right now
                if reader.status().get("status") not in ("completed", "failed", "stopped"):
                    raise FlowerRunError(
                        f"Flower run {run_id} ended as {flwr_status} without a result; "
                        f"ServerApp log:\n{fed.server_log(run_id)}"
                    )
        if timeout and now - t0 > timeout:
            fed.stop_run(run_id)
            raise FlowerRunError(f"Flower run {run_id} did not finish within {timeout:.0f}s")
        time.sleep(poll_s)
