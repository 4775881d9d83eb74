"""The names several layers spell are defined once, in fedccrl_core/foundation/contract.py: no module
of the library, the stage scripts, serving or the Flower app spells one of them as a bare string literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedccrl_core.foundation import contract

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p
    for pkg in ("fedccrl_core", "pipeline", "serving", "fedccrl_flower")
    for p in (ROOT / pkg).rglob("*.py")
    if p != ROOT / "fedccrl_core" / "foundation" / "contract.py"
)

# Names too generic to police by their spelling alone: "round", "loss" and "lr" also name a checkpoint's round,
# a model's meta field and an optimizer setting; "best_round" is a field of RunResult; l_cls, l_ra, l_js, l_sc and
# l_rc are also FedCCRL's / FedAlign's ablation switches (hyperparameters named after their terms).
GENERIC = {
    contract.ROUND,
    contract.LOSS,
    contract.LR,
    contract.SECONDS,
    contract.BEST_ROUND,
    contract.L_CLS,
    contract.L_RA,
    contract.L_JS,
    contract.L_SC,
    contract.L_RC,
}
POLICED = {
    v: k
    for k, v in vars(contract).items()
    if k.isupper() and isinstance(v, str) and v not in GENERIC and k != "LOSS_TERM_PREFIX"
}


def bare_names(source: str) -> list[str]:
    return [
        f"line {n.lineno}: {n.value!r} (contract.{POLICED[n.value]})"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in POLICED
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_contract_name_is_spelled_outside_the_contract(path):
    assert bare_names(path.read_text()) == []


def test_a_bare_name_is_caught():
    assert bare_names('p = run / "history.json"\nrec["target_acc"] = 1\n') == [
        "line 1: 'history.json' (contract.HISTORY_FILE)",
        "line 2: 'target_acc' (contract.TARGET_ACC)",
    ]


def test_the_run_layout_round_trips(tmp_path):
    run = contract.run_dir(tmp_path / "models", "fedccrl", 2, "sketch")
    assert run == tmp_path / "models" / "fedccrl" / "s2" / "dsketch"
    res = contract.result_file(tmp_path / "runs", tmp_path / "models", run)
    assert res == tmp_path / "runs" / "fedccrl" / "s2" / "dsketch.json"
    assert contract.run_of_result(tmp_path / "models", tmp_path / "runs", res) == run
    assert contract.checkpoint_dir_name("fedccrl", 2, 3) == "fedccrl-s2-d3"
