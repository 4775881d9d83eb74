"""`fedccrl-bench deploy-round`: a round of a loopback Flower deployment against a round of the in-process engine, on
the same data and settings, side by side in one run, and what a ClientApp process pays before its message.

In a temporary workspace, the pipeline's own stages on a copy of params.yaml (the embedded default unless
`--params`): `fedccrl download`, `partition` and `pools`, then `fedccrl train` of one algorithm on one held-out domain
with `train.engine: inprocess` and with `train.engine: flower` (deployment mode: a SuperLink and one SuperNode per
source client on 127.0.0.1, each ClientApp in the process Flower starts for each message), each with 1 round and with
`--rounds` rounds. A round's time is (wall(R) - wall(1)) / (R - 1), so what each engine pays once (interpreter,
imports, MLflow, the SuperLink and SuperNodes, loading the data) is left out, and the ratio is the deployment's round
over the in-process round. Then the start-up a deployment pays three times per client per round (QUERY, TRAIN,
EVALUATE each run in a fresh ClientApp process: Flower 1.42's `flwr-clientapp` takes one message per process): the
wall time of a fresh interpreter importing fedccrl_flower.client_app against a bare one, median of `--imports` each.
It prints ratios against the baselines measured in this run; it asserts nothing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

REPO = Path(__file__).resolve().parents[2]
STAGES = (  # the pipeline's data stages (dvc.yaml), as a user runs them
    ["download", "--out", "data/raw", "--report", "data/reports/download.json"],
    ["partition", "--raw", "data/raw", "--out", "data/shards"],
    ["pools", "--shards", "data/shards", "--out", "data/pools"],
)
ENGINES = ("inprocess", "flower")  # the baseline first


def _say(msg: str) -> None:
    print(f"[deploy-round] {msg}", file=sys.stderr, flush=True)


def _fedccrl(ws: Path, args: list[str], env: dict) -> float:
    """One `fedccrl` command in the workspace; its wall time (s). Its output goes to stderr; a failure stops the bench."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedccrl_pipeline.cli", *args], cwd=ws, env=env, stdout=sys.stderr)
    if p.returncode:
        raise click.ClickException(f"fedccrl {' '.join(args)} exited {p.returncode} (workspace {ws})")
    return time.perf_counter() - t0


def _params(src: Path, algorithm: str, held_out: str | int, engine: str, rounds: int) -> dict:
    params = yaml.safe_load(src.read_text())
    train = params["train"]
    train.update(algorithms=[algorithm], seeds=[0], held_out=[held_out], engine=engine, rounds=rounds)
    train["flower"].update(mode="deployment", superlink="")
    return params


