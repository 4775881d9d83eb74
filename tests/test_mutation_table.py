"""The mutation table of docs/contributing.md cannot go stale unnoticed: every module of scripts/mutation.py's SCOPE
has a recorded row (docs/mutation-results.json, written by `python scripts/mutation.py summary --write`) made from
the code that is there now (the scope's hash), with no survivor left unexplained, and the table in the docs is that
record's. A change to a counted function fails here until its module is run again."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutation():
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


M = _mutation()
RECORDED = json.loads(M.RESULTS.read_text(encoding="utf-8"))


def test_every_module_in_scope_has_a_row_and_nothing_else_does():
    assert list(RECORDED) == list(M.SCOPE)


@pytest.mark.parametrize("module", list(M.SCOPE))
def test_each_row_was_made_from_the_code_that_is_there_now(module):
    made_from = RECORDED.get(module, {}).get("scope_sha256")
    assert made_from == M.scope_hash(module), (
        f"{module}: the mutation table's row was made from other code (scope sha256 {made_from}, now "
        f"{M.scope_hash(module)}): python scripts/mutation.py run {module} && python scripts/mutation.py summary --write"
    )


def test_no_row_has_a_survivor_or_a_mutant_not_run():
    bad = {m: (r["survived"], r["not run"]) for m, r in RECORDED.items() if r["survived"] or r["not run"]}
    assert not bad, f"mutants neither killed nor explained, or not run: {bad}"


def test_each_row_says_where_it_was_made():
    for module, r in RECORDED.items():
        assert r["commit"] and r["machine"] and r["date"] and r["time_s"] > 0, module
        assert r["made"] == sum(r[k] for k in M.COLUMNS if k != "made"), module


def test_the_docs_table_is_the_record():
    doc = M.DOC.read_text(encoding="utf-8")
    between = doc.split(M.TABLE_START, 1)[1].split(M.TABLE_END, 1)[0]
    assert between.strip() == M.table(RECORDED).strip()


def test_the_hash_sees_a_change_in_a_counted_function_only():
    module = "fedccrl_core.federation.round_privacy"
    text = M.source_of(module)
    assert M.scope_hash(module, text) == M.scope_hash(module, text.replace("import", "import", 1) + "\n# a comment\n")
    counted = M.scoped_functions(module, text)["x\u01c1Private\u01c1planned_round"]
    changed = text.replace(counted, counted + "\n        sizes = {}")  # one more line in the counted method
    assert changed != text and M.scope_hash(module, changed) != M.scope_hash(module, text)
    uncounted = text.replace("def accounting_of(", "def accounting_of(  ")  # a function outside the scope
    assert uncounted != text and M.scope_hash(module, uncounted) == M.scope_hash(module, text)
    renamed = text.replace("def planned_round(", "def planned(")
    with pytest.raises(SystemExit, match="planned_round"):
        M.scope_hash(module, renamed)


def test_mutmut_mutates_exactly_the_modules_in_scope():
    mutmut = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert sorted(mutmut["only_mutate"]) == sorted(m.replace(".", "/") + ".py" for m in M.SCOPE)
