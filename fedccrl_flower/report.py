"""What a ServerApp run writes to its report folder, <work_dir>/run-<run id>/ (fedccrl_core/foundation/contract.py):
rounds.jsonl (one record per finished round, and under train.privacy the epsilon record of a round stopped after a
release; read by the launcher), status.json (running | completed | failed | stopped, with the error), server.log and
result.pt (flower_result.py `FlowerResult`, read by the launcher with `read_result`). With a spec's `report_to`, each of these but
the log is also reported through the team's MLflow tracking server (tracked_report.py TrackedWriter), where an
operator without this disk follows it; `FolderReader` follows the folder when the launcher shares it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedccrl_core.federation.round_record import RoundRecord, SpentRecord, parse_round
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.learning.model_file import atomic_torch_save
from fedccrl_flower.flower_result import FlowerResult, read_result

if TYPE_CHECKING:
    from fedccrl_flower.tracked_report import TrackedWriter


class FolderReader:
    """A launcher's side of a report folder it shares with the ServerApp (the same machine): the round records,
    status and result, as tracked_report.py TrackedReader reads them from the tracking server."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def status(self) -> dict[str, Any]:
        path = self.folder / contract.FLOWER_STATUS_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    def new_records(self, seen: int) -> list[RoundRecord | SpentRecord]:
        """The complete lines of rounds.jsonl after the first `seen`."""
        path = self.folder / contract.FLOWER_ROUNDS_FILE
        if not path.is_file():
            return []
        text = path.read_text()
        lines = text.splitlines()
        complete = lines if text.endswith("\n") else lines[:-1]
        return [parse_round(json.loads(line), f"{path} line {i}") for i, line in enumerate(complete, 1) if i > seen]

    def fetch(self, name: str, into: str | Path) -> Path:
        """The report file `name`, where it is (TrackedReader.fetch downloads it into `into`)."""
        return self.folder / name

    def result(self) -> FlowerResult:
        return read_result(self.folder)


class RunReport:
    def __init__(self, folder: str | Path, tracked: TrackedWriter | None = None):
        self.folder = Path(folder)
        self.tracked = tracked
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.folder / contract.FLOWER_LOG_FILE, "a", buffering=1)

    def log(self, msg: str) -> None:
        line = f"[fedccrl server] {msg}"
        print(line, flush=True)
        self._log_file.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def status(self, status: str, **extra) -> None:
        write_text(
            self.folder / contract.FLOWER_STATUS_FILE, json.dumps({"status": status, "time": time.time(), **extra})
        )
        if self.tracked is not None:
            self.tracked.status(status, extra.get("error"))

    def result(self, result: FlowerResult) -> None:
        atomic_torch_save(result.to_dict(), self.folder / contract.FLOWER_RESULT_FILE)
        if self.tracked is not None:
            self.tracked.result(self.folder / contract.FLOWER_RESULT_FILE)

    def append_record(self, rec: RoundRecord | SpentRecord) -> None:
        with open(self.folder / contract.FLOWER_ROUNDS_FILE, "a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tracked is not None:
            self.tracked.append_record(rec)

    def close(self) -> None:
        self._log_file.close()
