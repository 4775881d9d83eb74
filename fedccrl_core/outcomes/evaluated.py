"""An evaluated run (results/runs/<algorithm>/s<seed>/d<entry>.json, the evaluate stage's file): typed where it is
made (fedccrl_core/outcomes/runs.py), written by `write_result` and read back by `load_result`, the one writer and
the one reader; the report and figures stages read its fields by name, never its keys.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record


class Scored(Record):
    """One selection's model (the final round's, or the val-selected round's) on the held-out domain: its target
    accuracy and round; with the held-out images on this machine, its per-class accuracy and confusion matrix."""

    target_acc: float
    round: int | None
    per_class_acc: dict[str, float] | None = None
    confusion: list[list[int]] | None = None


class Selections(Record):
    final: Scored
    best_val: Scored


class RoundPoint(Record):
    """A round's target and validation accuracy (the curves)."""

    round: int
    target_acc: float
    val_acc: float


class EvaluatedRun(Record):
    """A run evaluated on its held-out domain: the final-round and the val-selected target accuracy (DomainBed's
    training-domain validation), their detail, the communication per round and the per-round accuracies."""

    dataset: str | None
    algorithm: str
    seed: int
    held_out_domain: str
    held_out_index: int | None
    classes: list[str]
    platform: str | None
    n_test: int | None  # the held-out images the accuracies cover
    mlflow_run_id: str | None
    final_target_acc: float
    best_val_target_acc: float
    best_round: int
    final_val_acc: float
    detail: Selections
    bytes_up_per_round: float
    bytes_down_per_round: float
    per_round: list[RoundPoint]
    partition: dict[str, Any] = Field(
        default_factory=dict
    )  # the central partition's params (partition.*); {} for a deployment's sites
    evaluated_on: str | None = None  # a deployment's: who measured the accuracies
    detail_n_test: int | None = None  # a deployment's: the operator's own test images of `detail`
    detail_on: str | None = None  # a deployment's: the operator's test folder

    def line(self, how: str = "") -> str:
        """The run's one line on stderr."""
        return (
            f"{self.algorithm} s{self.seed} {self.held_out_domain}: final {self.final_target_acc:.4f} "
            f"best-val {self.best_val_target_acc:.4f} (round {self.best_round}){how}"
        )


def write_result(run: EvaluatedRun, out: Path) -> None:
    """The evaluated run's file at `out` (complete or absent)."""
    from fedccrl_core.foundation.fsio import write_text

    write_text(out, json.dumps(run.to_dict(), indent=1))


def load_result(path: Path) -> EvaluatedRun:
    """The evaluated run at `path`, typed; DataError naming the file and the key otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    return parse_record(EvaluatedRun, data, str(path))
