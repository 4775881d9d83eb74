"""`fedccrl deploy init DIR`: the operator's DVC project of a Flower deployment, made from the installed package.

    fedccrl deploy init DIR [--params research-params.yaml] [--set KEY=VALUE ...]

writes DIR/dvc.yaml (the operator's pipeline: federate, evaluate_sites, evaluate, report, figures, export),
DIR/params.yaml (the training settings, from --params or the package's defaults, with the deploy group after them;
--set changes a key of either as `dvc exp run -S` does), DIR/.gitignore, DIR/test/ (where the operator's test
folder goes, deploy.test_shards) and DVC's own folder (`dvc init`, `--subdir` inside a git work tree, else
`--no-scm`) with the curves' plot template. The templates are this package's data (project/): the repository keeps
no copy of them. DIR must not exist, or be empty; it is written in a sibling temp folder and renamed into place,
so it is whole or absent (fsio.atomic_dir).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import click

from fedccrl_pipeline.stage_runtime import run_stage

TEMPLATE = files("fedccrl_pipeline") / "project"  # package data (pyproject.toml)
# template file -> where it goes in the operator's project
COPIED = {"dvc.yaml": "dvc.yaml", "gitignore": ".gitignore", "series.json": ".dvc/plots/series.json"}
TEST_README = "the operator's test folder of the held-out domain(s) goes here: deploy.test_shards in params.yaml\n"


def project_params(research: Path | None, sets: tuple[str, ...]) -> str:
    """The operator's params.yaml: the training settings (`research`, else the package's defaults), comments kept,
    then the deploy group; each KEY=VALUE of `sets` applied as `dvc exp run -S` applies it (a YAML value, to a key
    that exists); the result validated whole. ParamError naming the file and key otherwise."""
    import io

    from ruamel.yaml import YAML

    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_core.foundation.hparams import validate
    from fedccrl_pipeline.deploy_params import DeployFile
    from fedccrl_pipeline.params import validate_params
    from fedccrl_pipeline.params_yaml import parse_yaml, read_yaml, set_key

    source = research if research is not None else Path(str(TEMPLATE / "params.yaml"))
    read_yaml(source)  # a clear error naming a missing or broken file
    if "deploy" in parse_yaml(source.read_text()):
        raise ParamError(f"{source}: already has a deploy group (an operator's params.yaml?): give the research one")
    rt = YAML()  # round trip: the comments stay
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    doc = rt.load(source.read_text() + "\n" + (TEMPLATE / "deploy.yaml").read_text())
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ParamError(f"--set {item!r}: KEY=VALUE")
        set_key(doc, key, parse_yaml(value))
    out = io.StringIO()
    rt.dump(doc, out)
    text = out.getvalue()
    data = parse_yaml(text)
    validate_params(data, downloads=False)  # a deployment downloads nothing: dataset.source does not apply
    validate(DeployFile, {"deploy": data["deploy"]}, file="params.yaml")
    return text


def _dvc_init(folder: Path) -> None:
    """`dvc init` in `folder`: a subproject of the git work tree it lies in, else a project without git."""
    git = shutil.which("git")
    in_git = (
        git is not None and subprocess.run([git, "-C", str(folder), "rev-parse"], capture_output=True).returncode == 0
    )
    how = "--subdir" if in_git else "--no-scm"
    done = subprocess.run([sys.executable, "-m", "dvc", "init", "-q", how], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dvc init {how} in {folder} failed: {done.stderr.strip()}")


def init(folder: Path, research: Path | None, sets: tuple[str, ...]) -> None:
    """The operator's project in `folder` (this module's docstring); whole or absent."""
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_core.foundation.fsio import atomic_dir

    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise DataError(f"{folder}: exists and is not an empty folder (the project is made in a new one)")
    params = project_params(research, sets)  # every input checked before anything is written
    with atomic_dir(folder) as tmp:  # renamed into place when whole, removed on a failure
        _dvc_init(tmp)
        for name, dest in COPIED.items():
            (tmp / dest).parent.mkdir(parents=True, exist_ok=True)
            (tmp / dest).write_text((TEMPLATE / name).read_text())
        (tmp / "params.yaml").write_text(params)
        (tmp / "test").mkdir()
        (tmp / "test" / "README.txt").write_text(TEST_README)
    click.echo(f"deploy init: {folder}: dvc.yaml, params.yaml (edit its deploy group), .gitignore, test/", err=True)


@click.group("deploy")
def command() -> None:
    """The operator's project of a Flower deployment (docs/flower.md)."""


@command.command("init")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--params",
    "research",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="the training settings to start from (a research params.yaml) [default: the package's]",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="set a key of params.yaml (as dvc exp run -S)")
def init_command(folder: Path, research: Path | None, sets: tuple[str, ...]) -> None:
    """Make the operator's DVC project in FOLDER (new or empty), from the installed package."""
    run_stage(init, folder, research, sets)
