"""Shared test fixtures.

Tests that need ../shared (the PACS zips) use the `shared_dir` fixture: they skip with a stated
reason when ../shared is absent (a user's clone), and FAIL instead when FEDCCRL_REQUIRE_SHARED=1
(.ci/run sets it), so CI can never pass by skipping them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FEDCCRL_SHARED", REPO.parent / "shared"))


@pytest.fixture(autouse=True)
def _mlflow_tmp_store(tmp_path, monkeypatch):
    """Every test logs MLflow runs to its own temporary SQLite store, never to ./mlflow.db."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FEDCCRL_MLFLOW_ARTIFACTS", str(tmp_path / "mlartifacts"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors on 2 shared cores: one intra-op thread is >10x faster than two contending ones.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared_dir() -> Path:
    if not (SHARED / "datasets" / "pacs").is_dir():
        msg = f"needs the shared datasets folder {SHARED}/datasets/pacs (absent in a user's clone)"
        if os.environ.get("FEDCCRL_REQUIRE_SHARED") == "1":
            pytest.fail(f"FEDCCRL_REQUIRE_SHARED=1 but {msg}")
        pytest.skip(msg)
    return SHARED


@pytest.fixture
def pacs128(shared_dir) -> Path:
    return shared_dir / "datasets" / "pacs" / "pacs_128.zip"
