"""The DVC pipeline end to end on the embedded default (download -> ... -> report, figures) in a temp
workspace, the MLflow run structure, resume after kill -9, determinism, and bad params."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from fixtures import DELETE, dvc_env, dvc_run, write_params

REPO = Path(__file__).resolve().parents[1]


SMALL = {
    "train.rounds": 2,
    "train.local_epochs": 1,
    "train.held_out": ["photo", 3],  # a name and an index
    "tracking.system_metrics_interval_s": 0.5,
}


@pytest.fixture(scope="module")
def repro_ws(tmp_path_factory):
    ws = tmp_path_factory.mktemp("repro")
    shutil.copy(REPO / "dvc.yaml", ws / "dvc.yaml")
    for code in ("fedccrl_core", "fedccrl_flower", "serving", "pipeline"):  # code deps of the stages
        (ws / code).symlink_to(REPO / code)
    write_params(ws, SMALL)
    dvc_run(["dvc", "init", "--no-scm", "-q"], ws)
    shutil.copytree(REPO / ".dvc" / "plots", ws / ".dvc" / "plots")  # the curves' template
    t0 = time.perf_counter()
    p = dvc_run(["dvc", "repro"], ws)
    return ws, time.perf_counter() - t0, p


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_repro_produces_every_output(repro_ws):
    ws, seconds, _ = repro_ws
    for d in ("photo", 3):  # models/<alg>/s<seed>/d<held_out entry>: dphoto, d3
        run_dir = ws / "models" / "fedccrl" / "s0" / f"d{d}"
        for f in ("model.pt", "best.pt", "history.json", "history.csv"):
            assert (run_dir / f).is_file(), f
        parity = json.loads((ws / "exports" / "fedccrl" / "s0" / f"d{d}" / "parity.json").read_text())
        assert (
            parity["top1_agreement"] >= 0.999 and (ws / "exports" / "fedccrl" / "s0" / f"d{d}" / "model.onnx").is_file()
        )
        res = json.loads((ws / "results" / "runs" / "fedccrl" / "s0" / f"d{d}.json").read_text())
        assert 0.0 <= res["final_target_acc"] <= 1.0 and res["best_round"] in (1, 2)
        assert len(res["per_round"]) == 2
    metrics = json.loads((ws / "results" / "metrics.json").read_text())
    assert set(metrics["fedccrl"]) == {"photo", "sketch", "avg", "comm_mb_per_round"}
    summary = json.loads((ws / "results" / "parity.json").read_text())
    assert summary["runs"] == 4 and summary["min_top1_agreement"] >= 0.999
    table = (ws / "results" / "table.md").read_text()
    assert "| fedccrl |" in table and "| fedavg |" in table and "photo" in table and "sketch" in table
    print(f"dvc repro (2 held-out domains, 2 rounds x 1 epoch): {seconds:.1f}s")


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_two_rounds_lower_the_loss(repro_ws):
    ws, _, _ = repro_ws
    for d in ("photo", 3):  # models/<alg>/s<seed>/d<held_out entry>: dphoto, d3
        rounds = json.loads((ws / "models" / "fedccrl" / "s0" / f"d{d}" / "history.json").read_text())["rounds"]
        assert rounds[1]["loss"] < rounds[0]["loss"]
        assert {"l_cls", "l_ra", "l_js", "train_acc", "val_acc", "target_acc", "lr", "bytes_up"} <= set(rounds[0])


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_dvc_metrics_and_plots_show(repro_ws, tmp_path):
    ws, _, _ = repro_ws
    p = dvc_run(["dvc", "metrics", "show", "--json"], ws)
    shown = json.loads(p.stdout)
    data = shown[""]["data"]
    assert set(data) == {"results/summary.json", "results/parity.json"}  # the compact metrics only
    summary = data["results/summary.json"]["data"]
    metrics = json.loads((ws / "results" / "metrics.json").read_text())
    for alg in ("fedavg", "fedccrl"):
        assert set(summary[alg]) == {"photo", "sketch", "avg"}
        assert summary[alg]["sketch"] == round(metrics[alg]["sketch"]["final_target_acc"]["mean"], 4)
    # one line per (run, held-out domain), y declared; the figures' PNGs in the same output
    doc = json.loads(dvc_run(["dvc", "plots", "show", "--json"], ws).stdout)["data"]
    (curves,) = doc["results/curves.csv"]
    spec = curves["content"]
    assert spec["encoding"]["y"]["field"] == "target_acc" and spec["encoding"]["x"]["field"] == "round"
    assert spec["encoding"]["color"]["field"] == "series"
    values = spec["data"]["values"]
    series = {v["series"] for v in values}
    assert series == {f"{a}/s0/{d}" for a in ("fedavg", "fedccrl") for d in ("photo", "sketch")}
    for s in series:  # each series: the run's rounds, its target accuracy as evaluated
        alg, _, dom = s.split("/")
        rounds = {int(v["round"]): float(v["target_acc"]) for v in values if v["series"] == s}
        run = json.loads(
            (ws / "results" / "runs" / alg / "s0" / f"d{'photo' if dom == 'photo' else 3}.json").read_text()
        )
        assert rounds == {r["round"]: r["target_acc"] for r in run["per_round"]}
    assert any(k.startswith("plots/") and k.endswith(".png") and v[0]["type"] == "image" for k, v in doc.items())
    dvc_run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], ws)
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "<img" in html and "series" in html  # the figures and the curves in one page
    status = dvc_run(["dvc", "status"], ws)
    assert "changed" not in status.stdout  # everything up to date: a rerun would do nothing


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_mlflow_parent_and_child_runs_with_round_metrics(repro_ws):
    ws, _, _ = repro_ws
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedccrl-synthetic")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedccrl.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("fedccrl.role") == "child"]
    assert len(parents) == 1 and len(children) == 4  # the default: fedavg and fedccrl x held-out 0, 3
    pp = parents[0].data.params  # params.yaml's keys; of the algorithm groups only the sweep's
    assert (
        pp["train.rounds"] == "2" and "train.fedccrl.r" in pp and not [k for k in pp if k.startswith("train.fedprox.")]
    )
    manifest = ws / "data" / "shards" / "manifest.json"
    digest = __import__("hashlib").sha256(manifest.read_bytes()).hexdigest()[:16]
    for c in children:
        p = c.data.params
        alg = p["train.algorithm"]
        assert c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert c.data.tags["git_commit"] and c.data.tags["dvc_stage"] == f"train@{alg}-0"
        assert c.data.tags["fedccrl.platform"].startswith("cpu ")  # the kernels that made its numbers
        # params.yaml's dotted keys, resolved values: `auto` replaced by what ran
        assert p["train.rounds"] == "2" and p["train.lr"] == "0.003" and p["dataset.name"] == "synthetic"
        assert p["train.device"] == "cpu" and p["model.backbone"] == "small_cnn" and p["preprocess.image_size"] == "32"
        assert p["train.held_out"] in ("photo", "sketch") and p["train.seed"] == "0"
        assert {k.split(".")[0] for k in p} == {"dataset", "preprocess", "partition", "model", "train", "evaluate"}
        other = "fedavg" if alg == "fedccrl" else "fedccrl"
        assert not [k for k in p if k.startswith((f"train.{other}.", "train.flower."))]  # only what the run read
        # dataset lineage: the shards' manifest, its sha256 as the digest
        inputs = c.inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("synthetic-shards", digest)]
        assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "training"
        hist = client.get_metric_history(c.info.run_id, "target_acc")
        assert sorted(m.step for m in hist) == [1, 2]
        keys = ("val_acc", "lr", "seconds", "bytes_up", "bytes_down") + (
            ("l_ra", "l_js", "l_cls") if alg == "fedccrl" else ()
        )
        if alg == "fedccrl":
            assert c.data.params["train.fedccrl.r"] == "0.1" and c.data.params["train.fedccrl.variant"] == "paper"
        for key in keys:
            assert len(client.get_metric_history(c.info.run_id, key)) == 2, key
        assert c.info.status == "FINISHED"
    # system metrics, on by default (sampled every 0.5 s here). MLflow's monitor thread stops for good at the first
    # store error (a busy SQLite file under load), so a run may lack them: at least one run has them
    assert any(k.startswith("system/cpu_utilization") for c in children for k in c.data.metrics)


@pytest.mark.parametrize(
    "key,value,stale",
    [
        ("figures.tsne_points", 40, {"figures"}),
        ("export.batch_size", 64, {"export"}),
        ("evaluate.batch_size", 64, {"evaluate", "train@fedavg-0", "train@fedccrl-0"}),  # training evaluates each round
    ],
)
@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_a_changed_key_makes_exactly_the_stages_that_read_it_stale(repro_ws, key, value, stale, params):
    ws, _, _ = repro_ws
    saved = (ws / "params.yaml").read_bytes()
    try:
        params({**SMALL, key: value}, to=ws)
        got = json.loads(dvc_run(["dvc", "status", "--json"], ws).stdout)
    finally:
        (ws / "params.yaml").write_bytes(saved)
    assert set(got) == stale, got
    assert json.loads(dvc_run(["dvc", "status", "--json"], ws).stdout) == {}  # restored: nothing stale


def _train_cmd(ws, out, params):
    return [
        "fedccrl",
        "train",
        "--shards",
        "data/shards",
        "--pools",
        "data/pools",
        "--algorithm",
        "fedccrl",
        "--seed",
        "0",
        "--held-out",
        "1",
        "--out",
        out,
        "--params",
        str(params),
        "--checkpoints",
        "ck",
    ]


def _rounds(ws, out):
    rounds = json.loads((ws / out / "d1" / "history.json").read_text())[
        "rounds"
    ]  # --out is the (algorithm, seed) folder
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rounds]


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_resume_after_kill9_gives_the_same_metrics_as_an_uninterrupted_run(repro_ws, params):
    """Round 1 is computed by the killed process and round 2 by the resumed one; both equal the
    uninterrupted run's, so this also shows that two processes with the same params and seed agree."""
    ws, _, _ = repro_ws
    params_yaml = params(SMALL, to=ws / "results")
    dvc_run([*_train_cmd(ws, "runA", params_yaml), "--checkpoints", "ckA"], ws)
    proc = subprocess.Popen(
        [*_train_cmd(ws, "runK", params_yaml), "--checkpoints", "ckK"],
        cwd=ws,
        env=dvc_env(ws),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    ck = None
    while time.time() < deadline and proc.poll() is None:
        found = (
            [f for f in (ws / "ckK").rglob("*.pt") if not f.parent.name.endswith(".clients")]
            if (ws / "ckK").exists()
            else []
        )  # the round checkpoint, not a client's state file (written first)
        if found:
            ck = found[0]
            break
        time.sleep(0.1)
    assert ck is not None, "no checkpoint appeared"
    os.kill(proc.pid, signal.SIGKILL)  # kill -9 during round 2
    proc.wait()
    assert not (ws / "runK" / "d1").exists()  # nothing that looks complete
    p = dvc_run([*_train_cmd(ws, "runK", params_yaml), "--checkpoints", "ckK"], ws)
    assert "resuming from checkpoint after round 1" in p.stderr
    assert _rounds(ws, "runK") == _rounds(ws, "runA")


def _train_in_process(ws, out, params_yaml, monkeypatch, algorithm="fedccrl"):
    from click.testing import CliRunner

    from fedccrl_pipeline.train import command

    monkeypatch.chdir(ws)
    args = _train_cmd(ws, out, params_yaml)[2:]
    args[args.index("--algorithm") + 1] = algorithm
    return CliRunner().invoke(command, args)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"train.engine": DELETE}, "key 'train.engine': missing"),  # train.rounds has a registry default; engine none
        ({"train.rounds": "ten"}, "key 'train.rounds': got 'ten'; must be an integer"),
        ({"model.backbone": "vgg99"}, "key 'model.backbone': got 'vgg99'; must be one of auto, small_cnn"),
        ({"train.held_out": [1, 1]}, "key 'train.held_out': got [1, 1]; 1 listed more than once"),
        ({"train.held_out": [-1]}, "key 'train.held_out[0]': got -1; must be an integer >= 0 or a string"),
        (
            {"train.algorithms": ["fedccrl", "fedccrl"]},
            "key 'train.algorithms': got ['fedccrl', 'fedccrl']; 'fedccrl' listed",
        ),
        ({"train.seeds": ["0"]}, "key 'train.seeds[0]': got '0'; must be an integer"),
        ({"train.fedccrl.variant": "code"}, "key 'train.fedccrl.variant': got 'code'; must be one of paper, reference"),
        ({"train.fedccrl.uint8_wrap": "yes"}, "key 'train.fedccrl.uint8_wrap': got 'yes'; must be true or false"),
    ],
)
@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_bad_params_give_one_clear_line(repro_ws, overrides, message, params, tmp_path, monkeypatch):
    ws, _, _ = repro_ws
    res = _train_in_process(ws, str(tmp_path / "out"), params({**SMALL, **overrides}), monkeypatch)
    _assert_one_clear_line(res, message, tmp_path)


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_an_unknown_key_gives_one_clear_line(repro_ws, params, tmp_path, monkeypatch):
    ws, _, _ = repro_ws
    res = _train_in_process(
        ws, str(tmp_path / "out"), params(SMALL, new_keys={"train.fedccrl.lambda3": 1.0}), monkeypatch
    )
    _assert_one_clear_line(res, "key 'train.fedccrl.lambda3': unknown key", tmp_path)


