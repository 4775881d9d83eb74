"""Training jobs: one planned run (plan.py `TrainJob`) trained and finished in this process or in a worker
(workers.py): `run_one` sets the run up and trains it on its engine (in-process, from the shards and pools on this
machine; over Flower, with the caller's `job.flower_train`), then writes its folder (finish.py). The train stage
(`fedccrl train`) and the deployment (`fedccrl federate`) both train through it.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys
from pathlib import Path

from fedccrl_core.federation.finish import as_reported, finish_run
from fedccrl_core.federation.plan import TrainJob
from fedccrl_core.foundation import contract

LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


def run_one(job: TrainJob, shards: Path | None, pools: Path | None, report) -> dict:
    """Train one held-out domain (in this process or in a worker) and write job.out at once at the end.
    report(kind, payload) receives every round record ("round") as it appears. On the CPU the run uses one
    torch thread, whatever the machine's core count, so its numbers are the same on every machine and with
    any number of workers (parallelism comes from training several held-out domains at once). The MLflow ids
    the outputs record are the job's (TrainJob.record_ids, by the caller before the job runs). `shards`, `pools`:
    the data on this machine (None for a deployment, whose sites hold it)."""
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.federation.driver import build_seeded_model
    from fedccrl_core.foundation.fastpath import resolve_device

    s, target = job.settings, job.target
    device = resolve_device(s.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    log = lambda msg: LOG(f"[{job.algorithm} {target}] {msg}")  # noqa: E731
    on_round = lambda rec: report("round", as_reported(job, rec))  # noqa: E731
    alg = build_algorithm(job.algorithm, s.local, job.hparams)
    try:
        log(f"seed {job.seed}: held-out {target}, sources {job.sources}, {s.backbone} on {device}")
        if job.flower_train is not None:  # same algorithm, seeds and records over Flower: fedccrl_flower/run.py,
            # bound by the caller (the library does not import the transport); the ServerApp builds its own model
            model = build_seeded_model(alg, s.backbone, len(job.classes), "none", job.seed, device)
            result = job.flower_train(job, shards=shards, pools=pools, on_round=on_round, log=log)
        else:
            assert shards is not None and pools is not None, "the in-process engine trains on this machine's shards"
            model, result = _train_inprocess(job, alg, shards, pools, device, on_round, log)
    finally:
        torch.set_num_threads(threads)
    history = finish_run(job, model, alg.hp.model_dump(), result, str(device))
    final = history.rounds[-1]
    log(f"done: final target acc {final.target_acc:.4f}; best-val round {history.best_round} -> {job.out}")
    return {
        contract.FINAL_TARGET_ACC: final.target_acc,
        contract.BEST_VAL_TARGET_ACC: history.at(history.best_round).target_acc,
        contract.BEST_ROUND: history.best_round,
    }


def _train_inprocess(job: TrainJob, alg, shards: Path, pools: Path, device, on_round, log):
    """The in-process engine's run of `job` on the shards and pools of this machine: (model, RunResult)."""
    from fedccrl_core.federation.driver import RunData, held_out_run, train

    s = job.settings
    data = RunData.load(shards, pools, job.target, device, s.eval_batch_size, job.sources, s.local.private)
    if len(data.clients) < 2:
        raise ValueError(f"{shards}: need at least 2 source clients, found {len(data.clients)}")
    run = held_out_run(
        alg,
        data,
        s.backbone,
        len(job.classes),
        s.pretrained,
        job.seed,
        device,
        s.local.rounds,
        client_fraction=s.client_fraction,
        checkpoint_path=job.ckpt,
        concurrent_clients=s.concurrent_clients,
        client_state=s.client_state,
        run_info={"run_key": job.run_key},
    )
    return run.model, train(run, on_round, log)
