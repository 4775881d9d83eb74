"""`fedccrl evaluate-sites`: a trained model evaluated at every site of a federation, without training
(fedccrl_flower/site_evaluation.py, site_eval_client.py; pipeline/fedccrl_pipeline/evaluate_sites.py).

The model is the session's trained run (conftest.py `trained`, no training here) and its export; the federation is
one site per client of its tiny partition (held-out domain photo: photo_c0 and photo_c1 never trained); the
evaluation-only run goes over the loopback Grid (tests/flower_harness.py), the ServerApp's `main` and the ClientApp's
handlers as Flower runs them, each message through Flower's wire format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures import write_params
from flower_harness import LoopbackGrid
from test_deploy_stages import federation_file

from fedccrl_core.data import shards as shards_mod
from fedccrl_core.outcomes.site_scores import load_scores, wilson
from fedccrl_flower import messages as M
from fedccrl_pipeline.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _configs(sites: dict[str, Path]) -> dict[int, dict]:
    return {
        100 + i: {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: str(f / "shards"), M.NODE_POOLS: str(f / "pools")}
        for i, (cid, f) in enumerate(sites.items())
    }


def _fedccrl(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def federation(tiny, trained, tmp_path_factory):
    """The session's trained run (conftest.py `trained`: one round of FedAvg on `tiny`, held-out domain 0, with its
    MLflow store) as a federation's model: one site per client of the tiny partition (each SuperNode reads only its
    own client from the shard folder), the federation file of that partition, the run's export (`fedccrl export`),
    and each site's own image folder (<class>/<image>: the raw files its shard was made from)."""
    ws = tmp_path_factory.mktemp("evaluate-sites")
    data = tiny / "data"
    run, fed = trained / "models" / "fedavg" / "s0" / "d0", federation_file(data, ws)
    export = ws / "exports" / "fedavg" / "s0" / "d0"
    code, out = _fedccrl(
        *("export", "--model", run, "--shards", data / "shards", "--params", trained / "params.yaml"),
        *("--no-mlflow", "--out", export),
    )
    assert code == 0, out
    images = {}
    for client in json.loads((data / "shards" / "manifest.json").read_text())["clients"]:
        cid = client["id"]
        s = shards_mod.load_client(data / "shards", cid)
        images[cid] = ws / f"site-{cid}" / "images"
        for rel in [*s.train_paths, *s.val_paths]:  # <domain>/<class>/<file>
            dest = images[cid] / Path(rel).relative_to(Path(rel).parts[0])
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tiny / "raw" / rel, dest)
    sites = dict.fromkeys(images, data)  # every SuperNode reads its own client of the one shard folder
    return dict(
        sites=sites,
        images=images,
        federation=fed,
        run=run,
        export=export,
        models=trained / "models",
        params=trained / "params.yaml",
        store=f"sqlite:///{trained / 'mlflow.db'}",
    )


def on_sites(
    monkeypatch, configs: dict[int, dict], dead: tuple[str, ...] = (), remote: Path | None = None, before=None
):
    """`fedccrl evaluate-sites` with the loopback Grid of `configs` standing in for the SuperLink: the submitted run
    is the ServerApp's (server_app.main, which hands it to site_evaluation.py), run here as Flower's run 1. The
    SuperNodes of the client ids in `dead` never answer. With `remote`, the SuperLink's host has a disk of its own:
    the ServerApp's work folder is the same path under `remote`, and what the ServerApp raises stays on that host, as
    on a SuperLink (the launcher learns of it from the run's status); `before(spec)` runs before the ServerApp does.
    Returns the list of the Grids served on."""
    from flwr.app import Context, RecordDict

    import fedccrl_flower.site_evaluation as se
    from fedccrl_flower.server_app import main as server_main

    grids: list[LoopbackGrid] = []

    class LoopbackLink:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, spec, run_config=None):
            if before is not None:
                before(spec)
            if remote is not None:
                spec = spec.model_copy(update={"work_dir": str(remote / Path(spec.work_dir).relative_to("/"))})
            cfg = {M.RUN_SPEC: spec.to_json(), **(run_config or {})}
            grids.append(grid := LoopbackGrid(configs))
            grid.dead = {n for n, c in configs.items() if c[M.NODE_CLIENT_ID] in dead}
            try:
                server_main(grid, Context(1, 0, {}, RecordDict(), cfg))
            except Exception:
                if remote is None:
                    raise
            return 1

        def check_alive(self):
            pass

    monkeypatch.setattr(se, "Federation", LoopbackLink)
    return grids


