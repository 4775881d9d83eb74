"""Launch the Flower engine from Python (pipeline/fedccrl_pipeline/train.py with `train.engine: flower`, and the tests).

Two modes, one ServerApp/ClientApp (fedccrl_flower/app/pyproject.toml, package data, describes the app; its FAB
holds only that file, the code comes from the installed fedccrl_core / fedccrl_flower packages, the data from
each SuperNode's own folders):

- simulation: a SuperLink started with `--simulation`, then `flwr run <APP_DIR> <connection> --federation-config
  "num-supernodes=N ..."`; Flower's Ray backend runs the ClientApps, node k gets partition-id=k (-> the k-th
  site of the run: its source clients, then its evaluation-only sites).
- deployment: a SuperLink and one SuperNode per source client as separate processes (`--insecure` on 127.0.0.1;
  node config client-id/shards/pools/state-dir), then `flwr run`. With `superlink: host:port` the launcher starts
  nothing and submits to that SuperLink (TLS with `root_certificates`); the ServerApp then runs on the
  SuperLink's host and writes its work folder there, and reports the run to the job's MLflow run on the team's
  tracking server (the spec's `report_to`, tracked_report.py), where the launcher follows it.

The ServerApp reports through <work_dir>/run-<run id>/ (report.py): rounds.jsonl (each record is passed to
`on_round` as it appears, e.g. ChildRun.log_round), status.json, result.pt (-> RunResult); with `report_to`, the
launcher reads the same from the tracking server instead. Every process the
launcher starts is stopped, with its descendants, when the federation closes (processes.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fedccrl_core.federation.loop import RunResult
from fedccrl_flower import messages as M
from fedccrl_flower.federation import LOG, Federation, LocalFederation
from fedccrl_flower.follow import wait_for_result
from fedccrl_flower.settings import FlowerSettings
from fedccrl_flower.sites import FederationFile, federation_sites
from fedccrl_flower.spec import ReportTo, ServerSpec


def run_flower(
    settings: FlowerSettings, spec: ServerSpec, shards: str | Path, pools: str | Path, on_round=None, log=LOG
) -> RunResult:
    """Run one training on the Flower engine (settings.mode) and return the in-process engine's RunResult. `shards`
    and `pools` are the folders the local SuperNodes read (one machine: the central partition); the ServerApp
    reads neither. The local SuperNodes keep their clients' states in <work_dir>/client-state/; when a run under
    train.privacy finishes, that folder is removed (drop_client_states)."""
    work = Path(spec.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ids = [*spec.sources, *spec.evaluators]  # every site: sources train, evaluators evaluate the held-out domain
    settings.model_copy(update={"min_clients": max(settings.min_clients, spec.min_clients)}).require_clients(
        len(spec.sources), spec.held_out
    )
    spec = spec.model_copy(update={"num_clients": spec.num_clients or settings.num_clients or len(ids)})
    if settings.mode != "simulation" and settings.superlink:
        return on_superlink(spec, settings.superlink, settings.root_certificates, settings.run_timeout_s, on_round, log)
    state_dir = work / "client-state"
    result = _run_local(
        settings, spec, ids, str(Path(shards).resolve()), str(Path(pools).resolve()), state_dir, on_round, log
    )
    if spec.local.private:
        drop_client_states(state_dir, log)
    return result


def drop_client_states(state_dir: Path, log=LOG) -> None:
    """A run under train.privacy finished: its clients' states (optimizer moments, `extra`: never released, neither
    clipped nor noised), which the local SuperNodes mirrored to `state_dir`, leave the operator's folders, as the
    in-process engine's do (fedccrl_core/federation/checkpoints.py RoundCheckpoints.drop_client_states)."""
    if state_dir.exists():
        shutil.rmtree(state_dir)
        log(f"train.privacy: the clients' states in {state_dir} removed (never released)")


