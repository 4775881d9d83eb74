"""One round over Flower (`FlowerRound`): made by the QUERY phase (query_phase.py), filled by the TRAIN phase
(train_phase.py) and the EVALUATE phase (evaluate_phase.py); the round record's transport fields are built from it
(`record`): wire bytes, clients, refused and dropped counts, timeouts, per-client upload/payload sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedccrl_core.algorithms.base import Reply
from fedccrl_core.federation.loop import nbytes
from fedccrl_flower.replies import Ledger


@dataclass
class FlowerRound:
    """What one round's QUERY made (who answered, from which node, with which n_i and upload) and what its TRAIN
    and EVALUATE exchanges added."""

    rnd: int
    uploads: dict[str, Any]  # source client -> its upload (lines 3-6), in client-id order
    node_of: dict[str, int]  # source client -> the node it answered from
    n_of: dict[str, int]  # source client -> the n_i it announced
    eval_node_of: dict[str, int]  # evaluation-only site -> its node
    released: list[dict[str, tuple[int, int]]]  # the query's statistics releases (replies.query_releases)
    query_timeout_s: float
    query_wire_up: int
    query_wire_down: int
    told_n: dict[str, int]  # source client -> the n_i it told when it refused the round's release (query_phase.py)
    train_timeout_s: float | None = None
    train_wire_up: int = 0
    train_wire_down: int = 0
    eval_wire_up: int = 0
    eval_wire_down: int = 0
    payloads: dict[str, Any] = field(default_factory=dict)  # client -> the server's payload (line 7)
    replies: list[Reply] = field(default_factory=list)  # the valid TRAIN replies, weights dropped

    def sites(self, gone: set[str]) -> dict[str, int]:
        """Every site that answered the QUERY (source and evaluation-only) and is not in `gone`: client -> node."""
        return {c: n for c, n in {**self.node_of, **self.eval_node_of}.items() if c not in gone}

    def record(self, ledger: Ledger) -> dict:
        """The round record's fields of the Flower transport."""
        rec = {
            "wire_bytes_up": self.query_wire_up + self.train_wire_up,
            "wire_bytes_down": self.query_wire_down + self.train_wire_down,
            "eval_wire_bytes_up": self.eval_wire_up,
            "eval_wire_bytes_down": self.eval_wire_down,
            "clients": len(self.replies),
            **ledger.record(self.rnd),
            "query_timeout_s": self.query_timeout_s,
            "train_timeout_s": self.train_timeout_s,
        }
        for cid in self.uploads:
            rec[f"upload_bytes/{cid}"] = nbytes(self.uploads[cid])
            rec[f"payload_bytes/{cid}"] = nbytes(self.payloads.get(cid))
        return rec
