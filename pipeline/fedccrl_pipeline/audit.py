"""`fedccrl audit`: does the statistics upload the engine actually sends keep the DP claim? A one-run canary audit
(Steinke, Nasr, Jagielski, NeurIPS 2023; fedccrl_core/privacy/canary_audit.py) of what the in-process engine
uploaded (fedccrl_core/federation/capture.py `capture_statistics`).

Reads params.yaml (the whole file, before any data), the shards and the pools. The audited federation is `--copies`
copies of the clients (their sizes, so Eq. 8's k_i and the accountant's events stay the run's); each holds C canary
slots, rows outside the clipping box, and fillers (canary_audit.py `make_canaries`); a fair coin per slot picks
which of its two rows it holds. The engine's own uploads phase (InProcessTransport.collect_uploads: FedCCRL's
`client_upload`, Eq. 8, with train.privacy's clip and noise when on) runs train.rounds rounds at train.seeds[0],
and what it uploaded is captured and accounted by the round loop's ledger. The auditor sees only those uploads,
guesses the coin of the r slots it scores highest, and counts its correct guesses. It writes
  --out    results/audit.json  slots, guesses, correct, precision with its Clopper-Pearson interval, the precision
                               (eps, delta)-DP allows (e^eps / (1 + e^eps)), the p-value at the statistics channel's
                               eps, the eps lower bound the guesses support, the reach, `violated`, `testable`
  --table  results/audit.md    the same as a table
  --plot   results/audit.png   the guesses' scores by coin
(the table and the plot: audit_report.py).
`--mlflow-run ID` also logs them to that MLflow run. With train.privacy on, an eps lower bound above the statistics
channel's eps is a failure of the DP claim: the outputs are written, the failure is printed, and the command exits
with status 1. A claim beyond the reach (r correct of r would not refute it) is warned about: it was not tested.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import click

from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.privacy.canary_audit import COPIES, CanaryAudit
from fedccrl_pipeline.audit_report import plot, table
from fedccrl_pipeline.stage_runtime import run_stage


def load_audit_clients(shards: Path, pools: Path):
    """Every client's statistics (the pools) and domain (the shards' manifest), for the membership measurement of
    fedccrl_core/privacy/audit.py `audit` (scripts/privacy_audit.py)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.privacy.audit import Client

    manifest = load_manifest(shards)
    out = []
    for entry in manifest.clients:
        mu, sigma = load_pool(pools, entry.id)
        out.append(Client(entry.id, entry.domain, mu, sigma, manifest.image_size**2))
    return out


def engine_audit(
    cfg, shards: Path, pools: Path, seed: int | None = None, privacy=None, copies: int = COPIES
) -> CanaryAudit:
    """The canary audit of the statistics the in-process engine uploads (the module's docstring), at `seed`
    (default train.seeds[0]: the coins and, without DP, Eq. 8's draws), `privacy` (default train.privacy) and
    `copies` copies of the clients."""
    from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams
    from fedccrl_core.algorithms.fedccrl import FedCCRL
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.federation.driver import load_clients
    from fedccrl_core.federation.round_privacy import privacy_of

    if copies < 1:
        raise ValueError(f"audit: --copies must be >= 1, got {copies}")
    hp = FedCCRL.validated(cfg.train.fedccrl)  # FedCCRL's variant read (its upload rounding)
    assert isinstance(hp, FedCCRLParams)
    seed = cfg.train.seeds[0] if seed is None else seed
    s = cfg.train.privacy if privacy is None else privacy
    alg = FedCCRL(cfg.local.model_copy(update={"privacy": s if s.enabled else None}), hp)
    privacy_of(alg)  # a setting the round loop refuses is refused here too, before any data is read
    clients = load_clients(shards, pools, list(load_manifest(shards).domains), "cpu")
    return audit_clients(alg, clients, seed, cfg.train.rounds, copies)


