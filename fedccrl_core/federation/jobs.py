"""Training jobs: one (algorithm, seed) trained for each held-out domain (`fedccrl train`, pipeline/fedccrl_pipeline/train.py).

`plan_runs` turns the run settings (typed, from the validated params file) into one picklable `TrainJob` per
held-out entry, keyed by a hash of everything that determines the run (its round checkpoint's name); `run_one`
trains a job on the in-process engine (or over Flower, with the caller's `job.flower_train`) and writes its
outputs at once at the end (the run layout of fedccrl_core/foundation/contract.py); `run_jobs` runs jobs side by side in a
`concurrent.futures.ProcessPoolExecutor` (spawned workers, one torch thread each) and hands their round records
to the caller, which alone talks to the tracker (pipeline/fedccrl_pipeline/tracking.py).

The pool is the standard library's; two things it does not do are added here: the round records stream to the
parent while a job trains (a queue every worker receives at start), and a failed run stops the workers still
training (their process ids, reported by each worker at start, are terminated), so no trainer outlives the stage.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.data.shards import ShardManifest
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.hparams import HParams
from fedccrl_core.foundation.numerics import numeric_platform
from fedccrl_core.foundation.runkey import code_hash, params_hash

if TYPE_CHECKING:  # torch, imported by the worker that trains
    from fedccrl_core.federation.history import RunHistory, RunPrivacySummary

LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


@dataclass(frozen=True)
class RunSettings:
    """What every run of one `fedccrl train` shares, from the validated params file (pipeline/fedccrl_pipeline/params.py)."""

    dataset: str
    backbone: str  # resolved: never `auto`
    pretrained: str  # resolved: never `auto`
    local: LocalConfig  # train.* + preprocess mean, std
    engine: str  # train.engine: inprocess | flower
    device: str  # train.device: auto | cpu | cuda
    client_fraction: float
    concurrent_clients: int | str
    client_state: str
    eval_batch_size: int  # evaluate.batch_size


@dataclass
class TrainJob:
    """One held-out domain of one (algorithm, seed): everything a worker needs, picklable."""

    index: int  # the held-out domain's index in `domains`
    target: str  # the held-out domain
    sources: list[str]
    algorithm: str
    seed: int
    hparams: HParams  # train.<algorithm>: the algorithm's frozen Params (Algorithm.validated)
    settings: RunSettings
    run_key: str  # hash of everything that determines the run: names its round checkpoint
    ckpt: Path
    out: Path
    domains: list[str]
    classes: list[str]
    image_size: int
    resize: str
    # the MLflow run that records the job (set by the caller's start(), fedccrl_core does not talk to MLflow)
    commit: str = ""
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    # train.engine flower: fedccrl_flower.run.train_with_flower with train.flower's typed FlowerSettings bound
    flower_train: Callable | None = None

    def record_ids(self, ids: dict) -> None:
        self.commit, self.mlflow_run_id, self.mlflow_experiment_id = (
            ids["commit"],
            ids["mlflow_run_id"],
            ids["mlflow_experiment_id"],
        )


def load_clients(shards: Path, pools: Path, domains: list[str], device):
    from fedccrl_core.data.pools import STALE, load_pool
    from fedccrl_core.data.shards import MIXED, load_client, load_manifest
    from fedccrl_core.learning.clients import ClientData

    clients = []
    for entry in load_manifest(shards).clients:
        held_out = [d for d in (entry.domain_counts or {entry.domain: 1}) if d not in domains]
        if entry.domain != MIXED and entry.domain not in domains:
            continue
        s = load_client(shards, entry.id, exclude_domain=held_out[0] if held_out else None, mmap=True)
        if not len(s.train_y):
            continue  # a mixed client holding only the held-out domain
        mu, sigma = load_pool(pools, entry.id)
        if s.train_rows is not None:
            mu, sigma = mu[s.train_rows], sigma[s.train_rows]
        if len(mu) != len(s.train_y):
            raise ValueError(
                f"{pools}/{entry.id}.npz: {len(mu)} statistics for {len(s.train_y)} training samples ({STALE})"
            )
        clients.append(
            ClientData.from_numpy(
                s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device, mu, sigma, lazy=True
            )
        )  # images read when sampled: memory flat in the clients
    return clients


def plan_runs(
    settings: RunSettings,
    partition: dict,
    manifest: ShardManifest,
    algorithm: str,
    seed: int,
    held_out: list,
    targets: list[str],
    out: Path,
    checkpoints: Path,
    hparams: HParams,
) -> list[TrainJob]:
    """One job per held-out entry (checked by pipeline/fedccrl_pipeline/sweep.py `check_train`; `targets` are their domain names),
    its run key (the hash of every setting of the run, the manifest and the training code) and its output
    folder out/d<entry>. `hparams`: the algorithm's Params; `partition`: params.yaml's partition group."""
    domains = list(manifest.domains)
    s = settings
    jobs = []
    # a run without DP keeps its run key (and checkpoint): no privacy key; the sweep's budget is checked before
    # the sweep trains (pipeline/fedccrl_pipeline/sweep_privacy.py) and does not change what a run trains
    local = s.local.model_dump(exclude={"privacy"} if s.local.privacy is None else {"privacy": {"max_sweep_epsilon"}})
    for h, target in zip(held_out, targets):
        i = domains.index(target)
        run_params = {
            "dataset": s.dataset,
            "backbone": s.backbone,
            "pretrained": s.pretrained,
            **local,
            "engine": s.engine,
            "device": s.device,
            "client_fraction": s.client_fraction,
            "concurrent_clients": s.concurrent_clients,
            "client_state": s.client_state,
            "eval_batch_size": s.eval_batch_size,
            "algorithm": algorithm,
            "seed": seed,
            "held_out": domains[i],
            algorithm: hparams.model_dump(),
            "partition": partition,
            "image_size": manifest.image_size,
        }
        run_key = params_hash({**run_params, "manifest": params_hash(manifest.to_dict()), "code": code_hash()})
        jobs.append(
            TrainJob(
                index=i,
                target=domains[i],
                sources=[d for d in domains if d != domains[i]],
                algorithm=algorithm,
                seed=seed,
                hparams=hparams,
                settings=s,
                run_key=run_key,
                ckpt=checkpoints / contract.checkpoint_dir_name(algorithm, seed, h) / f"{run_key}.pt",
                out=out / contract.domain_dir_name(h),
                domains=domains,
                classes=list(manifest.classes),
                image_size=manifest.image_size,
                resize=manifest.resize,
            )
        )
    return jobs


def without_epsilon(rec: dict, seeded: bool) -> dict:
    """A round record as a run reports it: a seeded run's (train.privacy.noise_seed: not private) has no epsilon,
    which does not apply to noise that anyone with the params file removes; it keeps dp_seeded_noise = 1."""
    if not seeded:
        return rec
    return {k: v for k, v in rec.items() if k not in contract.DP_EPSILON_KEYS}


def privacy_summary(privacy, sources: list[str], extra: dict) -> RunPrivacySummary:
    """history.json's `dp` (contract.HISTORY_PRIVACY) of a DP run: how its noise was drawn, the mark of a
    seeded run, the domains whose training images it trained on, and the releases its ledger charged
    (privacy/sweep_epsilon.py encode_releases), which the sweep's per-image epsilon composes."""
    from fedccrl_core.federation.history import RunPrivacySummary
    from fedccrl_core.privacy.sweep_epsilon import encode_releases

    mark = privacy.not_private_mark()
    return RunPrivacySummary(
        noise=privacy.noise_source(),
        delta=privacy.delta,
        trained_domains=list(sources),
        releases=encode_releases(extra.get(contract.PRIVACY_RELEASES, [])),
        **({"mark": mark} if mark else {}),
    )


