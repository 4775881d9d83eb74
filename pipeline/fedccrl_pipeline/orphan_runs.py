"""Runs left RUNNING by a process that died (kill -9): each run is tagged with its owner, <host>:<pid>:<since>, and
a later start of the same training marks a dead owner's run KILLED, so a RUNNING run always has a live process."""

from __future__ import annotations

import os
import socket
import sys
import time

from fedccrl_core.foundation.temp_paths import owner_alive

OWNER_TAG = "fedccrl.owner"  # <host>:<pid>:<since> of the process that has the run open


def owner() -> str:
    """This process, as OWNER_TAG spells it (who, since when: temp_paths.owner_alive)."""
    return f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"


def close_orphans(client, experiment_id: str, tags: dict, this_run_id: str) -> None:
    """Runs of this same training (held-out domain, algorithm, seed) left RUNNING by a process of this host
    that no longer runs (kill -9, then a rerun that could not continue them, e.g. after a code change) are
    marked KILLED, with a notice."""
    same = " and ".join(f"tags.`{k}` = '{tags[k]}'" for k in ("held_out", "algorithm", "seed") if k in tags)
    if not same:
        return
    host = socket.gethostname()
    for run in client.search_runs([experiment_id], filter_string=f"{same} and attributes.status = 'RUNNING'"):
        who = run.data.tags.get(OWNER_TAG, "")
        if run.info.run_id == this_run_id or not who.startswith(f"{host}:"):
            continue  # this run, or one whose process lives on another machine (or is older than the tag)
        try:
            pid, since = (int(x) for x in who.split(":")[1:3])
        except ValueError:  # a tag this code did not write: not ours to judge
            continue
        if not owner_alive(pid, since):
            client.set_terminated(run.info.run_id, status="KILLED")
            print(
                f"notice: MLflow run {run.info.run_id} was left RUNNING by process {pid}, which is no longer "
                f"running; marked KILLED",
                file=sys.stderr,
                flush=True,
            )
