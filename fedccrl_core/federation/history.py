"""A trained run's round history: history.json ({"meta", "best_round", "rounds"}) and history.csv, written by the
train stage (`write_history`, from fedccrl_core/federation/jobs.py `run_one`), read back typed (`load_history`) by
the evaluate, figures and train stages' tracking: validated once where the file is read, and handed on as a
`RunHistory`, so that no reader looks a round's field up by its name.

The round records are federation/round_record.py's, typed where the loop makes them.

Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from fedccrl_core.federation.round_record import RoundRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.learning.model_meta import ModelMeta


class RunPrivacySummary(Record):
    """history.json's `dp` (contract.HISTORY_PRIVACY) of a DP run: how its noise was drawn, the mark of a seeded
    run (privacy/settings.py NOT_PRIVATE_MARK), the domains whose training images it trained on, and the releases
    its ledger charged (privacy/sweep_epsilon.py encode_releases), which the sweep's per-image epsilon composes, and
    its study's epsilon per image when the run finished (every release of every run of the study so far)."""

    noise: str
    delta: float
    trained_domains: list[str]
    releases: str
    mark: str | None = None
    study: str | None = None  # the study ledger's key (privacy/study_ledger.py), absent outside the pipeline
    study_epsilon: dict[str, float] | None = None  # per image of each domain, over every release of the study


class RunHistory(Record):
    """history.json: the run's meta (a model file's, without `round`), the round of the best source-validation
    accuracy, every round, and under train.privacy its privacy summary (`dp`, absent without DP)."""

    meta: ModelMeta
    best_round: int = Field(ge=1)
    rounds: list[RoundRecord] = Field(min_length=1)
    dp: RunPrivacySummary | None = None

    @model_validator(mode="after")
    def _best_round_is_a_round(self) -> RunHistory:
        if not any(r.round == self.best_round for r in self.rounds):
            raise ValueError(f"best_round {self.best_round} is none of the rounds recorded")
        return self

    def refused_sites(self) -> list[str]:
        """Every site the run refused for what it sent or held, one line each naming the round, the client id (its
        node id where the site never said) and the reason: a reply that could not be used, or a site whose ClientApp
        raised (its data check: classes, image size, domain; or a crash). A site that timed out or disconnected was
        dropped, not refused: `dropped_sites`."""
        out = [f"round {r.round}: {x.client}: {x.reason}" for r in self.rounds for x in r.refused_clients or []]
        for r in self.rounds:
            for d in r.dropped_clients or []:
                if d.reason == "error":
                    out.append(f"round {r.round}: {d.client or f'node {d.node}'} raised in {d.phase}: {d.detail}")
        return out

    def dropped_sites(self) -> list[str]:
        """Every site dropped from a round for not answering (timeout, disconnected), one line each."""
        return [
            f"round {r.round}: {d.client or f'node {d.node}'} {d.reason} in {d.phase} ({d.detail})"
            for r in self.rounds
            for d in r.dropped_clients or []
            if d.reason != "error"
        ]

    @property
    def private(self) -> bool:
        """Trained under train.privacy (its noise seeded or not): its held-out domain is scored on its val rows only,
        here and wherever the model is scored again (data/shards.py held_out_parts)."""
        return self.dp is not None

    def at(self, rnd: int) -> RoundRecord:
        """The record of round `rnd`."""
        return next(r for r in self.rounds if r.round == rnd)


def write_history(
    folder: Path,
    meta: ModelMeta,
    best_round: int,
    rounds: list[RoundRecord],
    privacy: RunPrivacySummary | None = None,
) -> RunHistory:
    """history.json and history.csv of a run into `folder` (the run's folder while it is written); the history,
    typed: a record the readers would refuse is refused here, before the run's folder is put in place."""
    doc: dict[str, Any] = {"meta": meta, "best_round": best_round, "rounds": rounds}
    if privacy is not None:
        doc[contract.HISTORY_PRIVACY] = privacy
    history = parse_record(RunHistory, doc, f"{folder / contract.HISTORY_FILE}")
    (folder / contract.HISTORY_FILE).write_text(json.dumps(history.to_dict(), indent=1))
    keys = [*contract.HISTORY_CSV_FIELDS, *sorted({k for r in history.rounds for k in r.loss_terms()})]
    with open(folder / contract.HISTORY_CSV, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(r.to_dict() for r in history.rounds)
    return history


@dataclass(frozen=True)
class SavedRun:
    """A trained run's folder (its model files) and its history, read by `load_history`."""

    dir: Path
    history: RunHistory

    @property
    def meta(self) -> ModelMeta:
        return self.history.meta


def load_history(run: Path) -> RunHistory:
    """The history.json of the run folder `run`, typed; DataError naming the file and the key otherwise."""
    path = Path(run) / contract.HISTORY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (was the train stage interrupted?)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    history = parse_record(RunHistory, data, str(path))
    history.meta.require(path, "algorithm", "seed", "held_out_domain")  # what the readers group the runs by
    return history
