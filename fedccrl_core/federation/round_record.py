"""The round record, the run's central record: typed where the round loop makes it (federation/loop.py), carried typed
to every consumer (the round checkpoint, the Flower report and launcher, MLflow, history.json and history.csv).

A record has the fields every round has (ROUND ... BYTES_DOWN of fedccrl_core/foundation/contract.py, in the order
the loop writes them), the optional fields of the clients' metrics, of a federated evaluation, of the Flower
transport and of train.privacy, each declared below; and the metrics whose names the run decides, numbers only: the
algorithm's own (its loss terms "l_*" and what its clients report, Eq. 2's n_i-weighted means), and the per-client
families ("train_acc/<client>", "upload_bytes/<client>", "payload_bytes/<client>"). A field left out stays out on
disk: the record written is the record made.

`SpentRecord` is what a run stopped after a release logs for that round (train.privacy): the epsilon spent alone,
not a round of the history.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Any, Self, cast

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.records import Record


class ClientDropped(Record):
    """A client that did not answer a Flower round's phase, was unavailable or raised (fedccrl_flower/replies.py)."""

    client: str | None  # None: the node never said which client it serves
    node: int
    phase: str
    reason: str
    detail: str


class ClientRefused(Record):
    """A reply that arrived but could not be used (malformed arrays, wrong client, ...)."""

    client: str
    reason: str


# privacy/accountant.py STATISTICS and WEIGHTS, spelled here so that a record is read without importing dp_accounting
RELEASE_CHANNELS = ("statistics", "weights")


class LedgerReleases(Record):
    """The releases a run's ledger charged since the previous record this process made (its first record: since the
    ledger began, a resume's inherited ones included), each [channel, round, population, sample, z] as accountant.py
    RunPrivacy.state() holds it, from index `start` of the ledger `ledger` (privacy/ledger_file.py: one id per run,
    kept by a resume). A record carries them only when the process appended them to no study ledger itself (it found
    no study pointer: a deployment's ServerApp), so that `fedccrl federate` counts them in the operator's study once
    each, keyed by (ledger, index) (privacy/study_ledger.py append_reported)."""

    ledger: str = Field(min_length=1)
    start: int = Field(ge=0)
    releases: list[list[str | int | float]]

    @model_validator(mode="after")
    def _each_a_release(self) -> LedgerReleases:
        for i, r in enumerate(self.releases):
            if not _is_release(r):
                raise ValueError(
                    f"releases[{i}] = {r!r} is not [channel ('statistics' | 'weights'), round, population, sample "
                    "(0 < sample <= population), z (> 0)]"
                )
        return self


def _is_release(r: list) -> bool:
    if len(r) != 5:
        return False
    channel, rnd, population, sample, z = r
    if channel not in RELEASE_CHANNELS or not all(type(v) is int for v in (rnd, population, sample)):
        return False
    return rnd >= 1 and 0 < sample <= population and type(z) in (int, float) and z > 0


