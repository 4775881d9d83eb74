"""Every registered algorithm through the user's own paths:

- its params.yaml group validates as a run of that algorithm alone (pipeline/fedccrl_pipeline/params.py, as every stage does);
- DVC runs it through the whole pipeline: `dvc repro` in one scratch clone with every algorithm, one tiny round
  each, and the run's files land where evaluate, export and figures look for them (fedccrl_core/foundation/contract.py);
  `dvc exp run --temp` with one algorithm alone runs the same pipeline in DVC's temporary copy;
- the Flower loopback engine equals the in-process engine bit for bit: tests/test_flower.py
  test_loopback_every_algorithm_matches_inprocess_engine, parametrized over the same registry (CCST and FedADG
  are in the full tier: style transfer and an adversarial generator take 20-45 s per engine on the CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedccrl_core.algorithms import ALGORITHMS
from fedccrl_core.foundation import contract

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HELD_OUT = 3  # sketch, by index: one held-out domain keeps each run to three source domains
TINY = {"rounds": 1, "local_epochs": 1, "seeds": [0], "held_out": [HELD_OUT]}
NO_DOWNLOAD = {"ccst": {"adain_weights": "random"}}  # seeded random AdaIN networks (tests only)
FEW_FIGURE_POINTS = {"tsne_points": 40, "gradcam_images": 2, "preview_images": 2}  # every figure, fewer images


def tiny_params(algorithms: list[str]) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"].update(TINY, algorithms=algorithms)
    params["figures"].update(FEW_FIGURE_POINTS)
    for name, over in NO_DOWNLOAD.items():
        params["train"][name] = {**(params["train"].get(name) or {}), **over}
    return params


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_params_group_validates_for_a_run_of_the_algorithm_alone(name, tmp_path):
    from fedccrl_pipeline.params import load_config

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params([name]), sort_keys=False))
    cfg = load_config(path)
    assert cfg.train.algorithms == [name]
    assert getattr(cfg.train, name).model_dump() == {
        **ALGORITHMS[name].Params().model_dump(),
        **NO_DOWNLOAD.get(name, {}),
    }


def _dvc() -> str:
    dvc = shutil.which("dvc", path=str(BIN)) or shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not installed")
    return dvc


def _env(repo: Path) -> dict:
    """One MLflow store per clone (created once: a new SQLite store costs ~10 s of migrations per process)."""
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
        "FEDCCRL_MLFLOW_ARTIFACTS": str(repo / "mlruns"),
    }


def _clone(dest: Path, algorithms: list[str]) -> Path:
    """A user's clone: the repository with this working tree's dvc.yaml and params.yaml (committed or not)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    shutil.copy(ROOT / "dvc.yaml", dest / "dvc.yaml")
    (dest / "params.yaml").write_text(yaml.safe_dump(tiny_params(algorithms), sort_keys=False))
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "tiny"], cwd=dest, check=False
    )
    return dest


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(args)}: {r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """One scratch clone with every algorithm in train.algorithms, through the whole pipeline once: `dvc repro`
    (data, one tiny round of each algorithm, evaluate, export, report, figures)."""
    repo = _clone(tmp_path_factory.mktemp("every-algorithm") / "repo", sorted(ALGORITHMS))
    _run([_dvc(), "repro"], repo, timeout=2400)
    return repo


def _assert_one_round_trained(models: Path, name: str) -> None:
    run = contract.run_dir(models, name, 0, HELD_OUT)
    for f in (contract.MODEL_FILE, contract.BEST_FILE, contract.HISTORY_FILE, contract.HISTORY_CSV):
        assert (run / f).is_file(), f"{run / f} missing"
    doc = json.loads((run / contract.HISTORY_FILE).read_text())
    assert doc["meta"]["algorithm"] == name and doc["meta"]["held_out_domain"] == "sketch"
    (rec,) = doc["rounds"]  # exactly the one round asked for
    assert rec[contract.ROUND] == 1 and 0 <= rec[contract.TARGET_ACC] <= 1 and rec[contract.BYTES_UP] > 0


FULL = "every algorithm through DVC in a scratch clone (in-process: test_embedded_round.py, test_round_loop.py)"


@pytest.mark.full(FULL)
@pytest.mark.timeout(2700)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_dvc_runs_the_whole_pipeline_for_every_algorithm(name, clone):
    """Trained (one round), evaluated, exported with its parity check, in the table and the metrics."""
    _assert_one_round_trained(clone / "models", name)
    metrics = json.loads((clone / "results" / "metrics.json").read_text())
    assert 0 <= metrics[name]["sketch"]["final_target_acc"]["mean"] <= 1
    assert any((clone / "exports" / name).rglob("*.onnx")), f"no ONNX export of {name}"
    assert f"| {name} |" in (clone / "results" / "table.md").read_text()


@pytest.mark.full(FULL)
@pytest.mark.timeout(1500)
def test_dvc_exp_run_temp_with_one_algorithm_alone(tmp_path):
    """`dvc exp run --temp -S 'train.algorithms=[<alg>]' ...` in a fresh clone runs the whole pipeline (data, one
    round, evaluate, export, report, figures) in DVC's temporary copy of the repository (docs/mlflow.md: every
    form of `dvc exp run` logs to the one store), for that algorithm alone."""
    repo = _clone(tmp_path / "repo", ["fedavg"])
    _run(
        [
            _dvc(),
            "exp",
            "run",
            "--temp",
            "-S",
            "train.algorithms=[fedccrl]",
            "-S",
            "train.rounds=1",
            "-S",
            f"train.held_out=[{HELD_OUT}]",
        ],
        repo,
        timeout=1200,
    )
    shown = json.loads(_run([_dvc(), "exp", "show", "--json"], repo).stdout)
    (rev,) = [r for top in shown for e in top.get("experiments") or [] for r in e.get("revs", [])]  # the one experiment
    summary = rev["data"]["metrics"]["results/summary.json"]["data"]  # the report stage's metrics, recorded by DVC
    assert set(summary) == {"fedccrl"} and 0 <= summary["fedccrl"]["sketch"] <= 1, summary
    assert rev["data"]["params"]["params.yaml"]["data"]["train"]["algorithms"] == ["fedccrl"]
