"""docs/privacy.md's "What a site returns for evaluation": how many images each held-out domain is scored on, every
row of its clients (the papers' protocol, without DP) or, under train.privacy, their val rows only (images no run of
the study trains on: fedccrl_core/data/shards.py held_out_parts), and the width of the 95 % Wilson interval of an
accuracy of 50 % over each (fedccrl_core/outcomes/intervals.py): what the smaller test set costs. From the shards
alone; no training, no randomness. tests/test_sweep_epsilon.py reruns it against the docs.
Usage:  python scripts/held_out_rows.py SHARDS
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.data.shards import load_domain_test
from fedccrl_core.outcomes.intervals import wilson_interval


def _half_width(n: int) -> float:
    """Half the width, in accuracy points, of the 95 % interval of 50 % correct out of n."""
    low, high = wilson_interval(n // 2, n)
    return 100 * (high - low) / 2


def table(shards: Path) -> str:
    out = [
        "| held-out domain | images without DP | under train.privacy (val rows) | ± at 50 %, without DP | ± at 50 %, DP |",
        "|---|---:|---:|---:|---:|",
    ]
    for domain in load_manifest(shards).domains:
        n_all = len(load_domain_test(shards, domain)[1])
        n_val = len(load_domain_test(shards, domain, private=True)[1])
        out.append(f"| {domain} | {n_all} | {n_val} | {_half_width(n_all):.1f} | {_half_width(n_val):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shards", type=Path)
    print(table(ap.parse_args(argv).shards))


if __name__ == "__main__":
    main()