def run_one(job: TrainJob, shards: Path, pools: Path, report) -> dict:
    """Train one held-out domain (in this process or in a worker) and write job.out at once at the end.
    report(kind, payload) receives every round record ("round") as it appears. On the CPU the run uses one
    torch thread, whatever the machine's core count, so its numbers are the same on every machine and with
    any number of workers (parallelism comes from training several held-out domains at once). The MLflow ids
    the outputs record are the job's (TrainJob.record_ids, by the caller before the job runs)."""
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.federation.driver import HeldOutRun, build_seeded_model, train
    from fedccrl_core.federation.loop import EvalSets
    from fedccrl_core.foundation.fastpath import resolve_device
    from fedccrl_core.learning.model_file import ModelMeta

    s, target, out = job.settings, job.target, Path(job.out)
    privacy = s.local.privacy
    mark = privacy.not_private_mark() if privacy is not None else None
    not_applicable = functools.partial(without_epsilon, seeded=mark is not None)
    device = resolve_device(s.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    log = lambda msg: LOG(f"[{job.algorithm} {target}] {msg}")  # noqa: E731
    try:
        log(f"seed {job.seed}: held-out {target}, sources {job.sources}, {s.backbone} on {device}")
        clients = load_clients(shards, pools, job.sources, device)
        if len(clients) < 2:
            raise ValueError(f"{shards}: need at least 2 source clients, found {len(clients)}")
        tx, ty = load_domain_test(shards, target)
        evalsets = EvalSets.for_target(clients, tx, ty, s.eval_batch_size, device)
        del tx, ty  # the NCHW copy in evalsets is the one copy of the target domain kept for training
        alg = build_algorithm(job.algorithm, s.local, job.hparams)
        model = build_seeded_model(alg, s.backbone, len(job.classes), s.pretrained, job.seed, device)
        on_round = lambda rec: report("round", not_applicable(rec))  # noqa: E731
        if s.engine == "flower":  # same algorithm, seeds and record dicts over Flower: job.flower_train is
            # fedccrl_flower.run.train_with_flower, set by the caller (the library does not import the transport)
            assert job.flower_train is not None, "engine flower: the caller sets job.flower_train"
            result = job.flower_train(job, shards=shards, pools=pools, on_round=on_round, log=log)
        else:
            run = HeldOutRun(
                alg,
                model,
                clients,
                evalsets,
                s.local.rounds,
                job.seed,
                s.client_fraction,
                job.ckpt,
                concurrent_clients=s.concurrent_clients,
                client_state=s.client_state,
                run_info={"run_key": job.run_key},
            )
            result = train(run, on_round, log)
    finally:
        torch.set_num_threads(threads)

    meta = ModelMeta(
        backbone=s.backbone,
        num_classes=len(job.classes),
        classes=job.classes,
        image_size=job.image_size,
        mean=list(s.local.mean),
        std=list(s.local.std),
        resize=job.resize,
        dataset=s.dataset,
        domains=job.domains,
        held_out_domain=target,
        held_out_index=job.index,
        algorithm=job.algorithm,
        seed=job.seed,
        hparams=alg.hp.model_dump(),
        params_hash=job.run_key,
        git_commit=job.commit,
        mlflow_run_id=job.mlflow_run_id,
        mlflow_experiment_id=job.mlflow_experiment_id,
        platform=numeric_platform(str(device)),
    )
    if mark:  # a seeded run's model files and history say so; other runs' meta has no privacy key
        meta = meta.model_copy(update={"privacy": mark})
    summary = privacy_summary(privacy, job.sources, result.extra) if privacy is not None and privacy.enabled else None
    history = write_run_folder(
        out, model, meta, result, s.local.rounds, [not_applicable(rec) for rec in result.history], summary
    )
    final = history.rounds[-1]
    log(f"done: final target acc {final.target_acc:.4f}; best-val round {history.best_round} -> {out}")
    return {
        contract.FINAL_TARGET_ACC: final.target_acc,
        contract.BEST_VAL_TARGET_ACC: history.at(history.best_round).target_acc,
        contract.BEST_ROUND: history.best_round,
    }


def write_run_folder(
    out: Path,
    model,
    meta,
    result,
    rounds: int,
    records: list[dict] | None = None,
    privacy: RunPrivacySummary | None = None,
    extra: dict | None = None,
) -> RunHistory:
    """A trained run's folder, complete or absent (fsio.atomic_dir): MODEL_FILE (the final round's weights),
    BEST_FILE (the val-selected round's), HISTORY_FILE and HISTORY_CSV (`records`, default the result's round
    records, and the run's privacy summary), plus `extra` ({file name: JSON document}). Returns the history, typed."""
    from fedccrl_core.federation.history import write_history
    from fedccrl_core.foundation.fsio import atomic_dir
    from fedccrl_core.learning.model_file import save_model

    # fedccrl_core.foundation.fsio: .<out>.tmp-<pid>-<token>, renamed into place when complete
    with atomic_dir(out) as tmp:
        model.load_state_dict(result.final_weights)
        save_model(tmp / contract.MODEL_FILE, model, meta.model_copy(update={"round": rounds}))
        model.load_state_dict(result.best_weights)
        save_model(tmp / contract.BEST_FILE, model, meta.model_copy(update={"round": result.best_round}))
        history = write_history(tmp, meta, result.best_round, result.history if records is None else records, privacy)
        for name, doc in (extra or {}).items():
            (tmp / name).write_text(json.dumps(doc, indent=1) + "\n")
    return history


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


def _worker_run(train, job: TrainJob, shards: Path, pools: Path) -> None:
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
    jobs: list[TrainJob], workers: int, shards: Path, pools: Path, start, on_message, train: Callable = run_one
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
    import multiprocessing as mp
    import queue as queue_mod
    import signal
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

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
                    raise RuntimeError(
                        f"training worker for held-out {job.target} failed:\n{type(e).__name__}: {e}"
                    ) from e
                if index in finished:  # its "done" came through the queue, after every round record
                    live.pop(index)
    finally:
        if live:  # a run failed or the stage was stopped: no worker trains on
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
        pool.shutdown(wait=True, cancel_futures=True)
