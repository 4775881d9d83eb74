"""The MLflow side of the stages (pipeline/fedccrl_pipeline/mlflow_store.py, tracking.py, run_names.py): a store that cannot be read
stops the stage with an error naming it and starts no run (it is never taken for a store whose run was deleted);
params.yaml is read with one YAML dialect everywhere, so `lr: 1e-3` is the number 0.001 in the MLflow params and
in the parent run's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fixtures import ONE_ROUND, bare_manifest

REPO = Path(__file__).resolve().parents[1]
NOT_A_DATABASE = b"this is not an SQLite database " * 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _store() -> Path:
    import os

    return Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))  # conftest: this test's own store


def _train_args(params: Path, data: Path) -> list[str]:
    return [
        "train",
        "--shards",
        str(data / "shards"),
        "--pools",
        str(data / "pools"),
        "--algorithm",
        "fedavg",
        "--seed",
        "0",
        "--held-out",
        "0",
        "--out",
        "out/model",
        "--checkpoints",
        "ck",
        "--params",
        str(params),
        "--workers",
        "1",
    ]


def test_an_unreadable_store_stops_the_train_stage(params, tiny, tmp_path, monkeypatch):
    """A tracking store MLflow cannot read: the train stage stops before its first run with one error line naming
    the store; no traceback, no output, no resume state, the store untouched."""
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    store = _store()
    store.write_bytes(NOT_A_DATABASE)
    r = CliRunner().invoke(main, _train_args(params({**ONE_ROUND, "tracking.system_metrics": False}), tiny / "data"))
    assert r.exit_code == 2, r.output[-3000:]
    assert f"error: MLflow tracking store sqlite:///{store} cannot be read" in r.output
    assert "Traceback" not in r.output
    assert store.read_bytes() == NOT_A_DATABASE
    assert not (tmp_path / "out").exists() and not list(tmp_path.rglob("*.mlflow.json"))


@pytest.mark.full("trains once (about 20 s on a busy 2-core machine), then reruns the train stage")
def test_an_unreadable_store_stops_a_resumed_train_and_starts_no_run(params, tiny, tmp_path, monkeypatch):
    """The train stage runs, leaving its resume state (checkpoint and the MLflow run id beside it); then the store
    becomes a file MLflow cannot read. The rerun stops with one error line naming the store: no traceback, no new
    run, the store untouched and the resume state still naming the old run."""
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    args = _train_args(params({**ONE_ROUND, "tracking.system_metrics": False}), tiny / "data")
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output[-3000:]
    [side] = (tmp_path / "ck").rglob("*.mlflow.json")
    run_id = json.loads(side.read_text())["run_id"]
    store = _store()
    store.write_bytes(NOT_A_DATABASE)
    before = sorted(p.name for p in tmp_path.iterdir())

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2, again.output[-3000:]
    assert f"error: MLflow tracking store sqlite:///{store} cannot be read" in again.output
    assert "Traceback" not in again.output and "starting a fresh run" not in again.output
    assert store.read_bytes() == NOT_A_DATABASE  # nothing written to it, nothing put in its place
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no other store appeared beside it
    assert json.loads(side.read_text())["run_id"] == run_id  # the resume state still names the old run


def test_a_missing_run_heals_but_an_unreadable_store_is_an_error(tmp_path, capsys):
    """A store without the recorded run (deleted and created afresh) gives a fresh run with a warning; a run lookup
    that fails for any other reason is a TrackingStoreError naming the store, never `no such run`."""
    from fedccrl_pipeline.mlflow_store import TrackingStoreError
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id, run_status

    parent = parent_run_id("heal", "k", {})
    assert run_status("0" * 32) is None
    fresh = ChildRun("heal", parent, "r", {}, {}, resume_run_id="0" * 32)
    assert not fresh.resumed and "no longer exists" in capsys.readouterr().err
    fresh.finish()
    _store().write_bytes(NOT_A_DATABASE)  # the open connections now read a file that is not a database
    with pytest.raises(
        TrackingStoreError, match=re.escape(f"MLflow tracking store sqlite:///{_store()} cannot be read")
    ):
        run_status(fresh.run_id)


def _with_lr(text: str, lr: str) -> str:
    out, n = re.subn(r"(?m)^(  lr: )\S+", rf"\g<1>{lr}", text, count=1)  # train.lr, the first two-space `lr:`
    assert n == 1
    return out


def test_lr_1e_3_is_the_number_0_001_on_every_path(tmp_path):
    """`lr: 1e-3` (YAML 1.2, as DVC writes it) is the float 0.001 when params.yaml is validated, in the training
    config, in the child run's MLflow params, and against a committed baseline with the same line (no change in
    the parent run's name); PyYAML's 1.1 reading made it the string '1e-3' on the baseline side."""
    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.run_names import changed_params, sweep_run_name
    from fedccrl_pipeline.tracked_data import mlflow_params, shards_data
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id
    from fedccrl_pipeline.training import run_settings

    text = _with_lr((REPO / "params.yaml").read_text(), "1e-3")
    (tmp_path / "params.yaml").write_text(text)
    cfg = load_config(tmp_path / "params.yaml")  # validation
    params = cfg.as_written()
    assert params["train"]["lr"] == 0.001 and isinstance(params["train"]["lr"], float)
    settings = run_settings(cfg)
    assert settings.local.lr == 0.001  # training
    manifest = bare_manifest()
    (job,) = plan_runs(
        settings,
        cfg.partition.model_dump(by_alias=True),
        manifest,
        "fedavg",
        0,
        [0],
        ["photo"],
        tmp_path / "models",
        tmp_path / "ck",
        cfg.train.fedavg,
    )
    flat = mlflow_params(params, job, "cpu", shards_data("embedded", "inprocess", manifest, tmp_path))
    assert flat["train.lr"] == 0.001 and isinstance(flat["train.lr"], float)
    run = ChildRun("lr", parent_run_id("lr", "k", params), "r", flat, {})  # MLflow params
    assert run.client.get_run(run.run_id).data.params["train.lr"] == "0.001"
    run.finish()
    assert changed_params(params, text) == {}  # parent-run naming
    assert sweep_run_name(None, params, "0123456789", text) == "default"
    assert changed_params(params, _with_lr(text, "0.003")) == {"train.lr": 0.001}


def _set_experiment_in(cwd: Path, env_drop=("MLFLOW_TRACKING_URI", "FEDCCRL_MLFLOW_ARTIFACTS")):
    """A fresh interpreter in `cwd` (the repository) calling set_experiment, with the user's store left unset."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    code = (
        "from fedccrl_pipeline.mlflow_store import set_experiment; e = set_experiment('race'); "
        "print(e.experiment_id, e.artifact_location, e.tags.get('mlflow.experimentKind'))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_repositorys_store_keeps_artifacts_in_the_repository(tmp_path):
    """mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI: the default store is told by its URI, so a new
    experiment of the repository's store keeps its artifacts in <repo>/mlartifacts and carries its UI tag."""
    p = _set_experiment_in(tmp_path)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    _exp_id, location, kind = out.split()
    assert location == (tmp_path / "mlartifacts" / "race").as_uri()
    assert kind == "custom_model_development"