def _assert_one_clear_line(res, message: str, tmp_path: Path) -> None:
    assert res.exit_code == 2
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], res.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_unknown_algorithm_named(repro_ws, params, tmp_path, monkeypatch):
    ws, _, _ = repro_ws
    res = _train_in_process(ws, str(tmp_path / "out"), params(SMALL), monkeypatch, algorithm="fedfoo")
    assert res.exit_code == 2 and "--algorithm: got 'fedfoo'; must be one of" in res.stderr
    assert "fedccrl, fedavg, fedprox" in res.stderr  # the valid names are listed


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_fedccrl_reference_variant_through_the_train_stage(repro_ws, params, tmp_path, monkeypatch):
    """train.fedccrl.variant: reference trains through the train stage, and its MLflow run records
    the variant and each switch's reading (so the two variants compare side by side in MLflow)."""
    import mlflow

    ws, _, _ = repro_ws
    variant = params({**SMALL, "train.rounds": 1, "train.fedccrl.variant": "reference"})
    res = _train_in_process(ws, str(tmp_path / "out"), variant, monkeypatch)
    assert res.exit_code == 0, res.stderr[-3000:]
    meta = json.loads((tmp_path / "out" / "d1" / "history.json").read_text())["meta"]
    assert meta["hparams"]["variant"] == "reference" and meta["hparams"]["forward"] == "per_view"
    run = mlflow.MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"]).get_run(meta["mlflow_run_id"])
    recorded = {
        k: run.data.params[f"train.fedccrl.{k}"] for k in ("variant", "l_cls", "supcon", "upload", "uint8_wrap")
    }
    assert recorded == {
        "variant": "reference",
        "l_cls": "sum",
        "supcon": "self_positive",
        "upload": "floor_unbiased",
        "uint8_wrap": "False",
    }


