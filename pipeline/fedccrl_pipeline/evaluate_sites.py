"""`fedccrl evaluate-sites`: how a trained model does at each site of a federation, without training.

The operator names a model (a run folder, a model file, or an export folder whose metadata leads to its weights:
model_source.py), the federation file and, optionally, a list of its sites (`--sites a,b`; default every site). The
evaluation-only run goes to the SuperLink (fedccrl_flower/site_evaluation.py); each site evaluates the torch model on
its own images and returns counts only (per class: images, right, predicted as). Which images (`--split`):
  - auto (default): a site whose client id trained the model counts its val split only (it trained on the rest;
    counted, those images would flatter the model), any other site (the held-out domain's, a new one) its whole
    folder, train + val;
  - val: every site its val split; all: every site its whole folder.
Which client ids trained: those the run's records name (`train_acc/<client>`); a run whose records name none (under
train.privacy no client metrics are sent) takes the federation file's sites outside the held-out domain.
Under train.privacy the counts follow docs/privacy.md ("What a site returns for evaluation"): only images outside the
unit of privacy (val splits, sites that never trained) are counted, so `--split all` is refused before any work when
a site asked for trained the model.

Output (an atomic folder `--out`): <out>/sites.json (fedccrl_core/outcomes/site_scores.py SitesEvaluated) and
<out>/sites.md, the Markdown also on stderr; an MLflow run in the model's experiment, tagged with the model's MLflow run id and run key,
with each site's and domain's accuracy. A site refused (its data does not fit the model) or dropped (no answer) is
named with its reason; the exit code is 2 then, unless --allow-refused-sites.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError, FedCCRLError
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory
    from fedccrl_core.learning.model_meta import ModelMeta
    from fedccrl_core.outcomes.site_scores import SitesEvaluated
    from fedccrl_flower.sites import FederationFile

SPLITS = ("auto", "all", "val")
JSON_FILE, MARKDOWN_FILE = "sites.json", "sites.md"


class SitesMissing(FedCCRLError):
    """The evaluation finished (its outputs are written) with a site refused or dropped."""


def trained_sites(history: RunHistory, fed: FederationFile, held_out: str) -> set[str]:
    """The client ids that trained the model: named in its records, else the federation's sources."""
    prefix = contract.client_train_acc("")
    named = {k[len(prefix) :] for r in history.rounds for k in r.model_extra or {} if k.startswith(prefix)}
    return named or set(fed.sources(held_out))


def choose_splits(fed: FederationFile, sites: str, split: str, trained: set[str], private: bool, where: Path) -> dict:
    """{client id: "val" | "all"} of the sites asked; ValueError naming the site or the rule before any work."""
    known = [s.id for s in fed.sites]
    asked = [s.strip() for s in sites.split(",") if s.strip()] if sites else known
    unknown = [s for s in asked if s not in known]
    if unknown:
        raise ValueError(f"--sites: {', '.join(unknown)} not among the sites of {where} ({', '.join(known)})")
    splits = {c: ("val" if c in trained else "all") if split == "auto" else split for c in asked}
    exposed = [c for c, s in splits.items() if s == "all" and c in trained]
    if private and exposed:
        raise ValueError(
            f"--split all: the model trained under train.privacy on {', '.join(exposed)}, whose training images "
            "would be counted exactly, outside epsilon (docs/privacy.md); use --split auto or val"
        )
    return splits


def site_eval_spec(meta: ModelMeta, model_file: Path, fed: FederationFile, splits: dict, cfg, work: Path):
    """The ServerApp's spec: the model file, the ClientSpec every site checks its data against and builds the model
    from (the model's algorithm, architecture, classes, image size, normalization; the federation's domains)."""
    from fedccrl_core.algorithm_params import PARAMS
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_flower.spec import ClientSpec, SiteEvalSpec

    meta.require(model_file, "algorithm", "held_out_domain", "seed")
    if meta.algorithm not in PARAMS:
        raise DataError(f"{model_file}: the model's algorithm {meta.algorithm!r} is not one of {', '.join(PARAMS)}")
    client = ClientSpec(
        algorithm=str(meta.algorithm),
        local=LocalConfig(mean=tuple(meta.mean), std=tuple(meta.std)),
        hparams=PARAMS[meta.algorithm].model_validate(meta.hparams or {}),
        backbone=meta.backbone,
        num_classes=meta.num_classes,
        seed=int(meta.seed or 0),
        held_out=str(meta.held_out_domain),
        device=cfg.train.device,
        client_state="stateless",
        eval_batch_size=int(cfg.evaluate.batch_size),
        state_key="",
        run_key=f"evaluate-sites/{meta.params_hash}",
        classes=list(meta.classes),
        image_size=int(meta.image_size),
        domains=list(fed.domains),
    )
    flower = cfg.train.flower
    return SiteEvalSpec(
        model_file=str(model_file.resolve()),
        client_spec=client.to_json(),
        splits=splits,
        work_dir=str(work.resolve()),
        wait_for_clients_s=float(flower.wait_for_clients_s),
        reply_timeout_s=float(flower.query_timeout_s),
    )


