"""params.yaml's `train.<algorithm>` groups agree with each algorithm's declared hyperparameters
(`Algorithm.defaults`): every registered algorithm has a group (FedAvg's is empty, so dvc.yaml's
`train.${item.algorithm}` resolves), with exactly the declared keys and the declared default values."""
from pathlib import Path

import pytest
import yaml

from fedccrl_core.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_params_group_matches_declaration(name):
    groups = PARAMS["train"]
    assert name in groups, f"params.yaml has no train.{name} group (DVC runs listing {name} would fail)"
    group = groups[name] or {}
    declared = ALGORITHMS[name].defaults
    assert set(group) == set(declared), f"train.{name}: params.yaml keys {sorted(group)} != declared {sorted(declared)}"
    for key, value in declared.items():
        assert group[key] == value, f"train.{name}.{key}: params.yaml {group[key]!r} != declared default {value!r}"


def test_every_algorithm_resolves_in_dvc(tmp_path):
    """`dvc repro --dry` of one train stage per algorithm, in a scratch clone: no 'Parameters train.<alg> are
    missing' (the README's PACS recipe, the sweeps and `make bench-table1` all list fedavg)."""
    import shutil
    import subprocess
    import sys

    dvc = shutil.which("dvc", path=str(Path(sys.executable).parent)) or shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not installed")
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")  # the working tree's params, committed or not
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["algorithms"] = sorted(ALGORITHMS)
    params["train"]["held_out"] = [0]
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    for d in ("data/shards", "data/pools"):
        (repo / d).mkdir(parents=True)
    for name in sorted(ALGORITHMS):
        r = subprocess.run([dvc, "repro", "--dry", "--single-item", f"train@{name}-0"], cwd=repo,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{name}: {r.stdout[-500:]} {r.stderr[-500:]}"
        assert f"--algorithm {name} " in r.stdout
