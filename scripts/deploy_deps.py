"""Rewrite each stage's code deps in deploy/dvc.yaml with what the stage imports, module by module, as
tests/test_dvc_deps.py computes them (the operator's project lies outside the code, so folders cannot be deps).
Run it after an import changes: `python scripts/deploy_deps.py`; the stage's other deps (federation.json, the
test folder) are kept, first."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_dvc_deps as rule  # noqa: E402  (the one rule, written once in the test)

DVC_FILE = "deploy/dvc.yaml"
CODE = ("../fedccrl_core", "../pipeline", "../serving", "../fedccrl_flower", "../benchmarks")
WIDTH = 118


def main() -> None:
    path = ROOT / DVC_FILE
    text = path.read_text()
    stages = yaml.safe_load(text)["stages"]
    pos = 0
    for name, stage in stages.items():
        start = re.compile(rf"^  {re.escape(name)}:\n", re.M).search(text, pos)
        assert start is not None, name
        m = re.compile(r"^(\s*)deps: \[", re.M).search(text, start.end())
        assert m is not None, name
        end = text.index("]", m.end())
        tokens = [t.strip() for t in text[m.end() : end].replace("\n", " ").split(",") if t.strip()]
        keep = [t for t in tokens if not t.startswith(CODE)]
        code = rule.expected_deps(DVC_FILE, rule.needed_files(stage))
        items = keep + [c for c in code if c not in keep]
        indent = m.group(1) + " " * len("deps: [")
        lines, line = [], m.group(1) + "deps: ["
        for i, item in enumerate(items):
            piece = item + ("]" if i == len(items) - 1 else ",")
            if len(line) + len(piece) + 1 > WIDTH and not line.endswith("["):
                lines.append(line.rstrip())
                line = indent + piece
            else:
                line += ("" if line.endswith("[") else " ") + piece
        lines.append(line)
        text = text[: m.start()] + "\n".join(lines) + text[end + 1 :]
        pos = m.start() + 1
    path.write_text(text)


if __name__ == "__main__":
    main()