def audit_clients(alg, clients: list, seed: int, rounds: int, copies: int = COPIES) -> CanaryAudit:
    """The canary audit of `rounds` rounds of FedCCRL `alg`'s uploads over `copies` copies of `clients` (ClientData:
    their sizes and image size; their statistics are replaced by the canaries)."""
    import numpy as np

    from fedccrl_core.federation.capture import capture_statistics
    from fedccrl_core.foundation.seeding import numpy_rng
    from fedccrl_core.privacy import canary_audit as CA
    from fedccrl_core.privacy.settings import PrivacySettings

    s = alg.local.privacy or PrivacySettings()
    audited = [dataclasses.replace(c, client_id=f"{c.client_id}.copy{k}") for k in range(copies) for c in clients]
    channels = clients[0].stats_mu.shape[1]
    sizes = {c.client_id: c.n_train for c in audited}
    canaries = CA.make_canaries(sizes, channels, s, numpy_rng(seed, "audit-canaries"))
    placed = []
    for c in audited:
        held = canaries.rows_of(c.client_id)
        placed.append(dataclasses.replace(c, stats_mu=held[:, :channels], stats_sigma=held[:, channels:]))
    plan = {cid: (n, alg.released_rows(n)) for cid, n in sizes.items()}
    r = CA.planned_guesses(plan, dict.fromkeys(sizes, channels), rounds)
    cap = capture_statistics(alg, placed, seed, rounds)
    released: dict[str, list] = {}
    for rnd in sorted(cap.per_round):
        for cid, u in cap.per_round[rnd].items():
            released.setdefault(cid, []).append(np.concatenate([u["mu"], u["sigma"]], axis=1).astype(np.float64))
    attack = CA.attack_of(s)
    scores = CA.canary_scores(canaries, released, attack)
    found = CA.one_run_audit(canaries.coin, scores, r, cap.epsilon, s.delta)
    return CanaryAudit(
        **dataclasses.asdict(found),
        rounds=rounds,
        attack=attack,
        copies=copies,
        clients=len(clients),
        slots_per_client=channels,
        r=alg.hp.r,
        upload=alg.hp.upload,
        seed=seed,
        guess_share=CA.GUESS_SHARE,
        noise=s.noise_source() if s.enabled else "off",
        privacy=s.model_dump() if s.enabled else None,
        scores=[float(x) for x in scores],
        coins=[bool(x) for x in canaries.coin],
    )


def run_audit(
    shards: Path,
    pools: Path,
    out: Path,
    table_out: Path,
    plot_out: Path,
    params_path: Path,
    mlflow_run: str | None = None,
    copies: int = COPIES,
) -> CanaryAudit:
    from fedccrl_pipeline.params import load_config

    cfg = load_config(params_path)  # the whole file, before any data is read
    result = engine_audit(cfg, shards, pools, copies=copies)
    lines = table(result)
    write_text(out, json.dumps(dataclasses.asdict(result), indent=1))
    write_text(table_out, "\n".join(lines) + "\n")
    plot(result, plot_out)
    print("\n".join(lines), file=sys.stderr)
    if mlflow_run:
        from fedccrl_pipeline.tracking import mlflow_module

        client = mlflow_module().MlflowClient()
        client.set_tag(mlflow_run, "audit.noise", result.noise)
        for k, v in dataclasses.asdict(result).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                client.log_metric(mlflow_run, f"audit/{k}", float(v))
        client.log_metric(mlflow_run, "audit/violated", float(result.violated))
        client.log_metric(mlflow_run, "audit/testable", float(result.testable))
        for f in (out, table_out, plot_out):
            client.log_artifact(mlflow_run, str(f), artifact_path="audit")
    if result.violated:
        click.echo(
            f"error: the canary audit's guesses refute epsilon {result.epsilon_lower_bound:.3f} > the claimed "
            f"{result.epsilon_statistics:.3f} (p-value {result.p_value:.3g}): the DP claim fails (see {table_out})",
            err=True,
        )
        sys.exit(1)
    if result.privacy is not None and not result.testable:
        click.echo(
            f"warning: the claimed epsilon {result.epsilon_statistics:.3f} is beyond this audit's reach "
            f"({result.epsilon_reach:.3f} with every guess correct): it tests nothing; raise --copies",
            err=True,
        )
    return result


@click.command("audit")
@click.option("--shards", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--pools", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/audit.json"), show_default=True)
@click.option(
    "--table", "table_out", type=click.Path(path_type=Path), default=Path("results/audit.md"), show_default=True
)
@click.option(
    "--plot", "plot_out", type=click.Path(path_type=Path), default=Path("results/audit.png"), show_default=True
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--mlflow-run", default=None, help="an MLflow run id to log the audit to")
@click.option(
    "--copies",
    type=click.IntRange(min=1),
    default=COPIES,
    show_default=True,
    help="copies of the clients that hold canaries: more raise the epsilon the audit can refute",
)
def command(shards, pools, out, table_out, plot_out, params_path, mlflow_run, copies):
    """One-run canary audit of the statistics the engine uploads: exits 1 when they beat the DP claim."""
    run_stage(run_audit, shards, pools, out, table_out, plot_out, params_path, mlflow_run, copies)