def test_mlflow_store_resolves_to_the_repo_from_a_dvc_temp_copy(tmp_path, monkeypatch):
    """`dvc exp run --temp/--queue` runs stages under <repo>/.dvc/tmp/exps/...: their runs go to <repo>/mlflow.db."""
    from fedccrl_pipeline.mlflow_store import project_root

    monkeypatch.delenv("DVC_ROOT", raising=False)
    repo = tmp_path / "repo"
    copy = repo / ".dvc" / "tmp" / "exps" / "tmpab12" / "workspace"
    copy.mkdir(parents=True)
    assert project_root(copy) == repo.resolve()
    assert project_root(repo) == repo.resolve()
    monkeypatch.setenv("DVC_ROOT", str(repo))
    monkeypatch.chdir(copy)
    assert project_root() == repo.resolve()


@pytest.mark.full("a DVC workspace that runs dvc repro (the stages run without DVC in test_stages.py)")
@pytest.mark.timeout(1200)
def test_sigterm_marks_the_run_killed_and_a_deleted_store_heals(repro_ws, params):
    """SIGTERM during training (fedccrl_core/foundation/procs.py) ends the MLflow run KILLED, leaves no output and no
    process; deleting mlflow.db afterwards gives a warning and a fresh run, not a traceback, and the resumed
    run's metrics equal an uninterrupted run's."""
    import mlflow

    ws, _, _ = repro_ws
    params_yaml = params(SMALL, to=ws / "results")
    db = ws / "results" / "term.db"
    env = {**dvc_env(ws), "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    proc = subprocess.Popen(
        [*_train_cmd(ws, "runT", params_yaml), "--checkpoints", "ckT"],
        cwd=ws,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (ws / "ckT").exists() and [f for f in (ws / "ckT").rglob("*.pt") if not f.parent.name.endswith(".clients")]:
            break
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and not (ws / "runT" / "d1").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs(
        [client.get_experiment_by_name("fedccrl-synthetic").experiment_id],
        filter_string="tags.`fedccrl.role` = 'child'",
    )
    assert [r.info.status for r in runs] == ["KILLED"]
    db.unlink()  # the tracker's store is gone; the resume state still names the old run id
    p = subprocess.run(
        [*_train_cmd(ws, "runT", params_yaml), "--checkpoints", "ckT"],
        cwd=ws,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "no longer exists" in p.stderr and "resuming from checkpoint after round 1" in p.stderr
    import sqlite3  # a fresh connection: this process's MLflow client still holds the deleted file open

    with sqlite3.connect(db) as con:
        statuses = con.execute(
            "select r.status from runs r join tags t on t.run_uuid = r.run_uuid "
            "where t.key = 'fedccrl.role' and t.value = 'child'"
        ).fetchall()
    assert statuses == [("FINISHED",)]
    if (ws / "runA").exists():  # written by the kill -9 test when it ran first
        assert _rounds(ws, "runT") == _rounds(ws, "runA")


def test_a_sweeps_parent_run_is_named_after_the_experiment_and_its_changed_params():
    from fedccrl_pipeline.run_names import sweep_run_name

    base = yaml.safe_dump({"train": {"lr": 0.001, "rounds": 10, "fedccrl": {"lambda1": 0.1}}, "seed": 0})
    changed = {"train": {"lr": 0.001, "rounds": 2, "fedccrl": {"lambda1": 1}}, "seed": 0}
    assert (
        sweep_run_name("gauge-damn", changed, "0123456789", base) == "gauge-damn train.rounds=2 train.fedccrl.lambda1=1"
    )
    assert sweep_run_name(None, changed, "0123456789", base) == "train.rounds=2 train.fedccrl.lambda1=1"
    same = yaml.safe_load(base)
    assert sweep_run_name(None, same, "0123456789", base) == "default"
    assert sweep_run_name("exp-a", same, "0123456789", base) == "exp-a"
    assert len(sweep_run_name("x", {"k": "v" * 400}, "0123456789", yaml.safe_dump({"k": "w"}))) == 250


def test_a_parent_run_without_a_git_baseline_keeps_the_experiment_or_the_sweep_key(tmp_path, monkeypatch):
    from fedccrl_pipeline.run_names import sweep_run_name

    monkeypatch.chdir(tmp_path)  # not a git repository: no baseline to compare with
    assert sweep_run_name(None, {"a": 1}, "0123456789abcdef") == "sweep-01234567"
    assert sweep_run_name("lr-a", {"a": 1}, "0123456789abcdef") == "lr-a"
