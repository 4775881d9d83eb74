"""The ```bash blocks of the README and of every page of the documentation site (mkdocs.yml's nav), each with
the `<!-- ci: skip (reason) -->` marker above it, if any: what tests/test_readme_blocks.py runs and what other
tests read their recipes from."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MKDOCS = REPO / "mkdocs.yml"
MARKER = re.compile(r"<!--\s*ci:\s*(?P<kind>\w+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->")


@dataclass(frozen=True)
class Block:
    line: int  # line of the opening fence in its file
    code: str
    marker: str | None  # skip | None
    reason: str | None
    source: str = "README.md"  # the file, relative to the repository root

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def readme_blocks(text: str, source: str = "README.md") -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            above = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            m = MARKER.search(above)
            blocks.append(
                Block(
                    start + 1,
                    "\n".join(lines[start + 1 : j]),
                    m["kind"] if m else None,
                    (m["reason"] or "").strip() if m else None,
                    source,
                )
            )
            i = j
        i += 1
    return blocks


def nav_pages(nav) -> list[str]:
    """The Markdown files of mkdocs.yml's `nav`, in order (sections flattened; generated pages included)."""
    out = []
    for entry in nav:
        items = entry.values() if isinstance(entry, dict) else [entry]
        for item in items:
            out += nav_pages(item) if isinstance(item, list) else [item] if str(item).endswith(".md") else []
    return out


def doc_files() -> list[str]:
    """README.md, then every page of the documentation site that exists in docs/, in nav order."""
    docs_dir = yaml.safe_load(MKDOCS.read_text()).get("docs_dir", "docs")
    pages = [f"{docs_dir}/{page}" for page in nav_pages(yaml.safe_load(MKDOCS.read_text())["nav"])]
    return ["README.md"] + [p for p in pages if (REPO / p).is_file()]


BLOCKS = [b for rel in doc_files() for b in readme_blocks((REPO / rel).read_text(), rel)]
