"""docs/privacy.md's "A sweep's epsilon per image": the planned epsilon of one training image of each domain over a
whole sweep (every run of train.held_out x train.algorithms x train.seeds that trains on the image's domain,
composed: fedccrl_core/privacy/sweep_epsilon.py), beside the epsilon one run reports, and the worked example of one
image of the first domain. From params.yaml (with `-S key=value` overrides, as `dvc exp run -S`) and the shards'
manifest (the clients' sizes); no training, no randomness. tests/test_sweep_epsilon.py reruns it against the docs.
Usage:  python scripts/sweep_epsilon.py SHARDS [--params params.yaml] [-S train.privacy.enabled=true ...] [--no-example]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.privacy.sweep_epsilon import per_image_epsilon
from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import parse_yaml, read_yaml, set_key
from fedccrl_pipeline.sweep_privacy import manifest_plan, planned_sweep


def table(shards: Path, params: Path, overrides: list[str], example: bool = True) -> str:
    data = read_yaml(params)
    for item in overrides:
        key, _, value = item.partition("=")
        set_key(data, key, parse_yaml(value))
    cfg = validate_params(data)
    s, t = cfg.train.privacy, cfg.train
    if not s.enabled:
        sys.exit("error: train.privacy.enabled is false: no epsilon (add -S train.privacy.enabled=true)")
    manifest = load_manifest(shards)
    runs = planned_sweep(cfg, manifest_plan(cfg, manifest), t.algorithms[0], t.seeds[0], [])
    sweep = per_image_epsilon(runs, s.delta)
    out = [
        f"{len(runs)} runs: held-out {', '.join(map(str, t.held_out))} x {', '.join(t.algorithms)} x seeds "
        f"{', '.join(map(str, t.seeds))}; {t.rounds} rounds each; delta {s.delta:g}, z_s {s.stats_noise_multiplier:g}, "
        f"z {s.weights_noise_multiplier:g}, client_fraction {t.client_fraction:g}",
        "",
        "| domain | runs that train on its images | largest epsilon one run reports | epsilon per image over the sweep |",
        "|---|---:|---:|---:|",
    ]
    for d, e in sweep.items():
        mine = [r for r in runs if d in r.trained_domains]
        one = max(per_image_epsilon([r], s.delta)[d] for r in mine)
        out.append(f"| {d} | {len(mine)} of {len(runs)} | {one:.2f} | {e:.2f} |")
    if not example:
        return "\n".join(out)
    d = next(iter(sweep))
    out += ["", f"One image of {d}, run by run (the epsilon of the runs so far, composed):", ""]
    so_far = []
    for r in runs:
        if d not in r.trained_domains:
            out.append(f"- {r.label}: {d} is held out, the image is not trained on")
            continue
        so_far.append(r)
        kinds = sorted({(c, p, k, z) for c, p, k, z in r.releases})
        events = "; ".join(
            f"{sum(x == kind for x in r.releases)} x {c} ({k} of {p}, noise multiplier {z:g})"
            for kind in kinds
            for c, p, k, z in [kind]
        )
        out.append(
            f"- {r.label}: {events}; this run {per_image_epsilon([r], s.delta)[d]:.2f}, "
            f"composed {per_image_epsilon(so_far, s.delta)[d]:.2f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shards", type=Path)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-example", dest="example", action="store_false", help="the table only")
    args = ap.parse_args(argv)
    print(table(args.shards, args.params, args.overrides, args.example))


if __name__ == "__main__":
    main()
