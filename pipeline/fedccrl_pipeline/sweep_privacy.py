"""A sweep's epsilon per image (fedccrl_core/privacy/sweep_epsilon.py) where the pipeline needs it: the plan of the
whole sweep checked against train.privacy.max_sweep_epsilon before `fedccrl train` reads a shard or opens an MLflow
run, and the value over the runs finished so far, logged to the sweep's parent run each time a child finishes.

The sweep is dvc.yaml's matrix: every (algorithm, seed) of train.algorithms x train.seeds trains every domain of
train.held_out, all on the same clients (plus the --algorithm, --seed, --held-out of the stage, when they lie
outside it). A finished child run carries what its ledger charged (history.json `dp`, contract.HISTORY_PRIVACY)
as two tags, so any train process of the sweep can compose them from the store."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import ParamError

if TYPE_CHECKING:
    from fedccrl_core.data.manifest import ShardManifest
    from fedccrl_core.federation.history import RunPrivacySummary
    from fedccrl_core.privacy.sweep_epsilon import SweepRun
    from fedccrl_flower.sites import FederationFile
    from fedccrl_pipeline.deploy_params import DeployParams
    from fedccrl_pipeline.params import ParamsFile

KEY = "train.privacy.max_sweep_epsilon"
RELEASES_TAG = "fedccrl.dp_releases"  # a finished child: the releases its ledger charged (encode_releases)
DOMAINS_TAG = "fedccrl.dp_trained_domains"  # a finished child: the domains whose training images it trained on
PRIVACY_TAG = "fedccrl.privacy"  # a seeded run and its parent: settings.py NOT_PRIVATE_MARK
SWEEP_EPSILON = contract.DP_EPSILON_SWEEP  # the parent: the worst domain's; /<domain> each domain's
SWEEP_PLANNED = "dp_epsilon_sweep_planned"  # the parent: the same over the plan (every run, every round)
SWEEP_RUNS = contract.DP_SWEEP_RUNS  # the parent: how many finished runs the value composes


@dataclass(frozen=True)
class SweepPlan:
    """The runs of a sweep: every (algorithm, seed) trains every held-out domain, all on the same images.
    `sizes(target)`: {client: n_i} of the clients that train when `target` is held out, n_i None where this
    machine cannot know it (a deployment's site: planned as if every row were released, the worst case)."""

    domains: list[str]
    algorithms: list[str]
    seeds: list[int]
    held_out: list[str]  # domain names
    sizes: Callable[[str], dict[str, int | None]]


def manifest_plan(cfg: ParamsFile, manifest: ShardManifest) -> SweepPlan:
    """The train stage's sweep (dvc.yaml's matrix: train.algorithms x train.seeds x train.held_out) on the central
    partition, with the sizes the clients will announce (the manifest's)."""
    from fedccrl_core.data.manifest import client_ids
    from fedccrl_pipeline.cross_checks import resolve_held_out

    t = cfg.train
    domains = list(manifest.domains)
    held_out, _ = resolve_held_out(domains, list(t.held_out), f"the shards ({manifest.dataset})")
    clients = {c.id: c for c in manifest.clients}

    def sizes(target: str) -> dict[str, int | None]:
        counts = {
            cid: clients[cid].train_domain_counts or {clients[cid].domain: clients[cid].n_train}
            for cid in client_ids(manifest, target)
        }
        return {cid: sum(v for d, v in c.items() if d != target) for cid, c in counts.items()}

    return SweepPlan(domains, list(t.algorithms), list(t.seeds), held_out, sizes)


def federation_plan(cfg: ParamsFile, fed_file: FederationFile, deploy: DeployParams | None) -> SweepPlan:
    """A deployment's sweep (an operator's deploy.algorithms x seeds x held_out, else train.*'s) over the
    federation file's source sites, whose sizes the operator does not know."""
    t = cfg.train
    algorithms, seeds = (deploy.algorithms, deploy.seeds) if deploy else (t.algorithms, t.seeds)
    entries = deploy.held_out if deploy else t.held_out
    held_out = []
    for entry in entries:  # the research params' train.held_out may name domains this federation lacks
        try:
            held_out.append(fed_file.held_out(entry))
        except ValueError:
            continue
    return SweepPlan(
        list(fed_file.domains),
        list(algorithms),
        list(seeds),
        held_out,
        lambda target: dict.fromkeys(fed_file.sources(target)),
    )


def planned_sweep(cfg: ParamsFile, plan: SweepPlan, algorithm: str, seed: int, targets: list[str]):
    """Every run of the sweep (module docstring) as a SweepRun whose releases are those it charges when it trains
    every round (sweep_epsilon.py planned_releases)."""
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.algorithms.fedccrl import StatisticsExchange
    from fedccrl_core.federation.sampling import sampled_count
    from fedccrl_core.privacy.sweep_epsilon import SweepRun, planned_releases

    t, s = cfg.train, cfg.train.privacy
    runs = []
    for name in dict.fromkeys([*plan.algorithms, algorithm]):
        alg = build_algorithm(name, cfg.local, getattr(t, name))
        uploads = getattr(alg.Params, "uploads_statistics", False)
        assert not uploads or isinstance(alg, StatisticsExchange)  # the algorithms whose uploads are statistics
        for target in dict.fromkeys([*plan.held_out, *targets]):
            sizes = {}
            for cid, n in plan.sizes(target).items():
                if n is None:  # unknown: one row of one, every row released (RoundLoop.planned_round's worst case)
                    sizes[cid] = (1, 1)
                else:
                    sizes[cid] = (n, alg.released_rows(n) if isinstance(alg, StatisticsExchange) else n)
            releases = planned_releases(
                s, uploads, sizes, len(sizes), sampled_count(len(sizes), t.client_fraction), cfg.local.rounds
            )
            sources = tuple(d for d in plan.domains if d != target)
            for sd in dict.fromkeys([*plan.seeds, seed]):
                runs.append(SweepRun(f"{name} s{sd} held-out {target}", sources, tuple(releases)))
    return runs


def check_sweep_budget(
    cfg: ParamsFile, plan: SweepPlan, algorithm: str, seed: int, targets: list[str]
) -> dict[str, float] | None:
    """The sweep's planned epsilon per image, {domain: epsilon} (None without DP, or with a seeded noise, where
    epsilon does not apply). ParamError naming train.privacy.max_sweep_epsilon when it is set and a domain's
    planned epsilon exceeds it: before the stage reads a shard or opens an MLflow run."""
    s = cfg.train.privacy
    if not s.enabled or s.seeded:
        return None
    from fedccrl_core.privacy.sweep_epsilon import per_image_epsilon

    runs = planned_sweep(cfg, plan, algorithm, seed, targets)
    eps = per_image_epsilon(runs, s.delta)
    if s.max_sweep_epsilon:
        over = {d: e for d, e in eps.items() if e > s.max_sweep_epsilon}
        if over:
            worst = max(over, key=lambda d: over[d])
            count = sum(worst in r.trained_domains for r in runs)
            raise ParamError(
                f"params.yaml: key '{KEY}': got {s.max_sweep_epsilon:g}; an image of domain {worst} would reach "
                f"epsilon {over[worst]:.3f} at delta {s.delta:g} over the sweep ({count} of its {len(runs)} runs "
                f"train on it: held-out domains x algorithms x seeds on the same clients; "
                f"{', '.join(f'{d} {e:.3f}' for d, e in over.items())} above it). Raise {KEY}, raise the noise "
                "multipliers, or train fewer runs"
            )
    return eps


def child_tags(p: RunPrivacySummary | None) -> dict[str, str]:
    """The tags a finished child run of a DP sweep carries (from its history.json's `dp`): its releases and trained
    domains, or the not-private mark of a seeded run (whose releases do not count: its epsilon does not apply)."""
    if p is None:
        return {}
    if p.mark:
        return {PRIVACY_TAG: p.mark}
    return {RELEASES_TAG: p.releases, DOMAINS_TAG: json.dumps(p.trained_domains)}


def finished_runs(client, experiment_id: str, sweep_key: str) -> list[SweepRun]:
    """The sweep's finished child runs that carry their releases, as SweepRuns."""
    from fedccrl_core.privacy.sweep_epsilon import SweepRun, decode_releases

    query = f"tags.`fedccrl.sweep` = '{sweep_key}' and tags.`fedccrl.role` = 'child' and attributes.status = 'FINISHED'"
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        for r in page:
            tags = r.data.tags
            if RELEASES_TAG in tags and DOMAINS_TAG in tags:
                where = f"MLflow run {r.info.run_id} tag {RELEASES_TAG}"
                runs.append(
                    SweepRun(
                        r.info.run_name or r.info.run_id,
                        tuple(json.loads(tags[DOMAINS_TAG])),
                        tuple(decode_releases(tags[RELEASES_TAG], where)),
                    )
                )
        token = page.token
        if not token:
            return runs


def epsilon_metrics(name: str, eps: dict[str, float]) -> dict[str, float]:
    """{name: the worst domain's epsilon, name/<domain>: each domain's}."""
    return {name: max(eps.values()), **{f"{name}/{d}": e for d, e in eps.items()}} if eps else {}
