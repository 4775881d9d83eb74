"""`fedccrl federate`: the operator's training of one (algorithm, seed, held-out domain) over a Flower deployment
whose sites hold their own data. It reads no data file: the sites come from the federation file
(fedccrl_flower/sites.py), the training settings from params.yaml, n_i and every accuracy from the sites' replies
(the ServerApp evaluates on the sites: fedccrl_flower/evalsets.py). It submits the run to the SuperLink at
`--superlink` (TLS with `--root-certificates`; the ServerApp then runs on the SuperLink's host and writes its work
folder `--work` there: the launcher must share that filesystem), waits for it, and writes <out>/ as the train stage
writes a run folder: model.pt (final round), best.pt (the val-selected round), history.json and history.csv, plus
result.json (what `fedccrl evaluate` reports: the final and val-selected target accuracy, here as the evaluation
sites measured them, and the round). <out> appears complete or not at all."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fedccrl_pipeline.stage_runtime import run_stage

RESULT_FILE = "result.json"


def federate(
    federation: Path,
    params_path: Path,
    algorithm: str,
    seed: int,
    held_out: str,
    superlink: str,
    root_certificates: str,
    out: Path,
    work: Path,
    timeout_s: float,
    deploy_path: Path | None = None,
) -> dict:
    from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
    from fedccrl_core.federation.jobs import privacy_summary, without_epsilon, write_run_folder
    from fedccrl_core.foundation import contract
    from fedccrl_core.foundation.runkey import params_hash
    from fedccrl_core.learning.model_file import ModelMeta
    from fedccrl_core.outcomes.runs import BY_THE_SITES
    from fedccrl_flower.federation import Federation
    from fedccrl_flower.run import wait_for_result
    from fedccrl_flower.sites import read_federation
    from fedccrl_flower.spec import ServerSpec
    from fedccrl_pipeline.params import load_deploy
    from fedccrl_pipeline.train import load_train_config, run_settings

    if deploy_path is not None:  # the operator's pipeline (deploy/dvc.yaml): its deploy file, whole, first
        load_deploy(deploy_path)
    cfg = load_train_config(params_path, algorithm)  # the whole file first, before anything starts
    fed_file = read_federation(federation)
    try:
        target = fed_file.held_out(held_out)
    except ValueError as e:
        raise ValueError(f"{federation}: --held-out: {e}") from None
    settings, flower = run_settings(cfg), cfg.train.flower
    sources, evaluators = fed_file.sources(target), fed_file.evaluators(target)
    flower.require_clients(len(sources), target)
    hparams = ALGORITHMS[algorithm].validated(getattr(cfg.train, algorithm))
    core = dict(
        algorithm=algorithm,
        local=settings.local,
        hparams=hparams,
        backbone=settings.backbone,
        num_classes=len(fed_file.classes),
        seed=seed,
        held_out=target,
        sources=sources,
        evaluators=evaluators,
        pretrained=settings.pretrained,
        client_fraction=float(settings.client_fraction),
        device=settings.device,
        eval_batch_size=int(settings.eval_batch_size),
        client_state=settings.client_state,
        **flower.model_dump(include=set(ServerSpec.FROM_SETTINGS) - {"num_clients"}),
        num_clients=flower.num_clients or len(sources) + len(evaluators),  # 0: every site of the run
        classes=list(fed_file.classes),
        image_size=fed_file.image_size,
    )
    probe = ServerSpec(**core, work_dir="")  # the run's key: everything but where it writes
    run_key = params_hash({**probe.model_dump(mode="json", exclude={"work_dir"}), "federation": fed_file.to_dict()})
    work = work.resolve()
    spec = ServerSpec(
        **core,
        work_dir=str(work),
        checkpoint=str(work / "checkpoint.pt"),
        run_info={"run_key": run_key},
    )
    privacy = settings.local.privacy  # as the train stage writes a DP run (federation/jobs.py run_one)
    mark = privacy.not_private_mark() if privacy is not None else None
    as_reported = functools.partial(without_epsilon, seeded=mark is not None)
    run = deployment_run(cfg, fed_file, algorithm, seed, target, hparams.model_dump(), run_key)
    try:
        with Federation(work / "federation", superlink, root_certificates) as fed:
            run_id = fed.submit(spec)
            click.echo(f"flower deployment: run {run_id} on SuperLink {superlink}", err=True)
            result = wait_for_result(
                fed, run_id, work, on_round=lambda rec: run.log_round(as_reported(rec)), timeout=timeout_s
            )
        alg = build_algorithm(algorithm, settings.local, hparams)
        model = alg.build_model(settings.backbone, len(fed_file.classes), "none", alg.hp)
        meta = ModelMeta(
            backbone=settings.backbone,
            num_classes=len(fed_file.classes),
            classes=fed_file.classes,
            image_size=fed_file.image_size,
            mean=list(settings.local.mean),
            std=list(settings.local.std),
            resize=fed_file.resize_policy,
            dataset=fed_file.dataset,
            domains=fed_file.domains,
            held_out_domain=target,
            held_out_index=fed_file.domains.index(target),
            algorithm=algorithm,
            seed=seed,
            hparams=alg.hp.model_dump(),
            params_hash=run_key,
            mlflow_run_id=run.run_id,
            mlflow_experiment_id=run.experiment_id,
        )
        if mark:  # a seeded run's model files and history say so
            meta = meta.model_copy(update={"privacy": mark})
        trained = [d for d in fed_file.domains if d != target and any(s.domain == d for s in fed_file.sites)]
        summary = privacy_summary(privacy, trained, result.extra) if privacy is not None and privacy.enabled else None
        records = [as_reported(rec) for rec in result.history]
        final = records[-1]
        result.final_weights = {k: v.cpu() for k, v in result.final_weights.items()}
        result.best_weights = {k: v.cpu() for k, v in result.best_weights.items()}
        doc = {
            "algorithm": algorithm,
            "seed": seed,
            "held_out_domain": target,
            contract.FINAL_TARGET_ACC: final[contract.TARGET_ACC],
            contract.BEST_VAL_TARGET_ACC: records[result.best_round - 1][contract.TARGET_ACC],
            contract.BEST_ROUND: result.best_round,
            "evaluated_on": BY_THE_SITES,
        }
        write_run_folder(out, model, meta, result, settings.local.rounds, records, summary, extra={RESULT_FILE: doc})
    except BaseException:  # the run folder is not written: the MLflow run says so
        run.finish("FAILED")
        raise
    run.finish()
    click.echo(
        f"{algorithm} s{seed} {target}: final {doc[contract.FINAL_TARGET_ACC]:.4f} best-val "
        f"{doc[contract.BEST_VAL_TARGET_ACC]:.4f} (round {result.best_round}) -> {out}",
        err=True,
    )
    return doc


def deployment_run(cfg, fed_file, algorithm: str, seed: int, held_out: str, hparams: dict, run_key: str):
    """The MLflow child run of one deployment run (every round as the ServerApp records it), under the
    deployment's parent run: experiment fedccrl-<dataset>-deploy, one parent per federation file and training
    settings (what the runs of deploy/dvc.yaml's matrix share)."""
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_core.foundation.runkey import params_hash
    from fedccrl_pipeline.git_state import git_commit
    from fedccrl_pipeline.mlflow_store import store_errors, tracking_uri
    from fedccrl_pipeline.sweep_privacy import PRIVACY_TAG
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id

    params = cfg.as_written()
    shared = {k: v for k, v in params["train"].items() if k not in ("held_out", "algorithms", "seeds", *ALGORITHMS)}
    sweep = {
        "federation": fed_file.to_dict(),
        "model": params.get("model", {}),
        "preprocess": params.get("preprocess", {}),
        "train": shared,
    }
    sweep_key, experiment, commit = params_hash(sweep), f"fedccrl-{fed_file.dataset}-deploy", git_commit()
    privacy = cfg.train.privacy
    mark = privacy.not_private_mark()
    tags = {
        "git_commit": commit,
        "fedccrl.role": "child",
        "fedccrl.sweep": sweep_key,
        "fedccrl.engine": "flower deployment",
        "fedccrl.run_key": run_key,
        "held_out": held_out,
        "algorithm": algorithm,
        "seed": str(seed),
        **({"fedccrl.privacy_noise": privacy.noise_source()} if privacy.enabled else {}),
        **({PRIVACY_TAG: mark} if mark else {}),
    }
    child = {
        **{k: v for k, v in sweep.items() if k != "federation"},
        "federation": {
            "sites": len(fed_file.sites),
            "classes": len(fed_file.classes),
            "image_size": fed_file.image_size,
        },
        "train": {**shared, "algorithm": algorithm, "seed": seed, "held_out": held_out, algorithm: hparams},
    }
    with store_errors(tracking_uri()):  # a store that fails: one line naming it, before the run starts
        parent = parent_run_id(experiment, sweep_key, sweep)
        return ChildRun(experiment, parent, f"{algorithm}-{fed_file.dataset}-s{seed}-{held_out}", child, tags)


@click.command("federate")
@click.option("--federation", type=click.Path(path_type=Path), required=True, help="the federation file (JSON)")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--algorithm", required=True)
@click.option("--seed", type=int, required=True)
@click.option("--held-out", required=True, help="the held-out domain: its name or its index in the federation file")
@click.option("--superlink", required=True, help="host:port of the SuperLink's control API (flwr run)")
@click.option("--root-certificates", default="", help='the SuperLink\'s CA certificate (TLS); "" = --insecure')
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the run folder to write")
@click.option(
    "--work",
    type=click.Path(path_type=Path),
    default=None,
    help="the ServerApp's work folder (checkpoint, report; default <out>.flower)",
)
@click.option("--timeout-s", type=float, default=0.0, help="whole run (0 = no limit)")
@click.option(
    "--deploy",
    "deploy_path",
    type=click.Path(path_type=Path),
    default=None,
    help="the deployment's params file (deploy/params.yaml), validated first",
)
def command(
    federation, params_path, algorithm, seed, held_out, superlink, root_certificates, out, work, timeout_s, deploy_path
):
    """Train over a Flower deployment whose sites hold their own data; this machine reads no data file."""
    work = work or out.with_name(out.name + ".flower")
    run_stage(
        federate,
        federation,
        params_path,
        algorithm,
        seed,
        held_out,
        superlink,
        root_certificates,
        out,
        work,
        timeout_s,
        deploy_path,
    )
