"""`make mutation`: mutmut over the modules that implement the papers' equations, one module at a time, and the
per-module table of docs/contributing.md ("Mutation testing") from mutmut's results.

  python scripts/mutation.py run [MODULE ...]   mutmut run --max-children 1 on each module's scope (all by default),
                                                timed; the times go to mutants/mutation-times.json
  python scripts/mutation.py summary [--survivors]   the table from mutants/**/*.py.meta (mutmut's own results), the
                                                equivalent mutants with their reasons, and every survivor not
                                                explained (exit code 1 when there is one)

The scope (SCOPE) is the list of functions each module's row counts: a module's mutants outside it are neither run
nor counted. The tests each mutant runs are the ones mutmut saw call the mutated function, among the fast tests of
pyproject.toml [tool.mutmut] pytest_add_cli_args_test_selection.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
TIMES = MUTANTS / "mutation-times.json"

# module -> the functions mutated and counted (mutmut's mangled names: x_<function>, xǁ<Class>ǁ<method>); "*" = all
SCOPE: dict[str, tuple[str, ...]] = {
    # Eq. 6-7 (channel_stats) and the normalization every statistic is taken after
    "fedccrl_core.learning.statistics": ("*",),
    # Eq. 2
    "fedccrl_core.learning.aggregation": ("*",),
    # Eq. 9-16
    "fedccrl_core.learning.losses": ("*",),
    # Eq. 6-8: the pools' statistics and the upload (the file I/O of the pools stage is left out)
    "fedccrl_core.data.pools": ("x_compute_statistics", "x_upload_size", "x_sample_statistics", "x_unbiased_sigma"),
    # Alg. 2 and its Beta/Gamma/Dirichlet draws (also Alg. 3's)
    "fedccrl_core.augment.ccdt": ("*",),
    # Alg. 3: the per-sample draws, the op parameters, one chain step's routing and ops, the mixing (lines 4-13)
    "fedccrl_core.augment.augmix": (
        "x_op_magnitude",
        "x_sample_augmix_plan",
        "x__is_any",
        "x__lut_ops",
        "x__posterize_lut",
        "x__solarize_lut",
        "x__geometric_ops",
        "x__apply_family",
        "x__apply_step",
        "x__augmix_with",
        "x_augmix",
    ),
    # FedOMG's server step, Eq. 15-17
    "fedccrl_core.algorithms.fedomg": ("*",),
    # DP clipping and noise
    "fedccrl_core.privacy.dp": ("*",),
    # the RDP accountant
    "fedccrl_core.privacy.accountant": ("*",),
}

# Surviving mutants that change nothing observable, each with its one-line reason (mutmut show NAME prints the diff).
EQUIVALENT: dict[str, str] = {
    "fedccrl_core.learning.aggregation.xǁWeightedSumǁ__init____mutmut_17": "_ref = None at first: result() refuses "
    "a sum of no client (count == 0) before it reads _ref, and add() sets _ref on the first client",
    "fedccrl_core.learning.aggregation.xǁWeightedSumǁadd__mutmut_8": "_ref keeps only each entry's dtype and the keys "
    "of the first state: torch.empty(1) in place of torch.empty(0) carries the same",
    "fedccrl_core.data.pools.x_unbiased_sigma__mutmut_14": "numpy's astype(None) is float64, the dtype it replaces",
    "fedccrl_core.data.pools.x_compute_statistics__mutmut_20": "batches starting at every row overlap and rewrite "
    "each row with the same statistics: slower, the same result",
    "fedccrl_core.data.pools.x_sample_statistics__mutmut_1": "the default rounding's name: any value but 'floor' is "
    "ceil in upload_size",
    "fedccrl_core.data.pools.x_sample_statistics__mutmut_2": "the default rounding's name: any value but 'floor' is "
    "ceil in upload_size",
    "fedccrl_core.data.pools.x_sample_statistics__mutmut_13": "replace=None is falsy: numpy draws without replacement",
    "fedccrl_core.data.pools.x_upload_size__mutmut_1": "the default rounding's name: any value but 'floor' is ceil",
    "fedccrl_core.data.pools.x_upload_size__mutmut_2": "the default rounding's name: any value but 'floor' is ceil",
    "fedccrl_core.learning.losses.x_js_loss__mutmut_10": "no upper clamp: Y_bar, a mean of probabilities, is <= 1",
    "fedccrl_core.learning.losses.x_js_loss__mutmut_12": "no upper clamp: Y_bar, a mean of probabilities, is <= 1",
    "fedccrl_core.learning.losses.x_js_loss__mutmut_21": "upper clamp 2: Y_bar, a mean of probabilities, is <= 1",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_14": "F.normalize's default dim is 1",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_18": "torch.cat's default dim is 0",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_25": "torch.cat's default dim is 0",
    "fedccrl_core.learning.losses.x_supcon_self_positive_loss__mutmut_6": "F.normalize's default dim is 1",
    "fedccrl_core.learning.losses.x_supcon_self_positive_loss__mutmut_10": "torch.cat's default dim is 0",
    "fedccrl_core.learning.losses.x_supcon_self_positive_loss__mutmut_17": "torch.cat's default dim is 0",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_40": "the A(i) mask made on the CPU: equivalent on a "
    "CPU-only machine; on CUDA tests/test_losses.py's CUDA test fails on the mixed devices",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_43": "the A(i) mask made on the CPU: equivalent on a "
    "CPU-only machine; on CUDA tests/test_losses.py's CUDA test fails on the mixed devices",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_50": "log-denominator subtracted per positive p instead of "
    "per anchor i: P is symmetric (p in P(i) iff i in P(p)), so the sum and the mean over anchors are unchanged",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_60": "log-denominator subtracted per positive p instead of "
    "per anchor i: P is symmetric (p in P(i) iff i in P(p)), so the sum and the mean over anchors are unchanged",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_58": "float('-INF') is float('-inf')",
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_100": "positives come in pairs (p in P(i) iff i in P(p)): "
    "the count of anchors with one is 0 (then the sum is 0) or >= 2",
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}
STATUS.update(dict.fromkeys((24, -24, 36, 152, 255), "timeout"))
STATUS.update(dict.fromkeys((-9, -11), "segfault"))


def function_of(mutant: str) -> tuple[str, str]:
    """'fedccrl_core.learning.losses.x_js_loss__mutmut_3' -> ('fedccrl_core.learning.losses', 'x_js_loss')."""
    module, _, func = re.sub(r"__mutmut_\d+$", "", mutant).rpartition(".")
    return module, func


def in_scope(mutant: str) -> bool:
    module, func = function_of(mutant)
    return any(fnmatch.fnmatchcase(func, p) for p in SCOPE.get(module, ()))


def patterns(module: str) -> list[str]:
    return [f"{module}.{p}__mutmut_*" for p in SCOPE[module]]


def results() -> dict[str, int | None]:
    """{mutant: exit code} over every module of SCOPE, from mutmut's .meta files."""
    out: dict[str, int | None] = {}
    for module in SCOPE:
        meta = MUTANTS / (module.replace(".", "/") + ".py.meta")
        if meta.exists():
            out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return {k: v for k, v in out.items() if in_scope(k)}


