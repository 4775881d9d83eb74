"""The operator's pipeline after `fedccrl federate` (the operator's project, pipeline/fedccrl_pipeline/project/dvc.yaml): `fedccrl evaluate --deploy`, `fedccrl report`
and `fedccrl figures --deploy` on a deployment's run folders, with and without the operator's test folder. The run
folders here are written as `fedccrl federate` writes them (random weights, a history whose rounds carry the sites'
counts), so no federation runs: tests/test_site_eval.py and the docs/flower.md walkthrough run one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures import write_params

from fedccrl_core.data.images import RESIZE_POLICY
from fedccrl_core.federation.history import write_history
from fedccrl_core.foundation import contract
from fedccrl_core.learning.model_file import ModelMeta, save_model
from fedccrl_core.learning.models import build_model
from fedccrl_core.outcomes.runs import BY_THE_SITES
from fedccrl_pipeline.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HELD_OUT = "sketch"
SITES_TARGET = [0.25, 0.75, 0.5]  # the sites' pooled target accuracy per round (round 2 is the val-selected one)
SITES_N = 16  # the sites' count of held-out images (each of SITES_TARGET of it a whole count)


@pytest.fixture
def ws(tmp_path, tiny) -> Path:
    """An operator's folder: params.yaml (the research settings), deploy.yaml, models/ of one deployed run."""
    write_params(tmp_path, {"figures.tsne_points": 12, "figures.gradcam_images": 2})
    (tmp_path / "deploy.yaml").write_text(
        "deploy:\n  superlink: 127.0.0.1:29093\n  root_certificates: ''\n  algorithms: [fedavg]\n  seeds: [0]\n"
        f"  held_out: [{HELD_OUT}]\n"
    )
    manifest = json.loads((tiny / "data" / "shards" / "manifest.json").read_text())
    meta = ModelMeta(
        backbone="small_cnn",
        num_classes=manifest["num_classes"],
        classes=manifest["classes"],
        image_size=32,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize=RESIZE_POLICY,
        dataset="synthetic",
        domains=manifest["domains"],
        held_out_domain=HELD_OUT,
        held_out_index=3,
        algorithm="fedavg",
        seed=0,
    )
    run = contract.run_dir(tmp_path / "models", "fedavg", 0, HELD_OUT)
    run.mkdir(parents=True)
    for name, seed, rnd in ((contract.MODEL_FILE, 1, 3), (contract.BEST_FILE, 2, 2)):
        torch.manual_seed(seed)
        save_model(run / name, build_model("small_cnn", meta.num_classes), meta.model_copy(update={"round": rnd}))
    rounds = [
        {
            contract.ROUND: r,
            contract.TARGET_ACC: acc,
            contract.VAL_ACC: [0.4, 0.9, 0.6][r - 1],
            contract.VAL_PRED_CLASSES: 2,
            contract.SECONDS: 1.0,
            contract.BYTES_UP: 10,
            contract.BYTES_DOWN: 20,
            "val_n": 40,
            "target_n": SITES_N,
            "eval_sites": 4,
        }
        for r, acc in enumerate(SITES_TARGET, start=1)
    ]
    write_history(run, meta, 2, rounds)
    return tmp_path


def _cli(ws: Path, *args) -> tuple[int, str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ws)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{ws / 'mlflow.db'}")
        res = CliRunner().invoke(main, [*map(str, args), "--params", "params.yaml"])
    return res.exit_code, res.output


def _result(ws: Path) -> dict:
    return json.loads((ws / "results" / "fedavg" / "s0" / f"d{HELD_OUT}.json").read_text())


def test_evaluate_of_a_deployment_reports_the_sites_accuracies(ws):
    code, out = _cli(ws, "evaluate", "--deploy", "deploy.yaml", "--models", "models", "--out", "results")
    assert code == 0, out
    doc = _result(ws)
    assert doc[contract.FINAL_TARGET_ACC] == SITES_TARGET[-1]
    assert doc[contract.BEST_VAL_TARGET_ACC] == SITES_TARGET[1] and doc[contract.BEST_ROUND] == 2
    assert doc["n_test"] == SITES_N and doc["evaluated_on"] == BY_THE_SITES
    assert "confusion" not in doc["detail"]["final"] and "detail_n_test" not in doc
    assert [p[contract.TARGET_ACC] for p in doc["per_round"]] == SITES_TARGET

    code, out = _cli(ws, "report", "--runs", "results", "--metrics", "m.json", "--table", "t.md", "--curves", "c.csv")
    assert code == 0, out
    assert "| fedavg | 50.00 |" in (ws / "t.md").read_text()  # the sites' final accuracy, in percent


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "train.privacy"])
def test_evaluate_of_a_deployment_scores_the_operators_test_folder(ws, tiny, dp):
    """The operator's test folder, every image of it: its images are no site's, outside the study, also when the
    run trained under train.privacy (the study's own shards then give their val rows only: shards.held_out_parts)."""
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.federation.history import RunPrivacySummary, load_history, write_history

    shards = tiny / "data" / "shards"
    if dp:
        run = contract.run_dir(ws / "models", "fedavg", 0, HELD_OUT)
        h = load_history(run)
        summary = RunPrivacySummary(noise="os entropy", delta=1e-5, trained_domains=["photo"], releases="[]")
        write_history(run, h.meta, h.best_round, h.rounds, summary)
    args = ["evaluate", "--deploy", "deploy.yaml", "--models", "models", "--shards", shards, "--out", "results"]
    code, out = _cli(ws, *args)
    assert code == 0, out
    doc = _result(ws)
    assert doc[contract.FINAL_TARGET_ACC] == SITES_TARGET[-1]  # the table's numbers stay the sites'
    cm = doc["detail"]["final"]["confusion"]
    assert doc["detail_n_test"] == sum(map(sum, cm)) > 0 and doc["detail_on"] == str(shards)
    assert doc["detail"]["best_val"][contract.ROUND] == 2 and "confusion" in doc["detail"]["best_val"]
    assert doc["detail_n_test"] == len(load_domain_test(shards, HELD_OUT)[1])


