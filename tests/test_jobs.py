"""The training jobs' worker pool (fedccrl_core/federation/jobs.py `run_jobs`, concurrent.futures with spawn): the
records of each job reach the parent in order and before its summary, a worker's crash stops the stage with the
worker's traceback, and no worker outlives it."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import psutil
import pytest

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.federation.plan import RunIds, RunSettings, TrainJob
from fedccrl_core.federation.workers import run_jobs


def _jobs(n: int, tmp: Path) -> list[TrainJob]:
    s = RunSettings(
        dataset="synthetic",
        backbone="small_cnn",
        pretrained="none",
        local=LocalConfig(),
        engine="inprocess",
        device="cpu",
        client_fraction=1.0,
        concurrent_clients="auto",
        client_state="persistent",
        eval_batch_size=8,
    )
    doms = ["photo", "art", "cartoon", "sketch"]
    return [
        TrainJob(
            index=i,
            target=doms[i],
            sources=[d for d in doms if d != doms[i]],
            algorithm="fedavg",
            seed=0,
            hparams={},
            settings=s,
            run_key=f"k{i}",
            ckpt=tmp / f"{i}.pt",
            out=tmp / f"d{i}",
            domains=doms,
            classes=["a"],
            image_size=32,
            resize="r",
        )
        for i in range(n)
    ]


def counting(job, shards, pools, report):
    """Three round records, then the ids the parent recorded in the job, as the summary."""
    import torch

    for r in range(3):
        report("round", {"round": r + 1, "pid": os.getpid(), "threads": torch.get_num_threads()})
    return {
        "index": job.index,
        "ids": {
            "commit": job.commit,
            "mlflow_run_id": job.mlflow_run_id,
            "mlflow_experiment_id": job.mlflow_experiment_id,
        },
    }


def crashing(job, shards, pools, report):
    if job.index == 1:
        raise KeyError("boom in the worker")
    time.sleep(120)  # the other worker would train on: it must be stopped


def bad_data(job, shards, pools, report):
    raise FileNotFoundError("data/shards/manifest.json: shard manifest not found")


def _workers() -> set[int]:
    """This process's children that are not multiprocessing's own helpers (resource tracker, forkserver)."""
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd and "forkserver" not in cmd:
            out.add(c.pid)
    return out


@pytest.mark.full("spawns worker processes that import torch (~20 s on 2 cores)")
def test_pool_streams_records_before_each_summary(tmp_path):
    seen = []
    start = lambda job: RunIds("c", f"r{job.index}", "e")  # noqa: E731
    run_jobs(
        _jobs(3, tmp_path), 2, tmp_path, tmp_path, start, lambda kind, i, p: seen.append((kind, i, p)), train=counting
    )
    for i in range(3):
        mine = [(k, p) for k, j, p in seen if j == i]
        assert [k for k, _ in mine] == ["round"] * 3 + ["done"]
        assert mine[-1][1] == {"index": i, "ids": dataclasses.asdict(start(_jobs(3, tmp_path)[i]))}
        assert {p["pid"] for k, p in mine[:3]} != {os.getpid()}  # trained in a worker


@pytest.mark.full("spawns worker processes (~15 s on 2 cores)")
def test_a_crash_in_a_worker_surfaces_with_its_traceback_and_stops_the_others(tmp_path):
    before = _workers()
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"(?s)training worker for held-out art failed:.*Traceback.*"
        r"in crashing.*KeyError: 'boom in the worker'",
    ):
        run_jobs(
            _jobs(2, tmp_path),
            2,
            tmp_path,
            tmp_path,
            lambda job: RunIds(),
            lambda *a: None,
            train=crashing,
        )
    assert time.monotonic() - t0 < 100  # the sleeping worker was stopped, not waited for
    deadline = time.monotonic() + 10
    while _workers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers() - before, "a training worker outlived the failed stage"


@pytest.mark.full("spawns a worker process (~10 s on 2 cores)")
def test_a_known_error_in_a_worker_is_one_line_naming_the_domain(tmp_path):
    with pytest.raises(ValueError, match=r"^(photo|art): data/shards/manifest.json: shard manifest not found$"):
        run_jobs(
            _jobs(2, tmp_path),
            2,
            tmp_path,
            tmp_path,
            lambda job: RunIds(),
            lambda *a: None,
            train=bad_data,
        )
