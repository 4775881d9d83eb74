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

# ---- hypothesis (tests/test_properties.py) --------------------------------------------------------------------------
# "ci", the default: derandomized, so a run draws the same examples on every machine and a red CI run is red again
# on the developer's (no example database to carry between them, none written into the checkout); 25 examples per
# property (a test may lower it where one example writes files), no deadline (2 shared cores time nothing reliably).
# HYPOTHESIS_PROFILE=explore: random examples, 500 per property, to hunt for new counterexamples; one it finds is
# printed with the @reproduce_failure blob to pin it.
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # hypothesis is in the dev extra; without it only tests/test_properties.py cannot run
    pass
else:
    _hypothesis_settings.register_profile(
        "ci", derandomize=True, database=None, max_examples=25, deadline=None, print_blob=True
    )
    _hypothesis_settings.register_profile(
        "explore",
        max_examples=500,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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


# ---- params.yaml, the tiny dataset and one run trained on it (the functions: tests/fixtures.py) -------------------
@pytest.fixture
def params(tmp_path):
    """params(overrides=None, *, to=tmp_path, new_keys=None) -> the path of <to>/params.yaml: the repository's
    params.yaml with dotted-key overrides (fixtures.write_params: DELETE removes a key; new_keys adds unknown ones)."""
    from fixtures import write_params

    def write(overrides: dict | None = None, *, to: Path = tmp_path, new_keys: dict | None = None) -> Path:
        return write_params(to, overrides, new_keys=new_keys)

    return write


@pytest.fixture
def not_private(monkeypatch) -> None:
    """This test seeds the DP noise (train.privacy.noise_seed), which is refused unless the environment says the run
    is not private (FEDCCRL_NOT_PRIVATE=1, fedccrl_core/privacy/settings.py); child processes inherit it."""
    from fedccrl_core.privacy.settings import NOT_PRIVATE_VARIABLE

    monkeypatch.setenv(NOT_PRIVATE_VARIABLE, "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The one tiny dataset of a test run, read-only (a test that changes a file copies it first): <tiny>/raw,
    <tiny>/data/shards, <tiny>/data/pools (fixtures.build_tiny)."""
    from fixtures import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def trained(tiny, tmp_path_factory) -> Path:
    """One tiny fedavg run trained and evaluated by the stage CLIs (about 20 s): its workspace (fixtures.train_tiny).
    A test that changes a file there puts it back (test_untrusted_files.py)."""
    from fixtures import train_tiny

    return train_tiny(tmp_path_factory.mktemp("trained"), tiny)


@pytest.fixture
def images(tmp_path) -> Path:
    """<tmp_path>/imgs/{a,b}/0..5.png: twelve random 9 x 7 RGB images in two class folders."""
    import numpy as np
    from PIL import Image

    d = tmp_path / "imgs"
    for c in ("a", "b"):
        (d / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (9, 7, 3), dtype=np.uint8)).save(
                d / c / f"{i}.png"
            )
    return d


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


def _make_toy_client(
    cid: str,
    domain: str,
    n: int,
    seed: int,
    shift: float,
    contrast: float = 1.0,
    size: int = 8,
    n_val: int = 8,
    stats: bool = False,
    stats_mean: float = 0.0,
):
    """A tiny learnable client: class = which colour channel is bright, in size x size uint8 images; the domain
    is a brightness `shift` and a `contrast`. The last `n_val` images are its validation split. stats=True also
    gives it per-sample (mu, sigma) rows (mu ~ N(stats_mean, 1), sigma = |mu| + 0.5) for the algorithms
    that read a statistics pool."""
    import numpy as np

    from fedccrl_core.learning.clients import ClientData

    g = np.random.default_rng(seed)
    y = g.integers(0, 3, n)
    x = g.integers(0, 60, (n, size, size, 3)).astype(np.float64) + shift
    x[np.arange(n), :, :, y] += 150
    x = np.clip(x * contrast, 0, 255).astype(np.uint8)
    t = n - n_val
    extra = ()
    if stats:
        mu = (g.normal(size=(n, 3)) + stats_mean).astype(np.float32)
        extra = (mu[:t], (np.abs(mu[:t]) + 0.5).astype(np.float32))
    return ClientData.from_numpy(cid, domain, x[:t], y[:t], x[t:], y[t:], "cpu", *extra)


@pytest.fixture(scope="session")
def toy_client():
    """The one toy client factory of the tests: toy_client(cid, domain, n, seed, shift, contrast=1.0, size=8,
    n_val=8, stats=False, stats_mean=0.0) -> ClientData."""
    return _make_toy_client


# ---- the two tiers ---------------------------------------------------------------------------------
# `make test` runs every test not marked `full` (minutes); `make test-all` runs them all (.ci/run). A full-tier
# test says why it is there: `@pytest.mark.full("the README's blocks, each in a scratch clone")`.
_left_to_full: dict[str, list] = {}  # test file -> [number of tests, {reasons}]


def pytest_collection_modifyitems(config, items):
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None and not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.full needs its reason, e.g. "
                "@pytest.mark.full('runs the whole pipeline through DVC')"
            )


def pytest_deselected(items):
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None:
            entry = _left_to_full.setdefault(item.path.name, [0, set()])
            entry[0] += 1
            entry[1].add(mark.args[0])


def pytest_terminal_summary(terminalreporter):
    if not _left_to_full:
        return
    total = sum(n for n, _ in _left_to_full.values())
    terminalreporter.section(f"left to the full tier (make test-all): {total} tests")
    for name, (n, reasons) in sorted(_left_to_full.items()):
        terminalreporter.write_line(f"{name} ({n}): {'; '.join(sorted(reasons))}")


# ---- the wheel and venvs outside the repository (tests/wheel_envs.py): built once per session, full tier only
@pytest.fixture(scope="session")
def fedccrl_wheel(tmp_path_factory) -> Path:
    from wheel_envs import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def serve_venv(fedccrl_wheel, tmp_path_factory) -> Path:
    """A fresh venv with `<wheel>[serve]` from the package index (-c constraints.txt)."""
    from wheel_envs import serve_venv

    return serve_venv(tmp_path_factory.mktemp("venvs"), fedccrl_wheel)


@pytest.fixture(scope="session")
def full_venv(fedccrl_wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel (--no-deps) and the training dependencies of this interpreter (a .pth file)."""
    from wheel_envs import full_venv

    return full_venv(tmp_path_factory.mktemp("venvs"), fedccrl_wheel)


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """The Flower tests' federation: the embedded default with one client per domain (tests/flower_harness.py),
    built once per test run and only read."""
    from flower_harness import build_data

    return build_data(tmp_path_factory.mktemp("flower-data"))