@pytest.mark.parametrize("with_test_folder", [False, True], ids=["sites-only", "test-folder"])
def test_figures_of_a_deployment_draw_what_the_operator_holds(ws, tiny, with_test_folder):
    shards = ["--shards", tiny / "data" / "shards"] if with_test_folder else []
    ev = ["evaluate", "--deploy", "deploy.yaml", "--models", "models", *shards, "--out", "results"]
    assert _cli(ws, *ev)[0] == 0
    fig = ["figures", "--deploy", "deploy.yaml", "--models", "models", *shards, "--runs", "results", "--out", "plots"]
    code, out = _cli(ws, *fig)
    assert code == 0, out
    drawn = sorted(p.name for p in (ws / "plots").iterdir())
    held_out = [f"confusion_fedavg_{HELD_OUT}.png", f"gradcam_{HELD_OUT}.png", f"tsne_{HELD_OUT}.png"]
    assert drawn == sorted([f"curves_{HELD_OUT}.png", *(held_out if with_test_folder else [])])


def test_a_bad_deploy_file_is_refused_naming_the_key_before_any_work(ws):
    (ws / "deploy.yaml").write_text((ws / "deploy.yaml").read_text().replace("seeds: [0]", "seeds: [0]\n  sedes: 1"))
    code, out = _cli(ws, "evaluate", "--deploy", "deploy.yaml", "--models", "models", "--out", "results")
    assert code == 2 and "deploy.yaml: key 'deploy.sedes': unknown key" in out, out
    assert not (ws / "results").exists()


def test_evaluate_without_shards_needs_a_deployment(ws):
    code, out = _cli(ws, "evaluate", "--models", "models", "--out", "results")
    assert code == 2 and "--shards: required" in out, out
    assert not (ws / "results").exists()
    code, out = _cli(ws, "figures", "--models", "models", "--runs", "results", "--out", "plots")
    assert code == 2 and "--shards and --pools: required" in out, out
    assert not (ws / "plots").exists()