def _import_seconds(code: str, repeats: int, env: dict) -> float:
    """Median wall time (s) of a fresh interpreter running `code`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _processes_per_round(shards: Path, held_out: str | int) -> int:
    """ClientApp processes a round starts with every client sampled: a QUERY and an EVALUATE to every site, a TRAIN
    to every source client."""
    from fedccrl_core.data.manifest import client_ids, evaluation_sites, load_manifest

    manifest = load_manifest(shards)
    target = manifest.domains[held_out] if isinstance(held_out, int) else held_out
    sources, evaluators = client_ids(manifest, target), evaluation_sites(manifest, target)
    return 2 * (len(sources) + len(evaluators)) + len(sources)


def measure(params: Path, algorithm: str, held_out: str | int, rounds: int, imports: int, work: Path) -> dict:
    if rounds < 2:
        raise click.BadParameter(
            "needs at least 2 (a round's time is the difference of R rounds and 1)", param_hint="--rounds"
        )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}
    (work / "params.yaml").write_text(yaml.safe_dump(_params(params, algorithm, held_out, "inprocess", 1)))
    for stage in STAGES:
        _say(f"fedccrl {stage[0]}")
        _fedccrl(work, stage, env)
    wall: dict[str, dict[int, float]] = {e: {} for e in ENGINES}
    for engine in ENGINES:
        for r in (1, rounds):
            (work / "params.yaml").write_text(yaml.safe_dump(_params(params, algorithm, held_out, engine, r)))
            out = f"models/{engine}-r{r}"
            _say(f"fedccrl train, train.engine {engine}, {r} round(s)")
            wall[engine][r] = _fedccrl(
                work,
                [
                    "train",
                    "--shards",
                    "data/shards",
                    "--pools",
                    "data/pools",
                    "--algorithm",
                    algorithm,
                    "--seed",
                    "0",
                    "--out",
                    out,
                ],
                env,
            )
    per_round = {e: (wall[e][rounds] - wall[e][1]) / (rounds - 1) for e in ENGINES}
    _say(f"ClientApp start-up: {imports} fresh interpreters each")
    bare = _import_seconds("pass", imports, env)
    torch_s = _import_seconds("import torch", imports, env)
    client = _import_seconds("import fedccrl_flower.client_app", imports, env)
    return {
        "algorithm": algorithm,
        "held_out": held_out,
        "rounds": rounds,
        "wall_s": {e: {str(r): round(t, 2) for r, t in wall[e].items()} for e in ENGINES},
        "round_s": {e: round(t, 2) for e, t in per_round.items()},
        "deployment_over_inprocess": round(per_round["flower"] / per_round["inprocess"], 1),
        "processes_per_round": _processes_per_round(work / "data" / "shards", held_out),
        "interpreter_s": round(bare, 3),
        "torch_import_s": round(torch_s, 3),
        "clientapp_import_s": round(client, 3),
        "cores": os.cpu_count(),
    }


def report(res: dict) -> list[str]:
    """The printed table and lines of a `measure` result."""
    r, rounds = res["round_s"], res["rounds"]
    lines = [
        f"algorithm {res['algorithm']}, held-out {res['held_out']}, {rounds} rounds against 1, {res['cores']} cores",
        f"| engine | wall, 1 round (s) | wall, {rounds} rounds (s) | one round (s) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for e in ENGINES:
        w = res["wall_s"][e]
        lines.append(f"| {e} | {w['1']:.1f} | {w[str(rounds)]:.1f} | {r[e]:.2f} | {r[e] / r['inprocess']:.1f}x |")
    n, start = res["processes_per_round"], res["clientapp_import_s"]
    lines.append(
        f"ClientApp start-up: a fresh interpreter importing fedccrl_flower.client_app {start:.2f} s, torch alone "
        f"{res['torch_import_s']:.2f} s, a bare one {res['interpreter_s']:.2f} s"
    )
    lines.append(
        f"a round starts {n} ClientApp processes (a QUERY and an EVALUATE per site, a TRAIN per source client): "
        f"{n * start:.1f} s of start-up = {n * start / r['inprocess']:.1f}x the in-process round"
    )
    return lines


@click.command("deploy-round")
@click.option(
    "--params",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=REPO / "params.yaml",
    show_default=True,
)
@click.option("--algorithm", default="fedccrl", show_default=True)
@click.option("--held-out", default="", help="a domain name or index (default: params' first train.held_out entry)")
@click.option(
    "--rounds", type=int, default=3, show_default=True, help="R: a round's time is (wall(R) - wall(1)) / (R - 1)"
)
@click.option("--imports", type=int, default=5, show_default=True, help="fresh interpreters timed for the start-up")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="also write the figures as JSON")
def command(params: Path, algorithm: str, held_out: str, rounds: int, imports: int, out: Path | None) -> None:
    """A loopback deployment's round against an in-process round, and the ClientApp's start-up."""
    held: str | int = yaml.safe_load(params.read_text())["train"]["held_out"][0] if not held_out else held_out
    held = int(held) if str(held).isdigit() else held  # an index in the registry's domain order, or a name
    with tempfile.TemporaryDirectory(prefix="fedccrl-deploy-round-") as tmp:
        res = measure(params, algorithm, held, rounds, imports, Path(tmp))
    print("\n".join(report(res)))
    if out is not None:
        out.write_text(json.dumps(res, indent=1) + "\n")