def _evaluate(t: dict, out: Path, *args) -> tuple[int, str]:
    return _fedccrl(
        *("evaluate-sites", "--federation", t["federation"], "--params", t["params"], "--superlink", "127.0.0.1:1"),
        *("--out", out, "--work", out.parent / (out.name + ".work"), *args),
    )


def test_each_sites_counts_are_fedccrl_serves_on_its_image_folder(federation, tmp_path, monkeypatch, capfd):
    """The export folder (its metadata leads to the run's weights) evaluated at every site on its whole folder: each
    site's per-class counts equal `fedccrl-serve evaluate` of the exported model on that site's image folder, run at
    the site; the tables name each site and domain, with the Wilson interval of its counts; the MLflow run is in the
    model's experiment, tagged with the model's run id and run key."""
    import mlflow

    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_serving.cli import main as serve_main

    t = federation
    monkeypatch.setenv("MLFLOW_TRACKING_URI", t["store"])
    on_sites(monkeypatch, _configs(t["sites"]))
    out = tmp_path / "sites"
    code, text = _evaluate(t, out, "--model", t["export"], "--models", t["models"], "--split", "all")
    err = capfd.readouterr().err + text
    assert code == 0, err
    result = load_scores(out / "sites.json")
    assert [s.client for s in result.sites] == sorted(t["sites"]) and not result.refused
    assert "| photo_c1 | photo (all) |" in (out / "sites.md").read_text() and "photo_c1" in err
    for s in result.sites:
        assert s.split == "all"
        args = ["evaluate", str(t["export"] / "model.onnx"), str(t["images"][s.client]), "--json", "--quiet"]
        served = CliRunner().invoke(serve_main, args)
        assert served.exit_code == 0, served.output
        report = json.loads(served.stdout[served.stdout.index("{") :])
        per = report["per_class"]
        assert [c.n for c in s.score.per_class] == [per[c]["n"] for c in result.classes]
        assert [c.correct for c in s.score.per_class] == [per[c]["correct"] for c in result.classes]
        assert [c.predicted for c in s.score.per_class] == [sum(col) for col in zip(*report["confusion_matrix"])]
        shard = shards_mod.load_client(t["sites"][s.client] / "shards", s.client)
        assert s.score.n == len(shard.train_y) + len(shard.val_y)
        assert s.score.ci95 == wilson(s.score.correct, s.score.n)
    assert result.pooled.n == sum(s.score.n for s in result.sites)
    meta = load_meta(t["run"] / "model.pt")
    (run,) = mlflow.search_runs(
        experiment_ids=[meta.mlflow_experiment_id],
        filter_string="tags.`fedccrl.stage` = 'evaluate-sites'",
        output_format="list",
    )
    assert run.data.tags["fedccrl.model_run_id"] == meta.mlflow_run_id and meta.mlflow_run_id
    assert run.data.tags["fedccrl.run_key"] == meta.params_hash
    assert run.data.metrics["site/sketch_c1/acc"] == pytest.approx(result.sites[-1].score.accuracy)