class _Epsilons(Record):
    """train.privacy's fields of a record: epsilon at its delta so far, both channels composed and each alone, and
    the not-private flag of a seeded noise."""

    model_config = ConfigDict(populate_by_name=True)

    # the keys in the order the record was made with (not written: the order of what is)
    key_order: tuple[str, ...] = Field(default=(), exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _keep_order(cls, data: Any) -> Any:
        if isinstance(data, dict) and "key_order" not in data:
            return {**data, "key_order": tuple(data)}
        return data

    @model_serializer(mode="wrap")
    def _in_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The record as written (history.json, rounds.jsonl, the checkpoint), also inside another record: the keys
        it was made with, in their order (those set only: Record.to_dict)."""
        d = handler(self)
        return {**{k: d[k] for k in self.key_order if k in d}, **d}

    dp_epsilon: float | None = None
    dp_epsilon_statistics: float | None = Field(None, alias=contract.DP_EPSILON_STATISTICS)
    dp_epsilon_weights: float | None = Field(None, alias=contract.DP_EPSILON_WEIGHTS)
    dp_seeded_noise: float | None = None
    dp_releases: LedgerReleases | None = None  # contract.DP_RELEASES

    def __contains__(self, name: object) -> bool:
        """Whether the record has the field `name` (a contract.py name, a loss term): pydantic iterates a model as
        (name, value) pairs, so `in` would otherwise never find a name."""
        return name in self.to_dict()

    def metric(self, name: str) -> float | None:
        """The number named `name` (a contract.py field, a loss term), None where the round has none."""
        value = self.to_dict().get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def without_epsilon(self) -> Self:
        """The record as a seeded run reports it (train.privacy.noise_seed: not private): no epsilon, which does not
        apply to noise that anyone with the params file removes; dp_seeded_noise stays. Built from this record's
        values, validated already."""
        fields = type(self).model_fields
        epsilons = {k for k, f in fields.items() if (f.alias or k) in contract.DP_EPSILON_KEYS}
        values = {k: getattr(self, k) for k in self.model_fields_set if k not in epsilons}
        values.update(self.model_extra or {})
        values["key_order"] = tuple(k for k in self.key_order if k not in contract.DP_EPSILON_KEYS)
        return cast(Self, type(self).model_construct(**values))

    def numbers(self) -> dict[str, float]:
        """Every number of the record but its round, by its contract.py name: MLflow's metrics at the round's step."""
        return {
            k: float(v)
            for k, v in self.to_dict().items()
            if k != contract.ROUND and isinstance(v, (int, float)) and not isinstance(v, bool)
        }


class RoundRecord(_Epsilons):
    """One round of a run (module docstring)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    round: int
    val_acc: float
    target_acc: float
    val_pred_classes: int
    seconds: float
    bytes_up: int
    bytes_down: int
    # the clients' reports, Eq. 2's n_i-weighted means (none under train.privacy: the clients send no metrics)
    loss: float | None = None
    train_acc: float | None = None
    lr: float | None = None
    # a federated evaluation's (fedccrl_flower/evalsets.py): the images the sites' counts cover, the sites answering
    val_n: int | None = None
    target_n: int | None = None
    eval_sites: int | None = None
    eval_missing: list[str] | None = None  # sites that did not evaluate: not compared for best-val (loop.py)
    # the Flower transport's (fedccrl_flower/server_app.py): bytes on the wire, who answered, dropped and refused
    wire_bytes_up: int | None = None
    wire_bytes_down: int | None = None
    eval_wire_bytes_up: int | None = None
    eval_wire_bytes_down: int | None = None
    clients: int | None = None
    refused: int | None = None
    dropped: int | None = None
    dropped_clients: list[ClientDropped] | None = None
    refused_clients: list[ClientRefused] | None = None
    query_timeout_s: float | None = None
    train_timeout_s: float | None = None

    @model_validator(mode="after")
    def _metrics_are_numbers(self) -> RoundRecord:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"round {self.round}: {key!r} is a {type(value).__name__}, not a number")
        return self

    def progress(self, rounds: int) -> str:
        """The round in one line, as an operator follows a run: accuracies, who trained and evaluated, and each
        site dropped or refused by its client id (its node id where the site never said which client it is)."""
        parts = [f"round {self.round}/{rounds}: val_acc {self.val_acc:.4f} target_acc {self.target_acc:.4f}"]
        if self.clients is not None:
            parts.append(f"{self.clients} sites trained")
        if self.eval_sites is not None:
            missing = f" (missing {', '.join(self.eval_missing)})" if self.eval_missing else ""
            parts.append(f"{self.eval_sites} evaluated{missing}")
        for d in self.dropped_clients or []:
            parts.append(f"DROPPED {d.client or f'node {d.node}'} in {d.phase}: {d.reason} ({d.detail})")
        for r in self.refused_clients or []:
            parts.append(f"REFUSED {r.client}: {r.reason}")
        return "; ".join(parts)

    def loss_terms(self) -> list[str]:
        """The loss terms the algorithm's train step reported this round (contract.is_loss_term)."""
        return [k for k in self.model_extra or {} if contract.is_loss_term(k)]


class SpentRecord(_Epsilons):
    """A run stopped in round `round` after a release that no round record covers: the epsilon spent (train.privacy),
    logged to MLflow as that round's, so that the last dp_epsilon logged is what was spent."""

    round: int
    dp_stopped: float = 1.0


def parse_round(data: object, where: str) -> RoundRecord | SpentRecord:
    """A record read back from `where` (a line of the Flower report's rounds.jsonl): a SpentRecord when it says so."""
    from fedccrl_core.foundation.records import parse_record

    if isinstance(data, dict) and contract.DP_STOPPED in data:
        return parse_record(SpentRecord, data, where)
    return parse_record(RoundRecord, data, where)
