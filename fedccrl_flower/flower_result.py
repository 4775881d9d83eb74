"""A completed ServerApp run's result.pt (`FlowerResult`): written into its report folder (report.py RunReport), read by
the launcher from there or from the tracking server (tracked_report.py) with `read_result`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict

from fedccrl_core.federation.round_record import RoundRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.learning.model_file import torch_load


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