def test_auto_counts_a_training_sites_val_split_and_a_refused_site_is_named(federation, tmp_path, monkeypatch, capfd):
    """--split auto (the run folder): a site that trained the model counts its val split, the held-out domain's
    sites their whole folder; a site whose class list is not the model's refuses by its client id with the reason,
    the command names it on stderr and exits 2, or 0 with --allow-refused-sites."""
    t = federation
    odd = tmp_path / "odd"  # art_c0's shard folder with the classes in another order
    shutil.copytree(t["sites"]["art_c0"] / "shards", odd / "shards")
    manifest = json.loads((odd / "shards" / "manifest.json").read_text())
    (odd / "shards" / "manifest.json").write_text(json.dumps({**manifest, "classes": manifest["classes"][::-1]}))
    on_sites(monkeypatch, _configs({**t["sites"], "art_c0": odd}))
    out = tmp_path / "sites"
    args = ("--model", t["run"], "--no-mlflow")
    code, text = _evaluate(t, out, *args)
    err = capfd.readouterr().err + text
    assert code == 2, err
    assert "evaluate-sites: REFUSED art_c0: its data does not fit the model" in err and "classes" in err
    result = load_scores(out / "sites.json")  # written: the other sites answered
    assert [p.client for p in result.refused] == ["art_c0"] and not result.dropped
    split = {s.client: (s.split, s.score.n) for s in result.sites}
    for cid in ("art_c1", "cartoon_c0", "cartoon_c1", "sketch_c0", "sketch_c1"):
        assert split[cid] == ("val", len(shards_mod.load_client(t["sites"][cid] / "shards", cid).val_y))
    for cid in ("photo_c0", "photo_c1"):  # the held-out domain's: never trained
        shard = shards_mod.load_client(t["sites"][cid] / "shards", cid)
        assert split[cid] == ("all", len(shard.train_y) + len(shard.val_y))
    code, text = _evaluate(t, out, *args, "--allow-refused-sites", "--sites", "art_c0,photo_c0")
    assert code == 0, capfd.readouterr().err + text
    assert [s.client for s in load_scores(out / "sites.json").sites] == ["photo_c0"]


def test_a_site_that_does_not_answer_is_named_as_dropped(federation, tmp_path, monkeypatch, capfd):
    """A SuperNode that never answers (its reply timeout 1 s): the site is named as dropped with the reason, the
    others' tables are written, and the exit code is 2."""
    t = federation
    params = write_params(tmp_path, {"train.flower.query_timeout_s": 1})
    on_sites(monkeypatch, _configs(t["sites"]), dead=("photo_c0",))
    out = tmp_path / "sites"
    code, text = _evaluate({**t, "params": params}, out, "--model", t["run"], "--no-mlflow")
    err = capfd.readouterr().err + text
    assert code == 2, err
    assert "evaluate-sites: dropped node 100: no query reply within 1.0s" in err, err
    assert "evaluate-sites: dropped photo_c0: did not answer" in err
    assert [s.client for s in load_scores(out / "sites.json").sites] == sorted(set(t["sites"]) - {"photo_c0"})


@pytest.fixture(scope="module")
def operator_store(tmp_path_factory) -> dict[str, str]:
    """One MLflow store (created once: a few seconds) for the tests whose runs carry the model to the ServerApp;
    each test reads back only the runs it made."""
    from fedccrl_pipeline.mlflow_store import mlflow_module

    folder = tmp_path_factory.mktemp("operator-store")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}", "FEDCCRL_MLFLOW_ARTIFACTS": str(folder / "art")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mlflow_module()
    return env


def _sites_json(out: Path) -> list:
    return [s.model_dump() for s in load_scores(out / "sites.json").sites]


def test_the_model_travels_through_mlflow_to_a_serverapp_that_cannot_see_the_operators_disk(
    federation, operator_store, tmp_path, monkeypatch, capfd
):
    """The SuperLink's host shares no disk with the operator: its ServerApp writes its work folder on its own disk
    (server/), and the run folder the operator named is moved away before the ServerApp runs. The command logged the
    model file to its MLflow run and named that artifact and the file's sha256 in the spec; the ServerApp downloads
    it, evaluates, and reports its status and outcome to that run, which the command follows (its own work folder
    holds no report: reading it would time out). The sites' counts are those of the same evaluation by a ServerApp
    that reads the file at its path (--no-mlflow, one disk)."""
    import mlflow

    from fedccrl_core.data.checksums import sha256_file
    from fedccrl_flower.tracked_report import status_tag

    t = federation
    for k, v in operator_store.items():
        monkeypatch.setenv(k, v)
    run, away, server = tmp_path / "operator" / "run", tmp_path / "moved-away", tmp_path / "server"
    shutil.copytree(t["run"], run)
    digest, specs = sha256_file(run / "model.pt"), []

    def hide(spec):
        specs.append(spec)
        run.rename(away)

    on_sites(monkeypatch, _configs(t["sites"]), remote=server, before=hide)
    out = tmp_path / "sites"
    code, text = _evaluate(t, out, "--model", run, "--split", "all", "--timeout-s", 60)
    err = capfd.readouterr().err + text
    assert code == 0, err
    (spec,) = specs
    assert (spec.model_file, spec.model_artifact, spec.model_sha256) == ("", "model/model.pt", digest)
    assert not run.exists() and not list(out.parent.glob("sites.work/run-1/*"))
    assert list(server.rglob("site_eval.json"))  # the ServerApp's report folder, on its own disk
    mlrun = mlflow.MlflowClient().get_run(spec.report_to.run_id)
    assert mlrun.info.status == "FINISHED" and json.loads(mlrun.data.tags[status_tag(1)])["status"] == "completed"
    away.rename(run)
    on_sites(monkeypatch, _configs(t["sites"]))
    code, text = _evaluate(t, tmp_path / "shared", "--model", run, "--split", "all", "--no-mlflow")
    assert code == 0, capfd.readouterr().err + text
    assert _sites_json(out) == _sites_json(tmp_path / "shared") and len(_sites_json(out)) == len(t["sites"])