def run(modules: list[str]) -> int:
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one core per mutant, and fork-safe torch
    for module in modules:
        start = time.monotonic()
        rc = subprocess.call(
            [str(Path(sys.executable).parent / "mutmut"), "run", "--max-children", "1", *patterns(module)],
            cwd=ROOT,
            env=env,
        )
        times[module] = round(time.monotonic() - start, 1)
        TIMES.write_text(json.dumps(times, indent=1))
        print(f"{module}: mutmut exited {rc} after {times[module]:.0f} s", flush=True)
        if rc != 0:
            return rc
    return 0


def summary(show_survivors: bool) -> int:
    codes = results()
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    rows, total = [], Counter()
    unexplained = []
    for module in SCOPE:
        c = Counter()
        for name, code in codes.items():
            if function_of(name)[0] != module:
                continue
            status = STATUS.get(code, "suspicious")
            if status == "survived" and name in EQUIVALENT:
                status = "equivalent"
            elif status not in ("killed", "timeout"):
                unexplained.append((name, status))
            c["made"] += 1
            c[status] += 1
        total.update(c)
        rows.append((module, c, times.get(module)))
    print("| module | made | killed | equivalent | timeouts | survived | not run | killed or equivalent | time (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for module, c, t in [*rows, ("all", total, sum(times.get(m, 0) for m in SCOPE) or None)]:
        other = c["made"] - c["killed"] - c["equivalent"] - c["timeout"] - c["survived"]
        share = (c["killed"] + c["equivalent"] + c["timeout"]) / c["made"] if c["made"] else 0.0
        print(
            f"| {module} | {c['made']} | {c['killed']} | {c['equivalent']} | {c['timeout']} | {c['survived']} | "
            f"{other} | {share:.1%} | {'' if t is None else f'{t:.0f}'} |"
        )
    print()
    print("Equivalent mutants (a timeout counts as killed: the mutant never finishes the tests):")
    for name in sorted(EQUIVALENT):
        if name in codes:
            print(f"- `{name}`: {EQUIVALENT[name]}")
    if unexplained:
        print(f"\n{len(unexplained)} mutants neither killed nor shown equivalent")
        if show_survivors:
            for name, status in sorted(unexplained):
                print(f"  {status}: {name}")
    return 1 if unexplained else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("modules", nargs="*", help=f"some of: {', '.join(SCOPE)}")
    p_sum = sub.add_parser("summary")
    p_sum.add_argument("--survivors", action="store_true", help="list each mutant neither killed nor equivalent")
    args = parser.parse_args()
    if args.command == "run":
        unknown = set(args.modules) - set(SCOPE)
        if unknown:
            parser.error(f"not in SCOPE: {sorted(unknown)}")
        return run(args.modules or list(SCOPE))
    return summary(args.survivors)


if __name__ == "__main__":
    sys.exit(main())
