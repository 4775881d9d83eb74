"""`fedccrl deploy init DIR`: the operator's DVC project made from the installed package, outside the checkout, and
its `dvc repro` end to end on the loopback deployment (tests/flower_harness.py standing in for the SuperLink)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fedccrl_pipeline.cli import main

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# the environment variable that tells loopback_site/sitecustomize.py which data the loopback sites hold
LOOPBACK_DATA = "FEDCCRL_TEST_LOOPBACK_DATA"


def _init(folder: Path, *args) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["deploy", "init", str(folder), *map(str, args)])
    return res.exit_code, res.output


def test_init_makes_a_project_of_its_own_from_the_package(tmp_path):
    """dvc.yaml, params.yaml (the research settings, with --set applied, and the deploy group), .gitignore, test/ and
    DVC's folder with the curves' template; a non-empty folder or a bad key is refused, and nothing is left."""
    from fedccrl_pipeline.deploy_params import load_deploy
    from fedccrl_pipeline.params import load_config

    op = tmp_path / "operator"
    code, out = _init(op, "--set", "train.rounds=1", "--set", "deploy.held_out=[art]")
    assert code == 0, out
    assert load_config(op / "params.yaml", downloads=False).train.rounds == 1
    deploy = load_deploy(op / "params.yaml")
    assert deploy.held_out == ["art"] and deploy.test_shards is None
    stages = yaml.safe_load((op / "dvc.yaml").read_text())["stages"]
    plot = stages["report"]["plots"][0]["results/curves.csv"]["template"]
    assert (op / plot).read_text() == (REPO / ".dvc" / "plots" / "series.json").read_text()
    assert (op / ".gitignore").is_file() and (op / "test").is_dir() and (op / ".dvc" / "config").is_file()
    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list"], cwd=op, capture_output=True, text=True)
    assert listed.returncode == 0 and "export@fedccrl-0-art" in listed.stdout, listed.stderr

    code, out = _init(op)
    assert code == 2 and "exists and is not an empty folder" in out, out
    code, out = _init(tmp_path / "other", "--set", "deploy.seedz=[1]")
    assert code == 2 and "no key 'deploy.seedz'" in out, out
    code, out = _init(tmp_path / "other", "--params", op / "params.yaml")
    assert code == 2 and "already has a deploy group" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["operator"]


def _federation_file(data: Path, folder: Path) -> None:
    manifest = json.loads((data / "shards" / "manifest.json").read_text())
    fields = ("dataset", "domains", "classes", "image_size", "resize_policy")
    sites = [{"id": c["id"], "domain": c["domain"]} for c in manifest["clients"]]
    (folder / "federation.json").write_text(json.dumps({**{k: manifest[k] for k in fields}, "sites": sites}))


@pytest.mark.full("dvc repro of six stages, each a fresh fedccrl process: 67 s measured on 2 cores")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_test_folder", [False, True], ids=["sites-only", "test-folder"])
def test_the_operators_project_runs_dvc_repro_end_to_end(data, tmp_path, with_test_folder):
    """A project made by `fedccrl deploy init` in a temp folder (no path of the checkout in it) runs `dvc repro`:
    federate and evaluate_sites over the loopback deployment, then evaluate, report, figures and export; without a
    test folder the export's parity check runs on generated images, with one on the held-out images."""
    op = tmp_path / "operator"
    sets = ["train.rounds=1", "train.local_epochs=1", "train.device=cpu", "deploy.algorithms=[fedavg]"]
    sets += ["figures.tsne_points=12", "figures.gradcam_images=2"]
    if with_test_folder:
        sets.append("deploy.test_shards=test/shards")
    code, out = _init(op, *[a for s in sets for a in ("--set", s)])
    assert code == 0, out
    _federation_file(data, op)
    if with_test_folder:
        (op / "test" / "shards").symlink_to(data / "shards")
    env = {
        **os.environ,
        LOOPBACK_DATA: str(data),
        "PYTHONPATH": os.pathsep.join([str(TESTS / "loopback_site"), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    done = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=op, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = op / "exports" / "fedavg" / "s0" / "dsketch"
    parity = json.loads((run / "parity.json").read_text())
    assert parity["inputs"] == ("held-out images" if with_test_folder else "generated images"), parity
    assert ("onnx_accuracy" in parity) == with_test_folder and parity["top1_agreement"] >= 0.999
    result = json.loads((op / "results" / "runs" / "fedavg" / "s0" / "dsketch.json").read_text())
    assert ("confusion" in result["detail"]["final"]) == with_test_folder
    assert "| fedavg |" in (op / "results" / "table.md").read_text()
    assert (op / "results" / "sites" / "fedavg" / "s0" / "dsketch" / "sites.json").is_file()
    assert (op / "plots" / "curves_sketch.png").is_file() and (op / "dvc.lock").is_file()
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=op, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout  # nothing the stages read changed under them


def test_the_repositorys_dvc_sees_its_own_stages_only():
    """The template's dvc.yaml sits inside the checkout (package data): the root's DVC must not read it as one of
    its pipelines (.dvcignore), or `dvc repro` at the root fails parsing its `${deploy.*}` matrix."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:  # every dvc.yaml DVC collects, resolved as `dvc repro` resolves them
        stages = {s.addressing.split("@")[0] for s in repo.index.stages}
    assert {"download", "partition", "pools", "train", "export"} <= stages
    assert not stages & {"federate", "evaluate_sites"}, stages