def test_a_downloaded_model_whose_sha256_differs_is_refused_before_any_site_hears_of_it(
    federation, operator_store, tmp_path, monkeypatch, capfd
):
    """The model file logged to the command's MLflow run is altered in the tracking server's store before the
    ServerApp downloads it: the ServerApp refuses it, naming the artifact and both digests, and sends no message to
    any site; the command fails with that reason (read from the MLflow run, not the SuperLink host's disk), writes no
    output, and its MLflow run is FAILED. An artifact the run lacks is an error naming it; a spec's local model_file
    is checked against the digest as the download is."""
    import mlflow

    from fedccrl_core.foundation.errors import DataError
    from fedccrl_core.foundation.records import parse_record
    from fedccrl_flower.site_evaluation import read_model
    from fedccrl_flower.spec import SiteEvalSpec

    t = federation
    for k, v in operator_store.items():
        monkeypatch.setenv(k, v)
    specs = []

    def alter(spec):
        specs.append(spec)
        stored = Path(mlflow.MlflowClient().get_run(spec.report_to.run_id).info.artifact_uri.removeprefix("file://"))
        (stored / spec.model_artifact).write_bytes((stored / spec.model_artifact).read_bytes() + b"\0")

    grids = on_sites(monkeypatch, _configs(t["sites"]), remote=tmp_path / "server", before=alter)
    out = tmp_path / "sites"
    code, text = _evaluate(t, out, "--model", t["run"], "--timeout-s", 60)
    err = capfd.readouterr().err + text
    (spec,) = specs
    assert code == 2, err
    assert "evaluate-sites run 1 failed: DataError: MLflow run " in err
    assert "artifact model/model.pt: refused: its sha256 is " in err and f"expected {spec.model_sha256}" in err
    assert grids[0].sent == [] and not out.exists()
    assert mlflow.MlflowClient().get_run(spec.report_to.run_id).info.status == "FAILED"
    data = json.loads(spec.to_json())  # as the ServerApp parses its run config: one way to the model, named
    for bad, why in (
        ({**data, "model_file": "/elsewhere/model.pt"}, "give exactly one of model_file"),
        (
            {**data, "report_to": None},
            "model_artifact names an artifact of report_to's MLflow run, but report_to is not",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            parse_record(SiteEvalSpec, bad, "run config 'spec'", ValueError)
    absent = spec.model_copy(update={"model_artifact": "model/absent.pt"})
    with pytest.raises(DataError, match=r"artifact model/absent.pt: cannot be downloaded \(MlflowException"):
        read_model(absent)
    other = tmp_path / "other.pt"
    other.write_bytes((t["run"] / "model.pt").read_bytes() + b"\0")
    local = spec.model_copy(update={"model_file": str(other), "model_artifact": "", "report_to": None})
    with pytest.raises(DataError, match=r"other.pt \(the spec's model_file\): refused: its sha256 is "):
        read_model(local)


def test_the_wilson_interval_is_the_hand_computed_one():
    """8 right of 10, z = 1.959964 (z² = 3.841459): p = 0.8, centre = (0.8 + z²/20) / (1 + z²/10) = 0.992073 / 1.384146
    = 0.716740, half-width = z / (1 + z²/10) * sqrt(0.8 * 0.2 / 10 + z² / 400) = 1.416009 * 0.160011 = 0.226578, so
    [0.490162, 0.943318] (by hand)."""
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.490162, abs=1e-6) and high == pytest.approx(0.943318, abs=1e-6)
    assert wilson(0, 0) is None and wilson(5, 5)[1] == 1.0


def test_bad_input_is_refused_before_the_superlink_hears_of_it(federation, tmp_path, monkeypatch):
    """An unknown site, an export without --models, and --split all on a private run's training sites: an error
    naming it, exit 2, no output, nothing submitted."""
    t = federation
    submitted = []
    import fedccrl_flower.site_evaluation as se

    monkeypatch.setattr(se, "Federation", lambda *a, **k: submitted.append(a))
    out = tmp_path / "sites"
    code, text = _evaluate(t, out, "--model", t["run"], "--sites", "nowhere_c9")
    assert code == 2 and "--sites: nowhere_c9 not among the sites of" in text
    code, text = _evaluate(t, out, "--model", t["export"])
    assert code == 2 and "give --models" in text
    assert not submitted and not out.exists()
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.site_splits import choose_splits

    fed = read_federation(t["federation"])
    with pytest.raises(ValueError, match=r"--split all: under train.privacy the model trained on art_c0, "):
        choose_splits(fed, "", "all", {"art_c0"}, True, t["federation"])
    others = [s.id for s in fed.sites if s.id != "art_c0"]
    with pytest.raises(ValueError, match=rf"the train rows of {others[0]} are training images of the study's"):
        choose_splits(fed, others[0], "all", {"art_c0"}, True, t["federation"])
    # under train.privacy every site counts its val split: the others' train rows train the study's other runs
    assert set(choose_splits(fed, "", "auto", {"art_c0"}, True, t["federation"]).values()) == {"val"}
    assert choose_splits(fed, others[0], "all", {"art_c0"}, False, t["federation"]) == {others[0]: "all"}


def test_the_flower_app_declares_the_run_config_key_of_an_evaluation_only_run():
    """A SuperLink refuses a run config key the app does not declare ("Invalid run configuration")."""
    import tomllib

    from fedccrl_flower.federation import APP_DIR

    declared = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert M.RUN_TASK in declared and M.RUN_SPEC in declared


def test_a_site_with_a_privacy_ceiling_counts_only_its_val_rows(federation, tmp_path, monkeypatch, capfd):
    """photo_c0 sets max_epsilon (site.toml, fedccrl_flower/site_ceiling.py): asked for its whole folder (--split auto
    gives the held-out domain's sites `all`), it refuses, and the command names it and exits 2; with --split val it
    counts its val rows, as every other site does."""
    from fedccrl_flower.node_config import NODE_MAX_EPSILON

    t = federation
    configs = _configs(t["sites"])
    (node,) = [n for n, c in configs.items() if c[M.NODE_CLIENT_ID] == "photo_c0"]
    configs[node][NODE_MAX_EPSILON] = 8.0
    on_sites(monkeypatch, configs)
    out = tmp_path / "sites"
    code, text = _evaluate(t, out, "--model", t["run"], "--no-mlflow")
    err = capfd.readouterr().err + text
    assert code == 2 and "photo_c0" in err and "would count the site's train rows" in err, err
    result = load_scores(out / "sites.json")
    assert "photo_c0" not in {s.client for s in result.sites}
    assert [p.client for p in [*result.refused, *result.dropped]] == ["photo_c0"]
    code, text = _evaluate(t, out, "--model", t["run"], "--no-mlflow", "--split", "val")
    assert code == 0, capfd.readouterr().err + text
    split = {s.client: (s.split, s.score.n) for s in load_scores(out / "sites.json").sites}
    assert split["photo_c0"] == (
        "val",
        len(shards_mod.load_client(t["sites"]["photo_c0"] / "shards", "photo_c0").val_y),
    )