def scored(outcome, meta: ModelMeta, model_file: Path, fed: FederationFile, splits: dict, split: str):
    """The sites' counts (site_evaluation.py SiteEvalOutcome) -> SitesEvaluated."""
    from fedccrl_core.outcomes.site_scores import SiteProblem, SiteScore, SitesEvaluated, by_domain, pooled, score

    domain = {s.id: s.domain for s in fed.sites}
    sites = [
        SiteScore(
            client=c, domain=domain[c], split=splits[c], score=score(k.labels, k.correct, k.predicted, meta.classes)
        )
        for c, k in sorted(outcome.counts.items())
    ]
    return SitesEvaluated(
        model=str(model_file),
        run_key=meta.params_hash,
        mlflow_run_id=meta.mlflow_run_id,
        algorithm=meta.algorithm,
        held_out_domain=meta.held_out_domain,
        classes=list(meta.classes),
        split=split,
        sites=sites,
        domains=by_domain(sites, list(meta.classes)),
        pooled=pooled([s.score for s in sites], list(meta.classes)),
        refused=[SiteProblem(client=p.client, reason=p.reason) for p in outcome.refused],
        dropped=[SiteProblem(client=p.client, reason=p.reason) for p in outcome.dropped],
    )


def log_to_mlflow(result: SitesEvaluated, meta: ModelMeta, files: list[Path], dataset: str) -> str:
    """One MLflow run in the model's experiment (fedccrl-<dataset>-evaluate-sites when the store lacks the model's run), tagged
    with the model's MLflow run id and run key; each site's and domain's accuracy, n and 95 % interval."""
    from fedccrl_pipeline.mlflow_store import find_run, mlflow_module, set_experiment

    mlflow = mlflow_module()
    model_run = find_run(mlflow, meta.mlflow_run_id) if meta.mlflow_run_id else None
    if model_run is not None:  # the model's experiment, as its own run says (an id alone may be another store's)
        exp_id = model_run.info.experiment_id
    else:
        name = f"fedccrl-{dataset}-evaluate-sites"
        print(
            f"evaluate-sites: the model's MLflow run {meta.mlflow_run_id or '(none)'} is not in the tracking store "
            f"{mlflow.get_tracking_uri()}: logged to experiment {name}",
            file=sys.stderr,
        )
        exp_id = set_experiment(name).experiment_id
    tags = {"fedccrl.stage": "evaluate-sites", "fedccrl.run_key": meta.params_hash or ""}
    if meta.mlflow_run_id:
        tags["fedccrl.model_run_id"] = meta.mlflow_run_id
    metrics: dict[str, float] = {"sites_refused": len(result.refused), "sites_dropped": len(result.dropped)}
    rows = [(f"site/{s.client}", s.score) for s in result.sites] + [
        (f"domain/{d.domain}", d.score) for d in result.domains
    ]
    for name, s in [*rows, ("pooled", result.pooled)]:
        metrics[f"{name}/n"] = s.n
        if s.accuracy is not None and s.ci95 is not None:
            metrics.update({f"{name}/acc": s.accuracy, f"{name}/ci95_low": s.ci95[0], f"{name}/ci95_high": s.ci95[1]})
    client = mlflow.MlflowClient()
    run = client.create_run(exp_id, tags=tags, run_name=f"evaluate-sites {meta.algorithm} {meta.held_out_domain}")
    for k, v in metrics.items():
        client.log_metric(run.info.run_id, k, float(v))
    for f in files:
        client.log_artifact(run.info.run_id, str(f), artifact_path="evaluate-sites")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def report_missing(result: SitesEvaluated, allow: bool) -> None:
    """Each site refused or dropped named on stderr; SitesMissing (exit 2) unless `allow`."""
    from fedccrl_core.federation.jobs import LOG

    for what, rows in (("REFUSED", result.refused), ("dropped", result.dropped)):
        for p in rows:
            LOG(f"evaluate-sites: {what} {p.client}: {p.reason}")
    missing = [*result.refused, *result.dropped]
    if missing and not allow:
        raise SitesMissing(
            f"{len(missing)} site(s) refused or dropped ({', '.join(p.client for p in missing)}): the tables lack "
            "them. Fix the site (fedccrl site prepare with the federation file), or pass --allow-refused-sites"
        )


