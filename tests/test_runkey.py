"""The run key hashes the training code only (fedccrl_core/foundation/runkey.py): a figure module or a benchmark is not part
of it, every module a training run imports is."""

from __future__ import annotations

import ast

from fedccrl_core.foundation import runkey


def test_the_code_hash_covers_the_training_code_and_nothing_else():
    root, files = runkey.training_sources()
    names = {str(f.relative_to(root)) for f in files}
    assert {
        "algorithms/base.py",
        "algorithms/fedccrl.py",
        "federation/loop.py",
        "federation/jobs.py",
        "augment/ccdt.py",
        "data/shards.py",
        "learning/models.py",
    } <= names
    assert not [n for n in names if n.startswith(("viz/", "outcomes/", "bench/"))]
    assert not (root.parent / "benchmarks").is_relative_to(root)


def test_no_hashed_module_imports_an_unhashed_one():
    """Else a change to code that training runs would not change the key."""
    _root, files = runkey.training_sources()
    left_out = tuple(f"fedccrl_core.{p}" for p in runkey.NOT_TRAINING)
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(left_out), f"{f} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith(left_out) for a in node.names), f"{f}"
