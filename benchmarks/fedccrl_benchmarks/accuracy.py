"""`fedccrl-bench accuracy`: mean held-out accuracy of several algorithms over several seeds, in one
process on the current shards and pools (no DVC, no MLflow), printed as a table; the held-out domains are
params.yaml's `train.held_out`, and each round's accuracies go to stderr as it ends. A benchmark
command, not a test: it reports what it sees."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import click

from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import read_yaml
from fedccrl_pipeline.stage_runtime import run_stage


def apply_overrides(params: dict, overrides: Sequence[str], source: str = "--set") -> dict:
    """`KEY=VALUE` overrides (dotted keys of params.yaml, YAML values), as `dvc exp run -S` spells them. A key
    must already exist: a typo is an error naming it, not a new entry that nothing reads."""
    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_pipeline.params_yaml import parse_yaml, set_key  # YAML 1.2 numbers, as params.yaml is read

    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ParamError(f"{source} {item!r}: expected KEY=VALUE, e.g. train.local_epochs=3")
        try:
            set_key(params, key, parse_yaml(text))
        except ParamError as e:
            raise ParamError(f"{source} {item!r}: {e}") from None
    return params


def bench_accuracy(
    shards: Path,
    pools: Path,
    algorithms: list[str],
    seeds: list[int],
    params_path: Path,
    overrides: Sequence[str] = (),
    variants: list[str] | None = None,
) -> dict:
    from fedccrl_core.algorithm_params.fedccrl import VARIANTS
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_pipeline.cross_checks import resolve_held_out
    from fedccrl_pipeline.training import check_algorithm, run_settings

    params = apply_overrides(read_yaml(params_path), list(overrides))
    bad = [v for v in variants or [] if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants: {bad[0]!r} is not a FedCCRL variant; choose from {', '.join(VARIANTS)}")
    for a in algorithms:
        check_algorithm(a, "--algorithms")
    cfg = validate_params(params, tuple(algorithms))  # every algorithm's params, before any training
    settings = run_settings(cfg)
    rows = _rows(cfg, settings.local, algorithms, variants)
    manifest = load_manifest(shards)
    domains = list(manifest.domains)
    targets, problems = resolve_held_out(domains, list(cfg.train.held_out), f"{shards}/manifest.json")
    if problems:
        raise ValueError("\n".join(problems))
    t0 = time.perf_counter()
    acc = _train_rows(rows, targets, seeds, shards, pools, settings, len(manifest.classes), t0)
    print(
        f"final-round target accuracy (%), mean ± std over seeds {seeds}"
        f"{', ' + ' '.join(overrides) if overrides else ''}, "
        f"{time.perf_counter() - t0:.0f}s in all",
        flush=True,
    )
    print("\n".join(_table(acc, targets)), flush=True)
    return acc


def _train_rows(rows, targets, seeds, shards: Path, pools: Path, settings, num_classes: int, t0: float) -> dict:
    """Each row trained on each held-out domain of `targets` with each seed: {label: {target: [final-round target
    accuracy per seed]}}, each round and run reported on stderr (seconds since `t0`)."""
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.federation.driver import RunData, held_out_run, train
    from fedccrl_core.foundation.fastpath import resolve_device

    acc: dict = {}
    s = settings
    for label, alg_name, hparams in rows:
        device = resolve_device(s.device)
        if device.type == "cpu":  # one torch thread, as every training run (federation/jobs.py): the same numbers
            torch.set_num_threads(1)
        for target in targets:
            data = RunData.load(shards, pools, target, device, s.eval_batch_size)
            for seed in seeds:
                alg = build_algorithm(alg_name, s.local, hparams)

                def progress(rec, label=label, target=target, seed=seed):
                    print(
                        f"bench: {label} {target} seed {seed} round {rec.round}/{s.local.rounds}: "
                        f"target {rec.target_acc:.4f}, source val {rec.val_acc:.4f} "
                        f"({time.perf_counter() - t0:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )

                run = held_out_run(
                    alg,
                    data,
                    s.backbone,
                    num_classes,
                    s.pretrained,
                    seed,
                    device,
                    s.local.rounds,
                    client_fraction=s.client_fraction,
                    concurrent_clients=s.concurrent_clients,
                )
                res = train(run, on_round=progress, log=lambda m: None)
                acc.setdefault(label, {}).setdefault(target, []).append(res.history[-1].target_acc)
                print(
                    f"bench: {label} {target} seed {seed}: {acc[label][target][-1]:.4f} "
                    f"({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    return acc


def _rows(cfg, local, algorithms: list[str], variants: list[str] | None) -> list[tuple]:
    """(label, algorithm, hparams): one per algorithm, one per variant of FedCCRL; each algorithm built once, so that
    a variant's switches are checked before any training."""
    from fedccrl_core.algorithms import build_algorithm

    rows = []
    for a in algorithms:
        for label, override in (
            [(f"fedccrl ({v})", {"variant": v}) for v in variants] if a == "fedccrl" and variants else [(a, {})]
        ):
            params = getattr(cfg.train, a).model_copy(update=override)  # `variant`: one of VARIANTS, checked before
            rows.append((label, a, build_algorithm(a, local, params).hp))
    return rows


def _table(acc: dict, targets: list[str]) -> list[str]:
    """The Markdown table: per algorithm, the final-round target accuracy (%) per held-out domain, mean ± std over
    the seeds, and their average."""
    lines = [f"| Algorithm | {' | '.join(targets)} | Avg. |", "|---" * (len(targets) + 2) + "|"]
    for alg_name, per in acc.items():
        cells = [f"{100 * statistics.fmean(v):.2f} ± {100 * statistics.pstdev(v):.2f}" for v in per.values()]
        avg = statistics.fmean(statistics.fmean(v) for v in per.values())
        lines.append(f"| {alg_name} | {' | '.join(cells)} | {100 * avg:.2f} |")
    return lines


@click.command("accuracy")
@click.option("--shards", type=click.Path(path_type=Path), default=Path("data/shards"), show_default=True)
@click.option("--pools", type=click.Path(path_type=Path), default=Path("data/pools"), show_default=True)
@click.option("--algorithms", default="fedccrl,fedavg,fedprox", show_default=True)
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="override a params.yaml key for this bench only (repeatable), e.g. --set train.local_epochs=3",
)
@click.option("--variants", default="", help="FedCCRL variants, one row each: paper,reference (train.fedccrl.variant)")
def command(shards, pools, algorithms, seeds, params_path, overrides, variants):
    """Held-out accuracy table of several algorithms over several seeds (one process, no tracking)."""
    run_stage(
        bench_accuracy,
        shards,
        pools,
        algorithms.split(","),
        [int(s) for s in seeds.split(",")],
        params_path,
        list(overrides),
        [v for v in variants.split(",") if v] or None,
    )
