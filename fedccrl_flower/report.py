"""What a ServerApp run writes to its report folder, <work_dir>/run-<run id>/ (fedccrl_core/foundation/contract.py):
rounds.jsonl (one record per finished round, read by the launcher), status.json (running | completed | failed |
stopped, with the error) and server.log."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text


class RunReport:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
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

    def append_record(self, rec: dict) -> None:
        with open(self.folder / contract.FLOWER_ROUNDS_FILE, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        self._log_file.close()
