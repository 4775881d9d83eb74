"""`fedccrl-serve predict`'s output: one record per input (its top-k labels and scores, or its error), written as
JSON lines or CSV rows. JSON output never holds NaN."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

CSV_FIELDS = ("path", "label", "score", "topk", "error")


def prediction_record(path: Path, probs, error, classes, top_k: int) -> dict:
    """One input's record: its top-k labels and scores, or its error."""
    if error is not None:
        return {"path": str(path), "error": error}
    order = np.argsort(-probs, kind="stable")[:top_k]
    return {
        "path": str(path),
        "label": classes[order[0]],
        "score": float(probs[order[0]]),
        "topk": [{"label": classes[j], "score": float(probs[j])} for j in order],
    }


class PredictionWriter:
    """Records onto a stream, one JSON line each (`jsonl`) or one CSV row (`csv`, CSV_FIELDS), flushed as written."""

    def __init__(self, stream, fmt: str):
        self.stream, self.fmt = stream, fmt
        if fmt == "csv":
            self.csv = csv.DictWriter(stream, fieldnames=CSV_FIELDS, lineterminator="\n")
            self.csv.writeheader()

    def write(self, rec: dict) -> None:
        if self.fmt == "jsonl":
            self.stream.write(json.dumps(rec, allow_nan=False) + "\n")
        else:
            row = dict(rec)
            if "topk" in row:
                row["topk"] = json.dumps(row["topk"])
            self.csv.writerow(row)
        self.stream.flush()