def test_each_deployment_run_is_an_mlflow_child_of_the_deployments_parent(tmp_path):
    """`fedccrl federate`'s MLflow side is the train stage's (TrainTracking) with the deployment's data: one parent
    per federation file and training settings, one child per (algorithm, seed, held-out domain) with its params,
    tags (its run key among them) and every round's record."""
    import mlflow

    from fedccrl_core.federation.plan import DeployedData, plan_deployed
    from fedccrl_core.federation.round_record import RoundRecord
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.tracked_data import deployed_data
    from fedccrl_pipeline.train_tracking import TrainTracking
    from fedccrl_pipeline.training import run_settings

    cfg = load_config(write_params(tmp_path))
    fed = tmp_path / "federation.json"
    doc = {
        "dataset": "embedded",
        "domains": ["art", "cartoon", "photo", "sketch"],
        "classes": list("abcdef"),
        "image_size": 32,
        "resize_policy": "resize SxS bilinear",
        "sites": [{"id": f"{d}_c0", "domain": d} for d in ("art", "cartoon", "photo", "sketch")],
    }
    fed.write_text(json.dumps(doc))
    fed_file = read_federation(fed)
    data = DeployedData("embedded", doc["domains"], doc["classes"], 32, doc["resize_policy"], doc["domains"], doc)
    runs = []
    for seed in (0, 1):
        job = plan_deployed(
            run_settings(cfg),
            data,
            {},
            "fedavg",
            seed,
            HELD_OUT,
            tmp_path / f"out{seed}",
            tmp_path / f"w{seed}",
            cfg.train.fedavg,
        )
        tracking = TrainTracking(cfg, job.settings, "fedavg", seed, deployed_data(fed_file, fed), [job])
        ids = tracking.start(job)
        for rnd, acc in enumerate(SITES_TARGET, start=1):
            rec = {contract.ROUND: rnd, contract.VAL_ACC: 0.5, contract.TARGET_ACC: acc, "val_pred_classes": 6}
            rec |= {"seconds": 1.0, "bytes_up": 1, "bytes_down": 1, "target_n": SITES_N}
            tracking.on_message("round", job.index, RoundRecord.model_validate(rec))
        tracking.finish_all("FINISHED")
        runs.append((mlflow.MlflowClient().get_run(ids.mlflow_run_id), job))
    (first, _), (child, job) = runs
    assert first.data.tags["mlflow.parentRunId"] == child.data.tags["mlflow.parentRunId"]
    parent = mlflow.MlflowClient().get_run(child.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["fedccrl.role"] == "parent" and "federation.sites" in parent.data.params
    assert mlflow.MlflowClient().get_experiment(child.info.experiment_id).name == "fedccrl-embedded-deploy"
    assert child.data.params["train.seed"] == "1" and child.data.params["train.held_out"] == HELD_OUT
    assert child.data.params["federation.sites"] == "4" and "partition.scheme" not in child.data.params
    assert child.data.tags["fedccrl.run_key"] == job.run_key and child.info.status == "FINISHED"
    assert child.data.tags["fedccrl.engine"] == "flower deployment"
    history = mlflow.MlflowClient().get_metric_history(child.info.run_id, contract.TARGET_ACC)
    assert [(m.step, m.value) for m in history] == list(enumerate(SITES_TARGET, start=1))


def test_a_deployed_runs_key_changes_with_the_code_and_the_federation(tmp_path, monkeypatch):
    """A deployment's run key hashes its settings, the federation file and the training code, as the train stage's
    does: a checkpoint is never resumed by other code."""
    import fedccrl_core.federation.plan as plan_mod
    from fedccrl_core.federation.plan import DeployedData, plan_deployed
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.training import run_settings

    cfg = load_config(write_params(tmp_path))
    domains = ["art", "cartoon", "photo", "sketch"]

    def key(description):
        data = DeployedData("embedded", domains, list("ab"), 32, "r", domains, description)
        args = ("fedavg", 0, HELD_OUT, tmp_path / "o", tmp_path / "w", cfg.train.fedavg)
        return plan_deployed(run_settings(cfg), data, {}, *args).run_key

    before = key({"sites": 4})
    assert key({"sites": 4}) == before and key({"sites": 3}) != before
    monkeypatch.setattr(plan_mod, "code_hash", lambda: "other code")
    assert key({"sites": 4}) != before


@pytest.mark.parametrize("seeded", [False, True], ids=["os-noise", "seeded-noise"])
def test_federate_writes_a_dp_runs_summary_as_the_train_stage_does(data, tmp_path, monkeypatch, seeded):
    """`fedccrl federate` under train.privacy, with the loopback Grid standing in for the SuperLink (the spec it
    submits is served there): history.json's `dp` names the domains trained on and the releases charged; a run whose
    noise is seeded (not private) is marked in its model meta and history and reports no epsilon, in its records and
    in MLflow."""
    import mlflow
    from flower_harness import loopback

    from fedccrl_core.federation.history import load_history
    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_core.privacy.settings import NOT_PRIVATE_VARIABLE
    from fedccrl_core.privacy.study_ledger import read_study
    from fedccrl_core.privacy.sweep_epsilon import decode_releases
    from fedccrl_pipeline.federate import federate
    from fedccrl_pipeline.sweep_privacy import SWEEP_EPSILON, SWEEP_PLANNED

    privacy = {"train.privacy.enabled": True, "train.privacy.weights_clip": 0.5}
    if seeded:
        monkeypatch.setenv(NOT_PRIVATE_VARIABLE, "1")
    studies = {"train.privacy.study_dir": str(tmp_path / "studies")}  # not the checkout's .fedccrl/studies
    params = write_params(
        tmp_path,
        {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu", **privacy},
        new_keys={"train.privacy.noise_seed": 3} if seeded else studies,
    )
    fed_file = federation_file(data, tmp_path)
    submitted = on_loopback(monkeypatch, lambda spec: loopback(data, clients=[*spec.sources, *spec.evaluators]))
    out = tmp_path / "models" / "fedavg" / "s0" / f"d{HELD_OUT}"
    federate(fed_file, params, "fedavg", 0, HELD_OUT, "127.0.0.1:1", "", out, tmp_path / "work", 0.0)

    history = load_history(out)
    assert history.dp is not None and history.dp.trained_domains == [
        "photo",
        "art",
        "cartoon",
    ]  # the federation file's order
    assert history.dp.releases  # the ledger's releases, which the sweep's epsilon composes
    (rec,) = history.rounds
    meta = load_meta(out / contract.MODEL_FILE)
    child = mlflow.MlflowClient().get_run(str(history.meta.mlflow_run_id))
    if seeded:
        assert history.dp.mark and meta.privacy == history.dp.mark and history.meta.privacy == history.dp.mark
        assert rec.metric(contract.DP_EPSILON) is None and contract.DP_EPSILON not in child.data.metrics
    else:
        assert history.dp.mark is None and meta.privacy is None
        assert rec.metric(contract.DP_EPSILON) == child.data.metrics[contract.DP_EPSILON] > 0
        # the release reached the study of the federation's sites, and history.json reports the study's epsilon
        assert history.dp.study and (tmp_path / "studies" / f"{history.dp.study}.jsonl").is_file()
        assert history.dp.study_epsilon and history.dp.study_epsilon["photo"] == pytest.approx(
            rec.metric(contract.DP_EPSILON), rel=1e-9
        )
        # this ServerApp read the pointer (the loopback shares the disk): it is the one writer, its records carry
        # no releases for `federate` to count again, and its line is keyed as a deployment's would be
        (entry,) = read_study(tmp_path / "studies" / f"{history.dp.study}.jsonl")[1]
        assert rec.dp_releases is None and entry.release is not None and entry.release.endswith("/0")
        assert [(entry.channel, entry.population, entry.sample, entry.z)] == decode_releases(history.dp.releases, "")
        parent = mlflow.MlflowClient().get_run(child.data.tags["mlflow.parentRunId"]).data.metrics
        assert parent[SWEEP_EPSILON] >= rec.metric(contract.DP_EPSILON)  # the sweep's per image, this run's releases
        assert parent[SWEEP_PLANNED] >= parent[SWEEP_EPSILON]  # planned over the sites' worst case
        budget = write_params(
            tmp_path / "budget",
            {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu", **privacy},
            new_keys={"train.privacy.max_sweep_epsilon": 1.0, **studies},
        )
        runs_before = len(mlflow.search_runs(search_all_experiments=True))
        with pytest.raises(ParamError, match="train.privacy.max_sweep_epsilon"):
            federate(
                fed_file, budget, "fedavg", 0, HELD_OUT, "127.0.0.1:1", "", out.with_name("d9"), tmp_path / "w9", 0.0
            )
        assert not out.with_name("d9").exists() and len(submitted) == 1  # refused before a run was submitted
        assert len(mlflow.search_runs(search_all_experiments=True)) == runs_before
    assert not (out / "result.json").exists()  # the run folder is the train stage's: nothing more
    assert meta.git_commit and meta.platform and meta.params_hash == child.data.tags["fedccrl.run_key"]
    assert child.info.status == "FINISHED" and (rec.metric("target_n") or 0) > 0  # sketch's evaluation site


def federation_file(data: Path, folder: Path) -> Path:
    """The federation file of the partition in `data` (one site per client), written to `folder`."""
    manifest = json.loads((data / "shards" / "manifest.json").read_text())
    fields = ("dataset", "domains", "classes", "image_size", "resize_policy")
    sites = [{"id": c["id"], "domain": c["domain"]} for c in manifest["clients"]]
    path = folder / "federation.json"
    path.write_text(json.dumps({**{k: manifest[k] for k in fields}, "sites": sites}))
    return path


def on_loopback(monkeypatch, grid_of) -> list:
    """`fedccrl federate` with the loopback Grid standing in for the SuperLink: the spec it submits is served on
    grid_of(spec) (tests/flower_harness.py), each round's record handed on as wait_for_result hands it. Returns the
    list of the specs submitted."""
    from flower_harness import serve

    import fedccrl_flower.run as run_mod
    from fedccrl_core.federation.loop import RunResult

    submitted = []

    class LoopbackLink:  # the Federation of fedccrl_flower/federation.py, its SuperLink the loopback Grid
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, spec):
            submitted.append(spec)
            return 1

    def served(
        fed, run_id, work, on_round=None, timeout=0.0, report_to=None
    ):  # wait_for_result: the records, then the result
        spec = submitted[-1]
        res = serve(grid_of(spec), spec.model_copy(update={"report_to": None}))  # handed over, not through MLflow
        for rec in res.history:
            on_round(rec)
        return RunResult(res.history, res.final_weights, res.best_weights, res.best_round, extra=res.extra)

    monkeypatch.setattr(run_mod, "Federation", LoopbackLink)
    monkeypatch.setattr(run_mod, "wait_for_result", served)
    return submitted


def test_federate_names_a_refused_site_and_exits_nonzero_unless_allowed(data, tmp_path, monkeypatch, capfd):
    """A site prepared at another image size refuses the run by its own check in every round (its ClientApp answers
    the QUERY with its client id and the reason): `fedccrl federate` prints each round's progress with the site's
    client id and reason, writes the run (the other sites trained), names the site in its final summary and exits 2;
    with --allow-refused-sites it exits 0."""
    import shutil

    from flower_harness import LoopbackGrid

    from fedccrl_core.federation.history import load_history
    from fedccrl_flower import messages as M

    odd = tmp_path / "odd"  # photo_c0's folder, prepared at 64 px where the federation says 32
    shutil.copytree(data / "shards", odd / "shards")
    manifest = json.loads((odd / "shards" / "manifest.json").read_text())
    (odd / "shards" / "manifest.json").write_text(json.dumps({**manifest, "image_size": 64}))

    def grid(spec):
        configs = {}
        for i, cid in enumerate([*spec.sources, *spec.evaluators]):
            shards = odd / "shards" if cid == "photo_c0" else data / "shards"
            configs[100 + i] = {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: str(shards), M.NODE_POOLS: str(data / "pools")}
        return LoopbackGrid(configs)

    on_loopback(monkeypatch, grid)
    params = write_params(tmp_path, {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu"})
    fed_file = federation_file(data, tmp_path)
    out = tmp_path / "models" / "fedavg" / "s0" / f"d{HELD_OUT}"
    args = [
        *("--federation", fed_file, "--params", params, "--algorithm", "fedavg", "--seed", "0"),
        *("--held-out", HELD_OUT, "--superlink", "127.0.0.1:1", "--out", out, "--work", tmp_path / "work"),
    ]
    result = CliRunner().invoke(main, ["federate", *map(str, args)])
    err = capfd.readouterr().err + result.output
    assert result.exit_code == 2, err
    assert "round 1/1: " in err and "REFUSED photo_c0: its data does not fit the run" in err  # progress, by id
    assert "federate: REFUSED round 1: photo_c0: its data does not fit the run" in err and "image_size 64" in err
    assert "--allow-refused-sites" in err
    rounds = load_history(out).rounds  # the run is written: the other sites trained
    assert [[x.client for x in r.refused_clients or []] for r in rounds] == [["photo_c0"]]
    assert [r.eval_missing for r in rounds] == [["photo_c0"]] and not any(r.dropped for r in rounds)
    shutil.rmtree(out)
    result = CliRunner().invoke(main, ["federate", *map(str, args), "--allow-refused-sites"])
    assert result.exit_code == 0, capfd.readouterr().err + result.output


def test_the_export_of_a_deployment_carries_a_card_of_the_sites(ws, tiny):
    """`fedccrl export --federation`: the card's training data is the federation file's sites and the counts the
    run's records give (val_n, target_n), nothing more; its accuracy the sites' (evaluate --deploy's result), with
    the per-class figures of the operator's test folder; its dataset hash the federation file's."""
    import hashlib

    from test_model_card import check_accuracy_row, kv, sections, tables

    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_flower.sites import federation_of

    shards = tiny / "data" / "shards"  # here the operator's test folder
    fed = federation_of(load_manifest(shards))
    (ws / "federation.json").write_text(json.dumps(fed.to_dict()))
    assert (
        _cli(ws, "evaluate", "--deploy", "deploy.yaml", "--models", "models", "--shards", shards, "--out", "results")[0]
        == 0
    )
    run = contract.run_dir("models", "fedavg", 0, HELD_OUT)
    args = ["export", "--model", run, "--shards", shards, "--results", "results", "--federation", "federation.json"]
    code, out = _cli(ws, *args, "--no-mlflow", "--out", "exports")
    assert code == 0, out
    card = sections((ws / "exports" / "MODEL_CARD.md").read_text())

    sites, counts = tables(card["Training data"])
    roles = {s.id: (s.domain, "evaluation (held-out)" if s.domain == HELD_OUT else "training") for s in fed.sites}
    assert {r["site"]: (r["domain"], r["role"]) for r in sites} == roles
    assert [int(c["images"]) for c in counts] == [40, SITES_N]  # the last round's val_n and target_n
    assert any("and nothing more" in line for line in card["Training data"])

    result = _result(ws)
    accuracy = tables(card["Held-out accuracy"])[0]
    assert accuracy[0]["measure"] == f"final round, measured by {BY_THE_SITES}"
    check_accuracy_row(accuracy[0], SITES_TARGET[-1], SITES_N)
    per_class = tables(card[f"Per class (final round on {shards} ({result['detail_n_test']} images))"])[0]
    cm = result["detail"]["final"]["confusion"]
    assert [(int(r["correct"]), int(r["images"])) for r in per_class] == [
        (row[i], sum(row)) for i, row in enumerate(cm)
    ]
    sha = hashlib.sha256((ws / "federation.json").read_bytes()).hexdigest()
    assert kv(tables(card["Provenance"])[0])["dataset: sha256 of the federation file federation.json"] == sha


def test_a_deployment_without_a_test_folder_evaluates_reports_draws_and_exports(ws, tiny):
    """deploy.test_shards null: evaluate, report and the curves run on the sites' accuracies, and the export checks
    its parity on generated images (agreement only: no accuracy in parity.json or the card); a deploy.test_shards
    that names no shard folder is refused naming the key, before any output."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_flower.sites import federation_of
    from fedccrl_pipeline.checked_export import GENERATED, GENERATED_IMAGES

    (ws / "federation.json").write_text(json.dumps(federation_of(load_manifest(tiny / "data" / "shards")).to_dict()))
    assert _cli(ws, "evaluate", "--deploy", "deploy.yaml", "--models", "models", "--out", "results")[0] == 0
    code, out = _cli(ws, "report", "--runs", "results", "--metrics", "m.json", "--table", "t.md", "--curves", "c.csv")
    assert code == 0 and "| fedavg | 50.00 |" in (ws / "t.md").read_text(), out
    run = contract.run_dir("models", "fedavg", 0, HELD_OUT)
    export = ["export", "--model", run, "--deploy", "deploy.yaml", "--results", "results"]
    code, out = _cli(ws, *export, "--federation", "federation.json", "--no-mlflow", "--out", "exports")
    assert code == 0, out
    parity = json.loads((ws / "exports" / "parity.json").read_text())
    assert parity["inputs"] == GENERATED and parity["n_images"] == GENERATED_IMAGES
    assert parity["top1_agreement"] >= 0.999 and "onnx_accuracy" not in parity
    card = (ws / "exports" / "MODEL_CARD.md").read_text()
    assert f"ran on {GENERATED_IMAGES} generated images (no test folder): no accuracy" in card

    (ws / "deploy.yaml").write_text((ws / "deploy.yaml").read_text() + "  test_shards: test/shards\n")
    code, out = _cli(ws, *export, "--federation", "federation.json", "--no-mlflow", "--out", "exports2")
    assert code == 2 and "deploy.yaml: key 'deploy.test_shards':" in out and "holds no manifest.json" in out, out
    assert not (ws / "exports2").exists()
    code, out = _cli(ws, *export, "--no-mlflow", "--out", "exports2")
    assert code == 2 and "--deploy is a deployment's" in out, out


def on_remote_link(monkeypatch, server_root: Path, grid_of, watching: list) -> None:
    """`fedccrl federate` submitting to a SuperLink whose host has a disk of its own: the submitted run is served
    here on grid_of(spec) (tests/flower_harness.py) by the ServerApp as Flower run 1, its work folder the same path
    under `server_root` (another machine's disk); `watching[0]` is False while the ServerApp runs."""
    import fedccrl_flower.run as run_mod
    from fedccrl_flower.server_app import FlowerServer
    from fedccrl_flower.spec import report_dir

    def on_server(path: str) -> str:
        return str(server_root / Path(path).relative_to(Path(path).anchor))

    class RemoteLink:  # fedccrl_flower/federation.py Federation, its SuperLink on another machine
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, spec):
            remote = spec.model_copy(
                update={"work_dir": on_server(spec.work_dir), "checkpoint": on_server(spec.checkpoint)}
            )
            grid = grid_of(spec)
            watching[0] = False
            try:
                FlowerServer(
                    grid,
                    remote,
                    report_dir=report_dir(remote.work_dir, 1),
                    run_id=1,
                    log=lambda m: None,
                    sleep=lambda s: grid.now.__setitem__(0, grid.now[0] + s),
                    clock=lambda: grid.now[0],
                ).run()
            finally:
                watching[0] = True
            return 1

        def check_alive(self):
            pass

        def status(self, run_id):
            return {"status": "finished:completed"}

    monkeypatch.setattr(run_mod, "Federation", RemoteLink)


def test_federate_follows_the_run_through_mlflow_without_the_superlinks_disk(data, tmp_path, monkeypatch):
    """The SuperLink's host keeps the ServerApp's work folder on its own disk (server/): `fedccrl federate` follows
    the rounds and fetches the trained weights through the run's MLflow child run (fedccrl_flower/tracked_report.py)
    and opens nothing under server/ (an audit hook on "open"); its run folder is the one of a run whose result is
    read from the ServerApp's folder (today's launcher, which shared that disk). A result whose bytes differ from the digest the ServerApp reported is
    refused, naming it."""
    import sys

    import mlflow
    from flower_harness import loopback

    from fedccrl_core.federation.history import load_history
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_core.learning.model_file import torch_load
    from fedccrl_flower.flower_result import read_result
    from fedccrl_flower.spec import ReportTo, report_dir
    from fedccrl_flower.tracked_report import TrackedReader, artifact_dir
    from fedccrl_pipeline.federate import federate

    params = write_params(tmp_path, {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu"})
    fed_file = federation_file(data, tmp_path)
    grid_of = lambda spec: loopback(data, clients=[*spec.sources, *spec.evaluators])  # noqa: E731
    server, operator = tmp_path / "server", tmp_path / "operator"
    watching, opened = [False], []

    def audit(event, args):
        if event == "open" and watching[0] and str(args[0]).startswith(str(server)):
            opened.append(args[0])

    sys.addaudithook(audit)  # stays for the process: inert once `watching` is off
    on_remote_link(monkeypatch, server, grid_of, watching)
    out = operator / "models" / "fedavg" / "s0" / f"d{HELD_OUT}"
    watching[0] = True
    try:
        federate(fed_file, params, "fedavg", 0, HELD_OUT, "127.0.0.1:1", "", out, operator / "work", 0.0)
    finally:
        watching[0] = False
    assert opened == []
    ckpt = server / (operator / "work").relative_to("/") / "checkpoint.pt"
    assert ckpt.is_file() and not (operator / "work" / "checkpoint.pt").exists()  # the ServerApp's, on its disk

    # the run folder is the one today's launcher wrote from the ServerApp's own result.pt in its folder
    server_side = read_result(report_dir(ckpt.parent, 1))
    assert [r.to_dict() for r in load_history(out).rounds] == [r.to_dict() for r in server_side.history]
    for name, weights in (
        (contract.MODEL_FILE, server_side.final_weights),
        (contract.BEST_FILE, server_side.best_weights),
    ):
        saved = torch_load(out / name)["state_dict"]
        assert saved.keys() == weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)

    child = str(load_history(out).meta.mlflow_run_id)
    client = mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(child, contract.TARGET_ACC)] == [1]  # on_round, per record
    reader = TrackedReader(ReportTo(tracking_uri=mlflow.get_tracking_uri(), run_id=child), 1)
    assert reader.status()["status"] == "completed" and reader.status()["records"] == 1
    stored = Path(client.get_run(child).info.artifact_uri.removeprefix("file://")) / artifact_dir(1) / "result.pt"
    stored.write_bytes(stored.read_bytes() + b"\0")
    with pytest.raises(DataError, match="result.pt: refused: its sha256 is .* expected"):
        reader.result()


def test_a_deployments_releases_reach_the_operators_study_once_each(data, tmp_path, monkeypatch, capfd):
    """The ServerApp on a SuperLink host without the operator's disk finds no study pointer; its round records carry
    its releases through MLflow and `fedccrl federate` counts them: the operator's study ledger ends with exactly the
    run's releases (the ServerApp's own ledger file, on its disk), keyed by ledger and index, and the parent's study
    epsilon is an independent dp_accounting composition of them. An operator that stopped following after the first
    release: the next federate of the run catches up from MLflow before its budget check (which then refuses it), and
    a third counts nothing twice."""
    import mlflow
    from flower_harness import loopback
    from test_sweep_epsilon import independent

    from fedccrl_core.federation.history import load_history
    from fedccrl_core.privacy.study_ledger import POINTER_SUFFIX, read_study
    from fedccrl_pipeline.federate import federate
    from fedccrl_pipeline.params import ParamError
    from fedccrl_pipeline.study_privacy import STUDY_EPSILON
    from fedccrl_pipeline.sweep_privacy import SWEEP_PLANNED

    settings = {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu", "train.privacy.enabled": True}
    studies = tmp_path / "studies"
    params = write_params(
        tmp_path, {**settings, "train.privacy.weights_clip": 0.5}, new_keys={"train.privacy.study_dir": str(studies)}
    )
    fed_file = federation_file(data, tmp_path)
    grid_of = lambda spec: loopback(data, clients=[*spec.sources, *spec.evaluators])  # noqa: E731
    server, operator = tmp_path / "server", tmp_path / "operator"
    on_remote_link(monkeypatch, server, grid_of, [False])
    out = operator / "models" / "fedccrl" / "s0" / f"d{HELD_OUT}"
    deploy = tmp_path / "deploy.yaml"  # the sweep is this one run: its planned epsilon is the run's
    deploy.write_text(
        "deploy:\n  superlink: 127.0.0.1:1\n  root_certificates: ''\n  algorithms: [fedccrl]\n  seeds: [0]\n"
        f"  held_out: [{HELD_OUT}]\n"
    )
    run = (fed_file, params, "fedccrl", 0, HELD_OUT, "127.0.0.1:1", "", out, operator / "work", 0.0, deploy)
    federate(*run)

    ckpt = server / (operator / "work").relative_to("/") / "checkpoint.pt"
    assert not list(ckpt.parent.glob("*" + POINTER_SUFFIX))  # the ServerApp's disk has no study pointer
    server_ledger = json.loads(ckpt.with_name(ckpt.name + ".ledger.json").read_text())
    releases = server_ledger["releases"]  # what the ServerApp charged, on its own disk
    assert [r[:2] for r in releases] == [["statistics", 1], ["weights", 1]]  # FedCCRL's round: both channels
    history = load_history(out)
    ledger = studies / f"{history.dp.study}.jsonl"
    _, entries = read_study(ledger)
    assert [e.as_ledger() for e in entries] == releases
    assert [e.release for e in entries] == [f"{server_ledger['id']}/0", f"{server_ledger['id']}/1"]
    assert {(e.run_key, e.attempt) for e in entries} == {(history.meta.params_hash, 1)}
    want = independent([(c, p, k, z) for c, _, p, k, z in releases], history.dp.delta)  # dp_accounting, by hand
    child = mlflow.MlflowClient().get_run(str(history.meta.mlflow_run_id))
    parent = mlflow.MlflowClient().get_run(child.data.tags["mlflow.parentRunId"]).data.metrics
    assert parent[STUDY_EPSILON] == pytest.approx(want, rel=1e-9) and want > 0
    assert history.dp.study_epsilon == pytest.approx(dict.fromkeys(("photo", "art", "cartoon"), want), rel=1e-9)
    assert "round 1: 2 release(s) counted in" in capfd.readouterr().err

    # the operator stopped following after round 1: the study holds its first release only
    ledger.write_text("".join(ledger.read_text().splitlines(keepends=True)[:2]))
    budget = write_params(
        tmp_path / "budget",
        {**settings, "train.privacy.weights_clip": 0.5},
        new_keys={"train.privacy.study_dir": str(studies), "train.privacy.max_sweep_epsilon": parent[SWEEP_PLANNED]},
    )
    for counted_now, before in ((1, 1), (0, 2)):  # the first catches up, the second finds nothing new
        with pytest.raises(ParamError, match=f"study {history.dp.study}"):  # this run again would be too much
            federate(run[0], budget, *run[2:])
        assert [e.as_ledger() for e in read_study(ledger)[1]] == releases
        err = capfd.readouterr().err
        assert (
            f"caught up Flower run 1 (MLflow run {child.info.run_id}), completed: {counted_now} release(s) "
            f"counted now, {before} before"
        ) in err, err


def test_federate_names_a_run_ledger_the_study_counts_only_in_part(tmp_path):
    """deployed_study.counted: a record read twice counts its release once, and when the run is done with more
    releases charged than the study counts of its ledger (a record lost on the way), a WARNING says how many."""
    from types import SimpleNamespace

    from fedccrl_core.federation.loop import RunResult
    from fedccrl_core.federation.round_record import parse_round
    from fedccrl_core.privacy.study_ledger import read_study
    from fedccrl_pipeline.deployed_study import counted
    from fedccrl_pipeline.study_privacy import Study

    study = Study("d1", "d1", "", tmp_path / "d1.jsonl")
    job = SimpleNamespace(run_key="k", algorithm="fedavg", seed=0, target=HELD_OUT, sources=["photo"])
    fields = {"val_acc": 0.5, "target_acc": 0.5, "val_pred_classes": 2, "seconds": 1.0, "bytes_up": 1, "bytes_down": 1}
    rec = parse_round(
        {"round": 1, **fields, "dp_releases": {"ledger": "A", "start": 0, "releases": [["weights", 1, 4, 2, 0.5]]}}, ""
    )
    charged = {contract.PRIVACY_RELEASES: [("weights", 4, 2, 0.5)] * 2}  # round 2's record never arrived

    def train(job, *, on_round, **kwargs):
        on_round(rec)
        on_round(rec)
        return RunResult([], {}, {}, 1, extra=charged)

    logs: list[str] = []
    counted(train, study, logs.append)(job, on_round=None)
    assert [e.release for e in read_study(study.ledger)[1]] == ["A/0"]
    assert logs[1].endswith("round 1: 0 release(s) counted in " + f"{study.ledger} (1 counted before)")
    assert "WARNING: the run's ledger A charged 2 release(s)" in logs[-1] and "counts 1 of them" in logs[-1]


def test_a_failure_reported_through_mlflow_is_an_error_after_its_records(tmp_path):
    """The ServerApp reports a record and then `failed` with its error to the MLflow run (tracked_report.py): the
    operator's wait_for_result hands the record on, then raises FlowerRunError with that error, reading nothing
    under the work folder it is given; a status tag that is not JSON is an error naming the run and the tag."""
    import mlflow

    from fedccrl_core.federation.round_record import parse_round
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_flower.follow import wait_for_result
    from fedccrl_flower.processes import FlowerRunError
    from fedccrl_flower.spec import ReportTo
    from fedccrl_flower.tracked_report import TrackedWriter, status_tag
    from fedccrl_pipeline.mlflow_store import set_experiment

    class Link:  # the Flower side: the SuperLink's run still listed as running
        def check_alive(self):
            pass

        def status(self, run_id):
            return {"status": "running"}

    run = mlflow.MlflowClient().create_run(set_experiment("no-shared-disk").experiment_id).info.run_id
    target = ReportTo(tracking_uri=mlflow.get_tracking_uri(), run_id=run)
    spent = parse_round({"round": 2, contract.DP_STOPPED: 1.0}, "a stopped round")
    writer = TrackedWriter(target, 7)
    writer.status("running")
    writer.append_record(spent)
    writer.status("failed", error="round 3: too few clients")
    seen: list = []
    nowhere = tmp_path / "not-this-machines"
    with pytest.raises(FlowerRunError, match="Flower run 7 failed: round 3: too few clients"):
        wait_for_result(Link(), 7, nowhere, seen.append, poll_s=0.01, report_to=target)
    assert seen == [spent] and not nowhere.exists()
    mlflow.MlflowClient().set_tag(run, status_tag(7), "{not json")
    with pytest.raises(DataError, match=f"MLflow run {run} at .*: tag fedccrl.flower.run-7 is not JSON"):
        wait_for_result(Link(), 7, nowhere, seen.append, poll_s=0.01, report_to=target)
