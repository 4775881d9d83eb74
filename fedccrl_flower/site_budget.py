"""A site's own budget across runs: site.toml's `max_study_epsilon` (with `max_epsilon`, site_ceiling.py), which its
SuperNode's node config carries. The site keeps, in its state folder, the runs it has trained in
(`site-privacy-ledger.jsonl`: each run's key, max_epsilon and delta) and refuses to train in a new run whose
max_epsilon, added to those of every run it trained in, would exceed its `max_study_epsilon`.

By basic composition (Dwork & Roth 2014, Thm. 3.16) runs that are each (ε_i, δ_i)-DP on the site's images are
together (Σ ε_i, Σ δ_i)-DP, and each run is (max_epsilon, delta)-DP: the server's accountant stops it before a
release would pass its max_epsilon (privacy/accountant.py), with noise the site adds itself. So the site's bound
needs nothing from the server but each run's declared ceiling. It is loose (the operator's study ledger composes the
releases themselves, privacy/study_ledger.py) and never counts too little: a run that stopped early is charged its
whole ceiling, and a run started again under a new run key is charged twice. Only a site that trains is charged: an
evaluation site releases nothing of its training rows.

One line per run, appended under an exclusive `fcntl.flock`: two runs admitted at once both see each other."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

from flwr.app import Context
from pydantic import Field, ValidationError

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.foundation.records import Record
from fedccrl_flower.node_config import NODE_MAX_EPSILON, NODE_MAX_STUDY_EPSILON, NODE_STATE_DIR
from fedccrl_flower.site_ceiling import DEFAULT_MAX_DELTA, node_float

LEDGER_FILE = "site-privacy-ledger.jsonl"


class AdmittedRun(Record):
    """One line of a site's ledger: a run the site trained in, and what that run may spend on its images."""

    run_key: str = Field(min_length=1)
    client: str
    max_epsilon: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1)


def read_ledger(path: Path) -> list[AdmittedRun]:
    """The runs of the site ledger at `path` ([] without one); ValueError naming the file and the line of a bad one."""
    if not path.is_file():
        return []
    runs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            runs.append(AdmittedRun.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as e:
            raise ValueError(f"{path}: line {i} is not a run of a site's privacy ledger ({e})") from None
    return runs


def admit_run(context: Context, local: LocalConfig, run_key: str, cid: str) -> None:
    """Under a max-study-epsilon (node config): the run is in this site's ledger, or its max_epsilon fits what is
    left and it is written there now, before the site releases anything; ValueError naming the client, what the site
    spent over how many runs and its budget otherwise. Nothing without a max-study-epsilon."""
    budget = node_float(context, NODE_MAX_STUDY_EPSILON)
    if budget is None:
        return
    state = context.node_config.get(NODE_STATE_DIR)
    if node_float(context, NODE_MAX_EPSILON) is None or not state or local.privacy is None or not local.private:
        raise ValueError(
            f"client {cid}: refused: '{NODE_MAX_STUDY_EPSILON}' needs the site's max-epsilon and state-dir"
        )
    path = Path(str(state)) / LEDGER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # never through a symlink, never into a FIFO
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise ValueError(f"{path}: cannot open the site's privacy ledger ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file: the site's privacy ledger is one")
        fcntl.flock(fd, fcntl.LOCK_EX)
        runs = read_ledger(path)
        if any(r.run_key == run_key for r in runs):
            return
        spent, this = sum(r.max_epsilon for r in runs), local.privacy.max_epsilon
        if spent + this > budget:
            raise ValueError(
                f"client {cid}: refused: this site has admitted {len(runs)} runs of max_epsilon {spent:g} in all "
                f"({path}); with this run's {this:g} that is over its max_study_epsilon {budget:g} (site.toml)"
            )
        line = AdmittedRun(run_key=run_key, client=cid, max_epsilon=this, delta=local.privacy.delta)
        os.write(fd, (json.dumps(line.to_dict()) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def privacy_line(max_epsilon: float | None, max_delta: float | None, budget: float | None, state_dir: str) -> str:
    """What a site with a join config of these values admits, and what its ledger in `state_dir` has spent (read and
    checked: a bad ledger is refused before the SuperNode starts); "" for a site without a ceiling."""
    if max_epsilon is None:
        return ""
    line = f"each run under train.privacy, at most max_epsilon {max_epsilon:g} at delta <= {max_delta or DEFAULT_MAX_DELTA:g}"
    if budget is None:
        return line
    path = Path(state_dir) / LEDGER_FILE
    runs = read_ledger(path)
    spent = sum(r.max_epsilon for r in runs)
    return f"{line}; {len(runs)} runs trained in, max_epsilon {spent:g} in all of max_study_epsilon {budget:g} ({path})"