def test_processes_racing_to_create_the_experiment_all_get_it(tmp_path):
    """`dvc queue start -j 2` starts stages side by side on one new store: every process gets the one experiment,
    tagged, and none fails on the other's insert (UNIQUE constraint of experiments or experiment_tags)."""
    procs = [_set_experiment_in(tmp_path) for _ in range(4)]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    for (_out, err), rc in results:
        assert rc == 0, err
    assert len({out.split()[0] for (out, _), _ in results}) == 1
    assert all(out.split()[2] == "custom_model_development" for (out, _), _ in results)


def test_an_untagged_experiment_tagged_by_another_process_meanwhile_is_accepted(tmp_path, monkeypatch):
    """Two processes find an experiment made elsewhere without the UI tag and both insert it: the one whose
    insert fails takes the other's tag instead of stopping the stage."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from fedccrl_pipeline import mlflow_store

    exp_id = mlflow.MlflowClient().create_experiment("made-elsewhere")
    real = mlflow.MlflowClient.set_experiment_tag

    def loses_the_race(self, experiment_id, key, value):
        real(self, experiment_id, key, value)  # the other process's insert lands first
        raise MlflowException("UNIQUE constraint failed: experiment_tags.key, experiment_tags.experiment_id")

    monkeypatch.setattr(mlflow.MlflowClient, "set_experiment_tag", loses_the_race)
    exp = mlflow_store.set_experiment("made-elsewhere")
    assert exp.experiment_id == exp_id

    def fails(self, experiment_id, key, value):
        raise MlflowException("the store refused")

    mlflow.MlflowClient().create_experiment("untagged")
    monkeypatch.setattr(mlflow.MlflowClient, "set_experiment_tag", fails)
    with pytest.raises(MlflowException, match="refused"):
        mlflow_store.set_experiment("untagged")
