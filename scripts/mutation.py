"""`make mutation`: mutmut over the modules that implement the papers' equations, one module at a time, and the
per-module table of docs/contributing.md ("Mutation testing") from mutmut's results.

  python scripts/mutation.py run [MODULE ...]   mutmut run --max-children 1 on each module's scope (all by default),
                                                timed; the times and each scope's hash go to mutants/mutation-times.json
  python scripts/mutation.py summary [--survivors] [--write]   the modules' results from mutants/**/*.py.meta
                                                (mutmut's own) recorded in docs/mutation-results.json with the hash
                                                of the code they were made from, the table of every recorded module,
                                                the equivalent mutants with their reasons, and every survivor not
                                                explained (exit code 1 when there is one, or a row is stale);
                                                --write puts the table into docs/contributing.md

The scope (SCOPE) is the list of functions each module's row counts: a module's mutants outside it are neither run
nor counted. Its hash (`scope_hash`: the source of those functions) is recorded with the row, so a row whose code
changed since its run is seen as stale (tests/test_mutation_table.py). The tests each mutant runs are the ones mutmut
saw call the mutated function, among the fast tests of pyproject.toml [tool.mutmut] pytest_add_cli_args_test_selection.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
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
RESULTS = ROOT / "docs" / "mutation-results.json"
DOC = ROOT / "docs" / "contributing.md"
TABLE_START = "<!-- the mutation table: python scripts/mutation.py summary --write -->"
TABLE_END = "<!-- end of the mutation table -->"
COLUMNS = ("made", "killed", "equivalent", "device-only", "timeout", "survived", "not run")

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
    # Alg. 3: the per-sample draws, the op parameters and the mixing (lines 4-6, 10-13)
    "fedccrl_core.augment.augmix": (
        "x_op_magnitude",
        "x_sample_augmix_plan",
        "x__augmix_with",
        "x_augmix",
    ),
    # Alg. 3 lines 7-9: one chain step's routing and ops
    "fedccrl_core.augment.augmix_ops": (
        "x__is_any",
        "x__lut_ops",
        "x__posterize_lut",
        "x__solarize_lut",
        "x__geometric_ops",
        "x__apply_family",
        "x__apply_step",
    ),
    # FedOMG's server step, Eq. 15-17
    "fedccrl_core.algorithms.fedomg": ("*",),
    # DP clipping and noise
    "fedccrl_core.privacy.dp": ("*",),
    # the RDP accountant
    "fedccrl_core.privacy.accountant": ("*",),
    # Algorithm 1's client sampling: m = max(1, round(C N)) of N, without replacement
    "fedccrl_core.federation.sampling": ("*",),
    # the pre-release check (the worst case charged before a round) and the sizes of what left the clients
    "fedccrl_core.federation.round_privacy": (
        "x_released_rows",
        "x_released_sizes",
        "x_upload_sizes",
        "xǁPrivateǁplanned_round",
    ),
    # the statistics release the pre-round check charged, which a site whose size changed must not exceed
    "fedccrl_core.privacy.charged": ("*",),
    # Eq. 8's k_i as announced before the round and as counted in an upload
    "fedccrl_core.algorithms.fedccrl": ("xǁStatisticsExchangeǁreleased_rows", "xǁStatisticsExchangeǁupload_rows"),
}

# Device placement: None (or the argument dropped) puts a tensor on the CPU, where the run's tensors are; only an
# accelerator tells (tests/test_augment.py's and tests/test_losses.py's CUDA tests, skipped without one). Counted apart.
DEVICE = "device: the CPU default in place of x's device"
RECAST = "the pool rows' dtype: mixstyle casts mu_p and sigma_p to x's dtype itself"
COMPACT = (
    "the compact and the whole-batch paths of _apply_family give the same images (each op acts on each image alone)"
)
PROMOTED = (
    "one operand left in its own float dtype: the other is float64, and torch promotes it exactly to float64 first"
)
NO_COLOR = "all_ops on by default: no Alg. 3 op id is a color op, so the color family selects no image"

# Surviving mutants that change nothing observable, each with its one-line reason (mutmut show NAME prints the diff).
EQUIVALENT: dict[str, str] = {
    "fedccrl_core.algorithms.fedomg.x_column_blocks__mutmut_7": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_column_blocks__mutmut_11": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_column_blocks__mutmut_16": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_4": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_7": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_9": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_11": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_13": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_gram_matrix__mutmut_5": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_gram_matrix__mutmut_9": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_gram_matrix__mutmut_10": DEVICE,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁflatten__mutmut_3": DEVICE,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁflatten__mutmut_5": DEVICE,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_90": DEVICE,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_92": DEVICE,
    "fedccrl_core.privacy.dp.xǁDPFedAvgAggregationǁresult__mutmut_28": DEVICE,
    "fedccrl_core.privacy.dp.xǁDPFedAvgAggregationǁresult__mutmut_30": DEVICE,
    "fedccrl_core.algorithms.fedomg.x_column_blocks__mutmut_2": "every row of D has the same length P",
    "fedccrl_core.algorithms.fedomg.x_combine__mutmut_8": "every row of D has the same length P",
    "fedccrl_core.algorithms.fedomg.x_is_matched__mutmut_5": "the last dotted component is the same whatever the number of splits",
    "fedccrl_core.algorithms.fedomg.x_is_matched__mutmut_8": "the last dotted component is the same whatever the number of splits",
    "fedccrl_core.algorithms.fedomg.x_search_coefficients__mutmut_32": "the loop leaves at step == steps before a further step",
    "fedccrl_core.algorithms.fedomg.x_search_coefficients__mutmut_65": "a constant added to every component of dF/dGamma is removed by the softmax Jacobian",
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_91": PROMOTED,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_93": PROMOTED,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_83": PROMOTED,
    "fedccrl_core.algorithms.fedomg.xǁMatchingGradientAggregationǁresult__mutmut_68": "with Gamma* searched and "
    "c = 0 the extra term is combine(rows, 0) = +-0, and a zero added leaves Eq. 17's value (never -0.0: Eq. 2's sum "
    "starts from +0.0) as it is",
    "fedccrl_core.algorithms.fedomg.x_search_coefficients__mutmut_52": "f <= best_f keeps the later of two visited "
    "iterates whose F are equal floats: both are the least F found, so either is Eq. 15's Gamma*",
    "fedccrl_core.privacy.dp.xǁDPFedAvgAggregationǁadd__mutmut_8": PROMOTED,
    "fedccrl_core.privacy.dp.xǁDPFedAvgAggregationǁadd__mutmut_9": PROMOTED,
    "fedccrl_core.privacy.dp.xǁDPFedAvgAggregationǁresult__mutmut_19": PROMOTED,
    "fedccrl_core.privacy.accountant.x__composed_epsilon__mutmut_3": "RdpAccountant(None) takes the default orders, as the call without orders",
    "fedccrl_core.privacy.accountant.x__composed_epsilon__mutmut_22": "SelfComposedDpEvent(e, 1) is e for the RDP accountant",
    "fedccrl_core.privacy.accountant.x__composed_epsilon__mutmut_27": "SelfComposedDpEvent(e, 1) is e for the RDP accountant",
    "fedccrl_core.privacy.accountant.x_worst_client__mutmut_10": "at an equal ratio k/n the larger n has the larger k: -k orders the ties as -n does",
    "fedccrl_core.privacy.accountant.xǁRunPrivacyǁ_record__mutmut_2": "the ledger's round is a label: epsilon reads "
    "the events only, and state() keeps the round (from _plain)",
    "fedccrl_core.privacy.accountant.xǁRunPrivacyǁ__init____mutmut_10": "the ledger's id is an opaque random name: "
    "token_hex's default length names it as well",
    "fedccrl_core.privacy.accountant.xǁRunPrivacyǁ__init____mutmut_11": "the ledger's id is an opaque random name: "
    "9 random bytes name it as well as 8",
    "fedccrl_core.privacy.dp.x_clip_update__mutmut_19": "the scale of a zero update: any scale leaves it zero",
    "fedccrl_core.privacy.dp.x_noisy_moments__mutmut_5": "channels as the float width / 2 of an even width: the same sensitivity",
    "fedccrl_core.augment.augmix_ops.x__is_any__mutmut_2": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_20": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_23": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_35": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_38": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_48": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_51": DEVICE,
    "fedccrl_core.augment.augmix.x_augmix__mutmut_15": DEVICE,
    "fedccrl_core.augment.augmix.x_augmix__mutmut_22": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_14": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_16": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_74": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_76": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_80": DEVICE,
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_82": DEVICE,
    "fedccrl_core.augment.augmix_ops.x__apply_family__mutmut_6": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_2": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_3": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_11": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_24": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_37": COMPACT,
    "fedccrl_core.augment.augmix_ops.x__apply_step__mutmut_1": NO_COLOR,
    "fedccrl_core.augment.augmix.x__augmix_with__mutmut_1": NO_COLOR,
    "fedccrl_core.augment.augmix.x__augmix_with__mutmut_45": "the plan's weights are float32 as drawn, and the result is cast to x's dtype",
    "fedccrl_core.augment.augmix.x__augmix_with__mutmut_67": "the plan's m is float32 as drawn, and the result is cast to x's dtype",
    "fedccrl_core.augment.augmix_ops.x__geometric_ops__mutmut_25": "grid_sample's default mode is bilinear",
    "fedccrl_core.augment.augmix_ops.x__geometric_ops__mutmut_26": "grid_sample's default padding_mode is zeros",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_44": "the 256 levels broadcast over the batch either way: the same tables",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_21": "torch's default dtype is float32, the one given",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_24": "torch's default dtype is float32, the one given",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_36": "torch's default dtype is float32, the one given",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_39": "torch's default dtype is float32, the one given",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_49": "the levels 0..255 as int64: every table is computed in float from them, exactly",
    "fedccrl_core.augment.augmix_ops.x__lut_ops__mutmut_52": "the levels 0..255 as int64: every table is computed in float from them, exactly",
    "fedccrl_core.augment.augmix.x_op_magnitude__mutmut_58": "rows 0 and 1 of the table (autocontrast, equalize) are both zero",
    "fedccrl_core.augment.augmix.x_op_magnitude__mutmut_61": "op 0 (autocontrast) has magnitude 0 anyway",
    "fedccrl_core.augment.augmix.x_op_magnitude__mutmut_62": "op 0 (autocontrast) has magnitude 0 anyway",
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_43": "randint's low defaults to 0",
    "fedccrl_core.augment.augmix.x_sample_augmix_plan__mutmut_67": "<= 0.5 for < 0.5: a uniform equal to 0.5 has probability 2^-24",
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_23": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_25": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_34": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_36": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_56": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_61": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_67": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_72": DEVICE,
    "fedccrl_core.augment.ccdt.x_pool_rows__mutmut_10": DEVICE,
    "fedccrl_core.augment.ccdt.x_pool_rows__mutmut_13": DEVICE,
    "fedccrl_core.augment.ccdt.x_pool_rows__mutmut_23": DEVICE,
    "fedccrl_core.augment.ccdt.x_pool_rows__mutmut_27": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_beta__mutmut_6": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_beta__mutmut_9": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_dirichlet__mutmut_5": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_dirichlet__mutmut_10": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_32": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_36": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_41": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_45": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_106": DEVICE,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_110": DEVICE,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_24": RECAST,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_26": RECAST,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_35": RECAST,
    "fedccrl_core.augment.ccdt.x_ccdt__mutmut_37": RECAST,
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_59": "t >= 0 for t > 0: at t = 0, v = 0 and d log(tiny) "
    "makes the second test false, so the same proposals are accepted",
    "fedccrl_core.augment.ccdt.x_sample_log_gamma__mutmut_62": "<= for < in the acceptance test: log u equal to the "
    "bound has probability 0",
    "fedccrl_core.augment.ccdt.x_sample_dirichlet__mutmut_21": "float('-INF') is float('-inf')",
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
    "fedccrl_core.federation.sampling.x_sample_clients__mutmut_11": "replace=None is falsy: numpy draws without "
    "replacement",
    "fedccrl_core.federation.round_privacy.x_upload_sizes__mutmut_8": "the transport asked for the sizes of no client "
    "answers {}: the same sizes",
    "fedccrl_core.federation.round_privacy.xǁPrivateǁplanned_round__mutmut_43": "at an equal ratio m/N the larger N "
    "has the larger m: m orders the ties as N does",
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
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_40": DEVICE,
    "fedccrl_core.learning.losses.x_supcon_loss__mutmut_43": DEVICE,
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


def source_of(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")


def scoped_functions(module: str, text: str) -> dict[str, str]:
    """{mutmut's name of the function: its source} of each function of `text` that SCOPE counts for `module`."""
    found: dict[str, str] = {}
    for node in ast.parse(text).body:
        defs = [(f"x_{node.name}", node)] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else []
        if isinstance(node, ast.ClassDef):
            defs = [
                (f"xǁ{node.name}ǁ{f.name}", f)
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
        for name, f in defs:
            if any(fnmatch.fnmatchcase(name, p) for p in SCOPE[module]):
                found[name] = ast.get_source_segment(text, f) or ""
    missing = [p for p in SCOPE[module] if p != "*" and not any(fnmatch.fnmatchcase(n, p) for n in found)]
    if missing:
        raise SystemExit(f"scripts/mutation.py SCOPE: {module} has no function {missing} (renamed? moved?)")
    return found


def scope_hash(module: str, text: str | None = None) -> str:
    """The first 12 hex digits of sha256 over the scope's source: the whole module for "*", else the counted
    functions' source in name order. A row of the table is fresh while this is what it was made from."""
    text = source_of(module) if text is None else text
    if SCOPE[module] == ("*",):
        return hashlib.sha256(text.encode()).hexdigest()[:12]
    found = scoped_functions(module, text)
    return hashlib.sha256("\n".join(f"{n}\n{found[n]}" for n in sorted(found)).encode()).hexdigest()[:12]


def machine() -> str:
    """Where a run ran: cores, CPU model and its widest vector instruction set."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{os.cpu_count()} cores"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{os.cpu_count()} cores, {model}, {isa}"


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "fedccrl_core", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def run(modules: list[str]) -> int:
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one core per mutant, and fork-safe torch
    for module in modules:
        made_from = {"scope_sha256": scope_hash(module), "commit": commit(), "machine": machine()}
        start = time.monotonic()
        rc = subprocess.call(
            [str(Path(sys.executable).parent / "mutmut"), "run", "--max-children", "1", *patterns(module)],
            cwd=ROOT,
            env=env,
        )
        made_from.update(time_s=round(time.monotonic() - start, 1), date=time.strftime("%Y-%m-%d"))
        times[module] = made_from
        MUTANTS.mkdir(exist_ok=True)
        TIMES.write_text(json.dumps(times, indent=1))
        print(f"{module}: mutmut exited {rc} after {made_from['time_s']:.0f} s", flush=True)
        if rc != 0:
            return rc
    return 0


def counted(codes: dict[str, int | None], module: str) -> tuple[Counter, list[tuple[str, str]]]:
    """A module's mutants by status (COLUMNS), and those neither killed nor explained."""
    c: Counter = Counter()
    unexplained = []
    for name, code in codes.items():
        if function_of(name)[0] != module:
            continue
        status = STATUS.get(code, "suspicious")
        if status == "survived" and name in EQUIVALENT:
            status = "device-only" if EQUIVALENT[name] == DEVICE else "equivalent"
        elif status not in ("killed", "timeout"):
            unexplained.append((name, status))
        c["made"] += 1
        c[status if status in COLUMNS else "not run"] += 1
    return c, unexplained


def record(codes: dict[str, int | None]) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """docs/mutation-results.json with the modules that mutants/ holds results of replaced by them."""
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    unexplained = []
    for module in SCOPE:
        c, bad = counted(codes, module)
        if c["made"] == c["not run"]:  # mutmut made them (it makes every module's) but this module was not run
            continue
        unexplained += bad
        made_from = times.get(module)
        if not isinstance(made_from, dict):  # mutants/ from before the hashes were kept: not known to be fresh
            made_from = {"time_s": made_from, "scope_sha256": None, "commit": None, "machine": None, "date": None}
        recorded[module] = {**{k: c[k] for k in COLUMNS}, **made_from}
    return {m: recorded[m] for m in SCOPE if m in recorded}, unexplained


def table(recorded: dict[str, dict]) -> str:
    """The Markdown table of the recorded rows and their sum."""
    head = (
        "| module | made | killed | equivalent | device-only | timeouts | survived | not run | killed or equivalent "
        "| time (s) | scope sha256 | run at |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n"
    )
    total = Counter({k: sum(r[k] for r in recorded.values()) for k in COLUMNS})
    seconds = sum(r["time_s"] or 0 for r in recorded.values())
    lines = []
    for module, r in [*recorded.items(), ("all", {**total, "time_s": seconds, "scope_sha256": "-", "commit": "-"})]:
        explained = sum(r[k] for k in ("killed", "equivalent", "device-only", "timeout"))
        share = explained / r["made"] if r["made"] else 0.0
        t = "" if r["time_s"] is None else f"{r['time_s']:.0f}"
        cells = [module, *(str(r[k]) for k in COLUMNS), f"{share:.1%}", t, r["scope_sha256"] or "?", r["commit"] or "?"]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def stale_rows(recorded: dict[str, dict]) -> list[str]:
    """The modules of SCOPE whose row is missing or was made from other code than today's."""
    return [m for m in SCOPE if recorded.get(m, {}).get("scope_sha256") != scope_hash(m)]


def write_table(text: str) -> None:
    doc = DOC.read_text(encoding="utf-8")
    if TABLE_START not in doc or TABLE_END not in doc:
        raise SystemExit(f"{DOC}: no {TABLE_START} ... {TABLE_END} to put the table between")
    head, rest = doc.split(TABLE_START, 1)
    DOC.write_text(head + TABLE_START + "\n\n" + text + "\n" + TABLE_END + rest.split(TABLE_END, 1)[1], "utf-8")


def summary(show_survivors: bool, diffs: bool = False, write: bool = False) -> int:
    codes = results()
    recorded, unexplained = record(codes)
    text = table(recorded)
    print(text)
    if write:
        RESULTS.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        write_table(text)
    print("Equivalent mutants (a timeout counts as killed: the mutant never finishes the tests):")
    for name in sorted(EQUIVALENT):
        if codes.get(name) == 0:
            print(f"- `{name}`: {EQUIVALENT[name]}")
    stale = sorted(n for n in EQUIVALENT if n in codes and codes[n] not in (0, None))
    if stale:
        print(f"\n{len(stale)} mutants listed as equivalent are killed now (remove them from EQUIVALENT): {stale}")
    old = stale_rows(recorded)
    if old:
        print(f"\nstale or missing rows (their code changed since): python scripts/mutation.py run {' '.join(old)}")
    if unexplained:
        print(f"\n{len(unexplained)} mutants neither killed nor shown equivalent")
        if show_survivors:
            for name, status in sorted(unexplained):
                print(f"  {status}: {name}")
                if diffs and status == "survived":
                    shown = subprocess.run(
                        [str(Path(sys.executable).parent / "mutmut"), "show", name],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                    ).stdout
                    print("".join(f"      {line}\n" for line in shown.splitlines() if line[:2] in ("- ", "+ ")))
    return 1 if unexplained or old or any(r["survived"] or r["not run"] for r in recorded.values()) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("modules", nargs="*", help=f"some of: {', '.join(SCOPE)}")
    p_sum = sub.add_parser("summary")
    p_sum.add_argument("--survivors", action="store_true", help="list each mutant neither killed nor equivalent")
    p_sum.add_argument("--diffs", action="store_true", help="with --survivors: each survivor's changed lines")
    p_sum.add_argument(
        "--write", action="store_true", help=f"record the results in {RESULTS.name} and the table in {DOC.name}"
    )
    args = parser.parse_args()
    if args.command == "run":
        unknown = set(args.modules) - set(SCOPE)
        if unknown:
            parser.error(f"not in SCOPE: {sorted(unknown)}")
        return run(args.modules or list(SCOPE))
    return summary(args.survivors, args.diffs, args.write)


if __name__ == "__main__":
    sys.exit(main())
