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
Under train.privacy the counts follow docs/privacy.md ("What a site returns for evaluation"): only images no run of the
study trains on are counted (every site's val split, site_splits.py), so `--split all` is refused before any work.

The model reaches the ServerApp without a shared disk: with MLflow (the default), the command opens its MLflow run
first (sites_mlflow.py), logs the model file to it and names that artifact and the file's sha256 in the spec; the
ServerApp downloads it from the tracking server, refuses other bytes, and reports its status and outcome to that run,
where this command follows it. With --no-mlflow the spec names the file's path: the ServerApp must share this disk
(one machine).

Output (an atomic folder `--out`): <out>/sites.json (fedccrl_core/outcomes/site_scores.py SitesEvaluated) and
<out>/sites.md, the Markdown also on stderr; the MLflow run, in the model's experiment, tagged with the model's MLflow
run id and run key, with each site's and domain's accuracy. A site refused (its data does not fit the model) or dropped (no answer) is
named with its reason; the exit code is 2 then, unless --allow-refused-sites.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedccrl_core.foundation.errors import DataError, FedCCRLError
from fedccrl_pipeline.site_splits import SPLITS, choose_splits, trained_sites
from fedccrl_pipeline.sites_mlflow import carry_model, finish_run, sites_run
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage

if TYPE_CHECKING:
    from fedccrl_core.learning.model_meta import ModelMeta
    from fedccrl_core.outcomes.site_scores import SitesEvaluated
    from fedccrl_flower.sites import FederationFile

JSON_FILE, MARKDOWN_FILE = "sites.json", "sites.md"


class SitesMissing(FedCCRLError):
    """The evaluation finished (its outputs are written) with a site refused or dropped."""


def site_eval_spec(meta: ModelMeta, model_file: Path, fed: FederationFile, splits: dict, cfg, work: Path):
    """The ServerApp's spec: the model file's path and sha256 (sites_mlflow.py carry_model names its MLflow artifact
    instead), the ClientSpec every site checks its data against and builds the model from (the model's algorithm,
    architecture, classes, image size, normalization; the federation's domains)."""
    from fedccrl_core.algorithm_params import PARAMS
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.data.checksums import sha256_file
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
        model_sha256=sha256_file(model_file),  # the ServerApp refuses other bytes
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
    with sites_run(meta, fed.dataset, use_mlflow) as run:
        if run is not None:
            LOG(f"evaluate-sites: MLflow run {run.run_id} at {run.tracking_uri} (the model travels through it)")
            spec = carry_model(spec, run, src.model_file)
        outcome = evaluate_on_superlink(spec, superlink, root_certificates, timeout_s)
        result = scored(outcome, meta, src.model_file, fed, splits, split)
        text = markdown(result)
        with atomic_dir(out) as tmp:  # complete or absent; MLflow logs the files before they appear
            write_scores(result, tmp / JSON_FILE)
            write_text(tmp / MARKDOWN_FILE, text)
            if run is not None:
                finish_run(run, result, [tmp / JSON_FILE, tmp / MARKDOWN_FILE])
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
