"""train.privacy's ledger on disk: every release of a run as it is charged, in a file beside its round checkpoint
(`<checkpoint>.ledger.json`, federation/checkpoints.py), replaced atomically at each release (fsio). A round
checkpoint is written at the end of a round only, so the file can be ahead of it: a round interrupted after a release
and resumed is charged again, the first attempt's releases included (docs/privacy.md, "Resumed rounds").

The file is plain JSON (nothing in it is run): {"fedccrl_privacy_ledger": 1, "owner": <the run's run_info>, "id":
<the ledger's id>, "releases": [[channel, round, population, sample, noise multiplier], ...]} (RunPrivacy.state()).
The id is drawn when the ledger begins and kept by a resume, so a release is named by (id, its index) wherever it
is counted (privacy/study_ledger.py); a file written before ids gets one at its first resume.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedccrl_core.foundation.fsio import write_json
from fedccrl_core.privacy.accountant import STATISTICS, WEIGHTS, RunPrivacy

FORMAT_KEY, FORMAT = "fedccrl_privacy_ledger", 1
ID_KEY = "id"  # the ledger's id (RunPrivacy.ledger_id), written when it begins and kept by every resume


def read_ledger(path: Path, owner: Any) -> list | None:
    """The releases of the ledger file at `path` written for `owner`; None when there is no file or it is another
    run's. A file that is not a ledger is refused, naming it and what is wrong."""
    kept = _read(path, owner)
    return None if kept is None else kept[1]


def _read(path: Path, owner: Any) -> tuple[str | None, list] | None:
    """(the ledger's id, None in a file from before ids; its releases) of read_ledger."""
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a privacy ledger (not JSON: {e})") from None
    if not isinstance(d, dict) or d.get(FORMAT_KEY) != FORMAT:
        raise ValueError(f"{path}: not a privacy ledger (no '{FORMAT_KEY}': {FORMAT})")
    if d.get("owner") != owner:
        return None
    ledger_id = d.get(ID_KEY)
    if ledger_id is not None and not (isinstance(ledger_id, str) and ledger_id):
        raise ValueError(f"{path}: key '{ID_KEY}' must be a non-empty string")
    rel = d.get("releases")
    if not isinstance(rel, list):
        raise ValueError(f"{path}: key 'releases' must be a list")
    for i, r in enumerate(rel):
        ok = (
            isinstance(r, list)
            and len(r) == 5
            and r[0] in (STATISTICS, WEIGHTS)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in r[1:4])
            and isinstance(r[4], (int, float))
            and not isinstance(r[4], bool)
            and 0 < r[3] <= r[2]
            and r[4] > 0
        )
        if not ok:
            raise ValueError(
                f"{path}: releases[{i}] = {r!r} is not [channel ('{STATISTICS}' | '{WEIGHTS}'), round, population, "
                "sample (0 < sample <= population), noise multiplier (> 0)]"
            )
    return ledger_id, rel


def resume(privacy: RunPrivacy, checkpointed: list | None, path: Path | None, owner: Any) -> int:
    """Start or resume the run's ledger: the releases of the round checkpoint (`checkpointed`), or those of the ledger
    file at `path` when it holds more (a round interrupted after a release: those releases happened and stay
    charged). From now on the file is replaced at every release (RunPrivacy.keep). `owner` (the run's run_info) tells
    this run's file from another configuration's, which is replaced. Returns how many releases the file held beyond
    the checkpoint's; refuses a file whose releases and the checkpoint's are not one the beginning of the other."""
    privacy.load_state(checkpointed)
    if path is None:
        return 0
    owner = json.loads(json.dumps(owner))  # as the file holds it
    base, found = privacy.state(), _read(path, owner)
    kept = None if found is None else found[1]
    if found is not None and found[0] is not None:
        privacy.ledger_id = found[0]  # the run's ledger goes on: its releases keep their keys
    if kept is not None:
        shorter, longer = sorted((base, kept), key=len)
        if longer[: len(shorter)] != shorter:
            raise ValueError(
                f"{path}: the privacy ledger's releases do not extend those of the round checkpoint beside it "
                f"({len(kept)} against {len(base)}): the two belong to different runs; move one away"
            )
        if len(kept) > len(base):
            privacy.load_state(kept)

    def keep(releases: list) -> None:
        write_json(path, {FORMAT_KEY: FORMAT, "owner": owner, ID_KEY: privacy.ledger_id, "releases": releases})

    keep(privacy.state())
    privacy.keep = keep
    return len(privacy.state()) - len(base)