def evaluate_sites(
    model: Path,
    models: Path | None,
    federation: Path,
    sites: str,
    split: str,
    params_path: Path,
    superlink: str,
    root_certificates: str,
    out: Path,
    work: Path,
    timeout_s: float,
    allow: bool,
    use_mlflow: bool,
) -> SitesEvaluated:
    from fedccrl_core.federation.history import load_history
    from fedccrl_core.federation.jobs import LOG
    from fedccrl_core.foundation.fsio import atomic_dir, write_text
    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_core.outcomes.site_scores import markdown, write_scores
    from fedccrl_flower.site_evaluation import evaluate_on_superlink
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.model_source import resolve_model
    from fedccrl_pipeline.params import load_config

    folders_apart({"model": model, "work": None}, {"out": out})
    cfg = load_config(params_path, downloads=False)  # every input checked before the SuperLink hears of the run
    fed = read_federation(federation)
    src = resolve_model(model, models)
    meta, history = load_meta(src.model_file), load_history(src.run_dir)
    if meta.params_hash != history.meta.params_hash:
        raise DataError(f"{src.model_file}: run key {meta.params_hash}, but {src.run_dir}'s history is of another run")
    meta.require(src.model_file, "held_out_domain")
    private = history.dp is not None and history.dp.mark is None and meta.privacy is None
    trained = trained_sites(history, fed, str(meta.held_out_domain))
    splits = choose_splits(fed, sites, split, trained, private, federation)
    spec = site_eval_spec(meta, src.model_file, fed, splits, cfg, work)
    LOG(
        f"evaluate-sites: {src.model_file} at {len(splits)} site(s) over {superlink}: "
        + ", ".join(f"{c} ({s})" for c, s in splits.items())
    )
    outcome = evaluate_on_superlink(spec, superlink, root_certificates, timeout_s)
    result = scored(outcome, meta, src.model_file, fed, splits, split)
    text = markdown(result)
    with atomic_dir(out) as tmp:  # complete or absent; MLflow logs the files before they appear
        write_scores(result, tmp / JSON_FILE)
        write_text(tmp / MARKDOWN_FILE, text)
        if use_mlflow:
            run_id = log_to_mlflow(result, meta, [tmp / JSON_FILE, tmp / MARKDOWN_FILE], fed.dataset)
            LOG(f"evaluate-sites: MLflow run {run_id}")
    print(text, file=sys.stderr)
    LOG(f"evaluate-sites: wrote {out / JSON_FILE} and {out / MARKDOWN_FILE}")
    report_missing(result, allow)
    return result


@click.command("evaluate-sites")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="a run folder, model file or export")
@click.option("--models", type=click.Path(path_type=Path), default=None, help="the run folders an export's run is in")
@click.option("--federation", type=click.Path(path_type=Path), required=True, help="the federation file (JSON)")
@click.option("--sites", default="", help="client ids to ask, comma-separated (default: every site of the file)")
@click.option("--split", type=click.Choice(SPLITS), default="auto", show_default=True, help="the images a site counts")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--superlink", required=True, help="host:port of the SuperLink's control API (flwr run)")
@click.option("--root-certificates", default="", help='the SuperLink\'s CA certificate (TLS); "" = --insecure')
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the output folder (sites.json, sites.md)")
@click.option("--work", type=click.Path(path_type=Path), default=None, help="the ServerApp's work folder")
@click.option("--timeout-s", type=float, default=0.0, help="whole run (0 = no limit)")
@click.option("--allow-refused-sites", "allow", is_flag=True, help="exit 0 although a site was refused or dropped")
@click.option("--mlflow/--no-mlflow", "use_mlflow", default=True, help="log the run to MLflow")
def command(
    model,
    models,
    federation,
    sites,
    split,
    params_path,
    superlink,
    root_certificates,
    out,
    work,
    timeout_s,
    allow,
    use_mlflow,
):
    """Evaluate a trained model at each site of a federation, without training; counts only leave the sites."""
    work = work or out.with_name(out.name + ".flower")
    run_stage(
        evaluate_sites,
        model,
        models,
        federation,
        sites,
        split,
        params_path,
        superlink,
        root_certificates,
        out,
        work,
        timeout_s,
        allow,
        use_mlflow,
    )