def _run_local(
    settings: FlowerSettings, spec: ServerSpec, ids: list[str], shards: str, pools: str, state_dir: Path, on_round, log
) -> RunResult:
    """run_flower with a SuperLink and one SuperNode per site of `ids` (or Flower's simulation) started here."""
    work = Path(spec.work_dir).resolve()
    if settings.mode == "simulation":
        fed_cfg = (
            f"num-supernodes={len(ids)} client-resources-num-cpus={int(settings.client_cpus)} "
            f"client-resources-num-gpus={float(settings.client_gpus)}"
        )
        if settings.ray_cpus:
            fed_cfg += f" init-args-num-cpus={settings.ray_cpus}"
        with LocalFederation(work / "federation", simulation=True, log=log) as fed:
            run_id = fed.submit(
                spec, {M.RUN_SHARDS: shards, M.RUN_POOLS: pools, M.RUN_STATE_DIR: str(state_dir)}, fed_cfg
            )
            log(f"flower simulation: run {run_id}, {len(ids)} simulated SuperNodes")
            return wait_for_result(fed, run_id, work, on_round, settings.run_timeout_s)
    threads = settings.client_threads or max(1, (os.cpu_count() or 1) // len(ids))
    with LocalFederation(work / "federation", log=log) as fed:
        for cid in ids:
            fed.add_supernode(
                cid,
                {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: shards, M.NODE_POOLS: pools, M.NODE_STATE_DIR: str(state_dir)},
                threads,
                wait=False,
            )
        fed.wait_supernodes()
        run_id = fed.submit(spec)
        log(f"flower deployment: run {run_id}, SuperLink + {len(ids)} SuperNodes on 127.0.0.1")
        return wait_for_result(fed, run_id, work, on_round, settings.run_timeout_s)


def on_superlink(
    spec: ServerSpec, superlink: str, root_certificates: str, timeout_s: float, on_round=None, log=LOG
) -> RunResult:
    """Submit `spec` to the SuperLink at `superlink` (TLS with `root_certificates`, "" = --insecure) and follow the
    run to its result; the ServerApp runs on the SuperLink's host and writes its work folder there. With the spec's
    `report_to`, the run is followed through the tracking server (the SuperLink's disk is not this machine's);
    without one, `spec.work_dir` must be a folder this machine shares with the SuperLink's host."""
    work = Path(spec.work_dir)
    with Federation(work / "federation", superlink, root_certificates, log=log) as fed:
        run_id = fed.submit(spec)
        log(f"flower deployment: run {run_id} on SuperLink {superlink}")
        if spec.report_to is not None:
            log(f"following run {run_id} through MLflow run {spec.report_to.run_id} at {spec.report_to.tracking_uri}")
        return wait_for_result(fed, run_id, work, on_round, timeout_s, report_to=spec.report_to)


def report_to_of(job, tracking_uri: str) -> ReportTo | None:
    """Where the ServerApp of `job` reports besides its work folder: the job's MLflow run (TrainJob.record_ids) at
    `tracking_uri`; None when either is missing (the launcher then reads the work folder)."""
    if not tracking_uri or not job.mlflow_run_id:
        return None
    return ReportTo(tracking_uri=tracking_uri, run_id=str(job.mlflow_run_id))


def server_spec(
    job,
    settings: FlowerSettings,
    sources: list[str],
    evaluators: list[str],
    work_dir: Path,
    report_to: ReportTo | None = None,
) -> ServerSpec:
    """The ServerApp's spec of one planned run (fedccrl_core/federation/plan.py TrainJob) over Flower with `settings`
    (params.yaml train.flower): its sites, `sources` training and `evaluators` evaluating the held-out domain (every
    site of the run takes part unless train.flower.num_clients says otherwise), its round checkpoint (job.ckpt)
    and its work folder `work_dir`; `report_to`: where it also reports (report_to_of)."""
    s = job.settings
    return ServerSpec(
        algorithm=job.algorithm,
        local=s.local,
        hparams=job.hparams,
        backbone=s.backbone,
        num_classes=len(job.classes),
        seed=int(job.seed),
        held_out=job.target,
        sources=sources,
        evaluators=evaluators,
        work_dir=str(Path(work_dir).resolve()),
        pretrained=s.pretrained,
        client_fraction=float(s.client_fraction),
        device=s.device,
        eval_batch_size=int(s.eval_batch_size),
        **settings.model_dump(include=set(ServerSpec.FROM_SETTINGS) - {"num_clients"}),
        num_clients=settings.num_clients or len(sources) + len(evaluators),  # 0: every site of the run
        checkpoint=str(Path(job.ckpt).resolve()),
        run_info={"run_key": job.run_key},
        client_state=s.client_state,
        classes=list(job.classes),
        image_size=int(job.image_size),
        domains=list(job.domains),
        report_to=report_to,
    )


def train_with_flower(
    job,
    settings: FlowerSettings,
    *,
    shards: str | Path,
    pools: str | Path,
    on_round=None,
    log=LOG,
    tracking_uri: str = "",
) -> RunResult:
    """pipeline/fedccrl_pipeline/train.py's `train.engine: flower`: one TrainJob (fedccrl_core/federation/plan.py)
    over Flower with `settings` (params.yaml `train.flower`, validated once by the caller) -> RunResult, its sites
    the clients of the central partition in `shards`. The ServerApp checkpoints where the in-process engine would
    (`job.ckpt`); its work folder sits beside it (<checkpoint>.flower/). On a remote SuperLink
    (train.flower.superlink), the run is followed through `tracking_uri` (report_to_of)."""
    sources, evaluators = federation_sites(shards, job.target)
    remote = settings.mode != "simulation" and bool(settings.superlink)
    report_to = report_to_of(job, tracking_uri) if remote else None
    spec = server_spec(job, settings, sources, evaluators, work_dir_of(Path(job.ckpt)), report_to)
    if spec.local.private:
        from fedccrl_core.privacy.study_ledger import earlier_attempts

        for earlier in earlier_attempts(Path(job.ckpt).resolve()):  # the same run under another key: orphaned
            drop_client_states(work_dir_of(earlier) / "client-state", log)
    return run_flower(settings, spec, shards, pools, on_round=on_round, log=log)


def work_dir_of(checkpoint: Path) -> Path:
    """The work folder of a train-stage run over Flower: beside its round checkpoint, <checkpoint minus .pt>.flower/."""
    return checkpoint.resolve().with_suffix(".flower")


def train_deployed(
    job,
    settings: FlowerSettings,
    *,
    federation: FederationFile,
    superlink: str,
    root_certificates: str,
    timeout_s: float,
    tracking_uri: str = "",
    shards=None,
    pools=None,
    on_round=None,
    log=LOG,
) -> RunResult:
    """`fedccrl federate`: one TrainJob (fedccrl_core/federation/plan.py plan_deployed) trained by the sites of the
    federation file over the SuperLink at `superlink`; this machine reads no data file (`shards`, `pools`: None).
    The ServerApp's work folder is the job's checkpoint's folder, on the SuperLink's host; the run is followed
    through the tracking server at `tracking_uri` (the job's MLflow run: report_to_of)."""
    assert shards is None and pools is None, "a deployment's sites hold the data"
    sources, evaluators = federation.sources(job.target), federation.evaluators(job.target)
    settings.require_clients(len(sources), job.target)
    spec = server_spec(
        job, settings, sources, evaluators, Path(job.ckpt).resolve().parent, report_to_of(job, tracking_uri)
    )
    return on_superlink(spec, superlink, root_certificates, timeout_s, on_round, log)


__all__ = ["federation_sites", "run_flower", "server_spec", "train_deployed", "train_with_flower"]
