"""The training jobs' worker pool: `run_jobs` runs planned jobs (plan.py) side by side in a
`concurrent.futures.ProcessPoolExecutor` (spawned workers, one torch thread each) and hands their round records to
the caller, which alone talks to the tracker (pipeline/fedccrl_pipeline/tracking.py); `worker_count` says how many.

The pool is the standard library's; two things it does not do are added here: the round records stream to the
parent while a job trains (a queue every worker receives at start), and a failed run stops the workers still
training (their process ids, reported by each worker at start, are terminated), so no trainer outlives the stage.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from fedccrl_core.federation.jobs import run_one
from fedccrl_core.federation.plan import RunSettings, TrainJob


def worker_count(setting: str, settings: RunSettings, n_jobs: int) -> int:
    """How many held-out domains train at once (--workers). auto: one per CPU core this process may use,
    on the CPU in-process engine; 1 on CUDA (one device; clients already overlap on CUDA streams) and with
    Flower (each run starts its own federation)."""
    if setting != "auto":
        try:
            n = int(setting)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--workers must be auto or an integer >= 1, got {setting!r}")
        return min(n, n_jobs)
    if settings.engine == "flower" or settings.device == "cuda":
        return 1
    if settings.device == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    return max(1, min(len(os.sched_getaffinity(0)), n_jobs))


# ---- the worker pool -----------------------------------------------------------------------------------------
class WorkerFailed(Exception):
    """An unexpected error in a training worker; its message is the worker's formatted traceback."""


_RECORDS = None  # in a worker: the queue to the parent (set once by _worker_start, the pool's initializer)


def _worker_start(records) -> None:
    """A pool worker's initializer (spawned): killed with its parent (kill -9 included: no orphan trainer), and
    its process id reported, so that the parent can stop it when another run fails."""
    global _RECORDS
    from fedccrl_core.foundation.procs import die_with_parent

    die_with_parent()
    _RECORDS = records
    records.put(("pid", None, os.getpid()))


def _worker_run(train, job: TrainJob, shards: Path | None, pools: Path | None) -> None:
    """One run in a worker: its round records and then its summary ("done") sent to the parent in order, through
    one queue; the parent alone talks to MLflow. A known error (bad data, a missing file) comes back as a
    ValueError naming the held-out domain; any other error as WorkerFailed, with the worker's traceback formatted
    here."""
    import traceback

    from fedccrl_core.foundation.errors import FedCCRLError

    assert _RECORDS is not None  # set by _worker_start
    records = _RECORDS
    try:
        summary = train(job, shards, pools, lambda kind, rec: records.put((kind, job.index, rec)))
    except (ValueError, FileNotFoundError, FedCCRLError) as e:
        raise ValueError(f"{job.target}: {e}") from None
    except Exception:
        raise WorkerFailed(traceback.format_exc().rstrip()) from None
    records.put(("done", job.index, summary))


def run_jobs(
    jobs: list[TrainJob],
    workers: int,
    shards: Path | None,
    pools: Path | None,
    start,
    on_message,
    train: Callable = run_one,
) -> None:
    """Run the jobs, `workers` at a time: in this process when workers == 1, else in a spawned process pool
    (one torch thread each). start(job) opens the job's MLflow run and returns the ids its outputs record, in
    this process, before the job is handed to a worker (a job travels to its worker whole: no channel back to it
    is needed). on_message(kind, index, payload) receives "round" records and "done" summaries, in this process.
    `train` is run_one (a test passes another module-level function)."""
    if workers == 1:
        for job in jobs:
            job.record_ids(start(job))
            on_message(
                "done", job.index, train(job, shards, pools, lambda kind, rec, i=job.index: on_message(kind, i, rec))
            )
        return
    ctx = mp.get_context("spawn")  # not fork: torch's OpenMP pool does not survive a fork
    records = ctx.Queue()
    live: dict[int, tuple] = {}  # job index: (its future, the job)
    pending, finished, pids = list(jobs), set(), set()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_start, initargs=(records,))
    try:
        while pending or live:
            while pending and len(live) < workers:
                job = pending.pop(0)
                job.record_ids(start(job))
                live[job.index] = (pool.submit(_worker_run, train, job, shards, pools), job)
            try:
                kind, index, payload = records.get(timeout=0.5)
            except queue_mod.Empty:
                kind = None
            if kind == "pid":
                pids.add(payload)
            elif kind is not None:
                on_message(kind, index, payload)
                if kind == "done":
                    finished.add(index)
            _drop_finished(live, finished)
    finally:
        if live:  # a run failed or the stage was stopped: no worker trains on
            _stop_workers(records, pids)
        pool.shutdown(wait=True, cancel_futures=True)


def _drop_finished(live: dict[int, tuple], finished: set[int]) -> None:
    """Raise a finished job's error (naming its held-out domain); drop a job whose future is done and whose
    "done" came through the queue, after every round record."""
    for index, (fut, job) in list(live.items()):
        if not fut.done():
            continue
        try:
            fut.result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"training worker for held-out {job.target} died ({e})") from None
        except ValueError:
            raise
        except WorkerFailed as e:  # its message is the worker's traceback
            raise RuntimeError(f"training worker for held-out {job.target} failed:\n{e}") from None
        except BaseException as e:
            raise RuntimeError(f"training worker for held-out {job.target} failed:\n{type(e).__name__}: {e}") from e
        if index in finished:
            live.pop(index)


def _stop_workers(records, pids: set[int]) -> None:
    """SIGTERM every worker: those whose process ids came before, and any reported since."""
    while True:  # every worker's process id, also of one that started a moment ago
        try:
            kind, _, payload = records.get(timeout=0.1)
        except queue_mod.Empty:
            break
        if kind == "pid":
            pids.add(payload)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
