"""What a ServerApp run writes to its report folder, <work_dir>/run-<run id>/ (fedccrl_core/foundation/contract.py):
rounds.jsonl (one record per finished round, and under train.privacy the epsilon record of a round stopped after a
release; read by the launcher), status.json (running | completed | failed | stopped, with the error), server.log and
result.pt (`FlowerResult`, read by the launcher with `read_result`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict

from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.learning.model_file import atomic_torch_save, torch_load


class FlowerResult(Record):
    """A completed run's result.pt: the RunResult fields (fedccrl_core/federation/loop.py) and the transport's own."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    history: list[RoundRecord]  # the round records (fedccrl_core/federation/round_record.py)
    final_weights: dict[str, torch.Tensor]
    best_weights: dict[str, torch.Tensor]
    best_round: int
    resumed_from: int
    extra: dict[str, Any]  # refused and dropped clients, the engine


def read_result(folder: str | Path) -> FlowerResult:
    """The result.pt of a report folder; DataError naming the file and the key when it is not one."""
    path = Path(folder) / contract.FLOWER_RESULT_FILE
    return parse_record(FlowerResult, torch_load(path), str(path))


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

    def result(self, result: FlowerResult) -> None:
        atomic_torch_save(result.to_dict(), self.folder / contract.FLOWER_RESULT_FILE)

    def append_record(self, rec: RoundRecord | SpentRecord) -> None:
        with open(self.folder / contract.FLOWER_ROUNDS_FILE, "a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        self._log_file.close()
