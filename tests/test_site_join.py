"""A site installs only what a site runs and joins with one command (docs/flower.md, "A site's install" and the
walkthrough; fedccrl_flower/site_config.py, supernode.py):

- the `site` extra's dependency closure has torch, torchvision and Flower, and none of DVC, MLflow, Ray, ONNX
  (Runtime) or matplotlib; `fedccrl site prepare`, `fedccrl site join` and the SuperNode's ClientApp (every
  algorithm's client model) run in a process where every module outside that closure fails to import;
- the join config's bad inputs are refused naming the file and the key, before anything starts;
- the flower-supernode command line built from a config, argument by argument, and its node config as Flower reads it;
- `fedccrl site join` runs a fake flower-supernode found on PATH, passes its exit code and a SIGTERM on.

The installs' sizes are a bench (benchmarks/fedccrl_benchmarks/install_size.py, docs/benchmarks.md), not a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from layout import ROOTS
from wheel_envs import REPO, canonical, extra, requirement_closure

from fedccrl_core.foundation.errors import DataError
from fedccrl_flower.site_config import SiteConfig, load_site_config, supernode_argv

TRAINING_ONLY = {"dvc", "mlflow", "ray", "onnxruntime", "onnxruntime-gpu", "onnx", "onnxscript", "matplotlib"}
CLASSES = ["bird", "cat", "dog"]


def _site_closure() -> set[str]:
    return requirement_closure(extra("site"))


def test_the_site_extra_brings_what_a_site_runs_and_no_training_only_library():
    site, full = _site_closure(), requirement_closure(extra("full"))
    assert {"torch", "torchvision", "flwr", "pydantic", "numpy", "pillow"} <= site
    assert not site & TRAINING_ONLY, sorted(site & TRAINING_ONLY)
    assert site <= full and TRAINING_ONLY - {"onnxruntime"} <= full  # full = site + the training machine's stack


def _site_install(folder: Path) -> Path:
    """`folder` as the site install's site-packages: links to what the site extra's closure installed here (each of
    its distributions' top-level files and folders, metadata included), nothing else."""
    site = _site_closure()
    folder.mkdir()
    for dist in metadata.distributions():
        if canonical(dist.metadata["Name"]) not in site:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:  # not the scripts (../../bin)
            src, dst = Path(str(dist.locate_file(top))), folder / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return folder


SITE_PROCESS = r"""
import importlib.util, json, sys, time
assert not [m for m in ("mlflow", "dvc", "ray", "matplotlib", "onnxruntime") if importlib.util.find_spec(m)]
T0 = time.perf_counter()
def lap(what):
    print(f"{what}: {time.perf_counter() - T0:.1f}s", file=sys.stderr)
from fedccrl_pipeline.cli import main

def fedccrl(*args):
    try:
        main(list(args), standalone_mode=False)
    except SystemExit as e:
        return e.code
    return 0

prepare = ["site", "prepare", "--images", "img", "--domain", "photo", "--client-id", "photo_c0", "--classes",
           "classes.txt", "--params", "params.yaml", "--out", "site", "--join-config", "site.toml",
           "--superlink", "127.0.0.1:9092", "--insecure"]
assert fedccrl(*prepare) == 0
lap("prepare")
assert fedccrl("site", "join", "--config", "site.toml") == 3
lap("join")
import fedccrl_flower.client_app, fedccrl_flower.evalsets
lap("clientapp")
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
local = LocalConfig(rounds=1, local_epochs=1, batch_size=4, lr=1e-3, weight_decay=0.0, lr_schedule="cosine",
                    mean=[0.5] * 3, std=[0.25] * 3)
for name in sorted(ALGORITHMS):
    alg = build_algorithm(name, local, {"adain_weights": "random"} if name == "ccst" else None)
    alg.build_model("small_cnn", 3, "none", alg.hp)
lap("algorithms")
import torchvision.models  # the backbones' (fedccrl_core/learning/models.py imports it when it builds one)
lap("torchvision")
import numpy as np
from fedccrl_core.algorithms.fedalign import kmeans  # FedAlign's client clusters its pool (scikit-learn)
kmeans(np.random.default_rng(0).normal(size=(12, 6)), 3, np.random.default_rng(1))
lap("kmeans")
import sysconfig
allowed = (*sys.argv[1:], sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
files = {m: getattr(v, "__file__", None) for m, v in list(sys.modules.items())}
print(json.dumps({"imported": sorted({m.split(".")[0] for m in files}),
                  "outside": sorted(f for f in files.values() if f and f.startswith("/") and not f.startswith(allowed))}))
"""


def _images(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    for i, c in enumerate(CLASSES):
        (root / c).mkdir(parents=True)
        for k in range(4):
            arr = np.random.default_rng([i, k]).integers(0, 256, (10, 10, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{k}.png")
    return root


def _fake_supernode(folder: Path, body: str = "exit 3") -> Path:
    """A `flower-supernode` that writes its arguments to argv.json, then runs `body` (a shell fragment)."""
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "flower-supernode"
    fake.write_text(
        "#!/bin/sh\n"
        f'"{sys.executable}" -c "import json, sys; json.dump(sys.argv[1:], open(\'{folder}/argv.json\', \'w\'))" "$@"\n'
        f"{body}\n"
    )
    fake.chmod(0o755)
    return folder


def test_site_prepare_join_and_the_clientapp_run_on_the_site_extra_alone(tmp_path, params):
    """The site's commands and its ClientApp in a Python whose site-packages hold the site extra's closure alone
    (links to what is installed here): DVC, MLflow, Ray, ONNX Runtime and matplotlib cannot be imported there."""
    _images(tmp_path / "img")
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    params({"dataset.name": "imagefolder", "preprocess.image_size": 8}, to=tmp_path)
    bin_ = _fake_supernode(tmp_path / "bin")
    view = _site_install(tmp_path / "site-packages")
    path = os.pathsep.join(map(str, [view, *ROOTS]))  # -S: no site-packages but the view (and the checkout)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path}
    p = subprocess.run(
        [sys.executable, "-S", "-c", SITE_PROCESS, f"{view}/", *(f"{r}/" for r in ROOTS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"torch", "torchvision", "flwr", "sklearn", "fedccrl_flower"} <= set(seen["imported"])
    assert seen["outside"] == []  # every module from the view, the standard library or the checkout
    assert json.loads((bin_ / "argv.json").read_text())[:3] == ["--superlink", "127.0.0.1:9092", "--insecure"]


# ---------------------------------------------------------------- the join config
@pytest.fixture
def site(tmp_path) -> Path:
    """A folder as `fedccrl site prepare --out prepared` leaves it (the files the join config checks), a CA file."""
    for rel in ("prepared/shards/manifest.json", "prepared/shards/art_c0.npz", "prepared/pools/art_c0.npz"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


GOOD = (
    'client_id = "art_c0"\nsite = "prepared"\nstate_dir = "state"\nsuperlink = "superlink.example.org:8000"\n'
    'root_certificates = "certs/ca.crt"\n'
)


def _config(site: Path, text: str) -> Path:
    path = site / "site.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, match",
    [
        (GOOD.replace('superlink = "superlink.example.org:8000"\n', ""), r"site\.toml: key 'superlink': missing"),
        (GOOD + "port = '9094'\n", r"site\.toml: key 'port': got '9094'; must be an integer"),
        (GOOD + "port = 0\n", r"site\.toml: key 'port': got 0"),
        (
            GOOD.replace("certs/ca.crt", "certs/nope.crt"),
            r"site\.toml: key 'root_certificates': .*nope\.crt is not a file",
        ),
        (
            GOOD + 'auth_private_key = "keys/site_art"\n',
            r"site\.toml: key 'auth_private_key': .*site_art is not a file",
        ),
        (
            GOOD.replace('root_certificates = "certs/ca.crt"', "insecure = true")
            + 'auth_private_key = "certs/ca.crt"\n',
            r"site\.toml: key 'auth_private_key': .*authentication needs TLS",
        ),
        (
            GOOD + "insecure = true\n",
            r"site\.toml: key 'insecure': got True; give exactly one of root_certificates .* and insecure = true",
        ),
        (GOOD.replace("superlink.example.org:8000", "https://superlink:8000"), r"site\.toml: key 'superlink': "),
        (
            GOOD.replace('client_id = "art_c0"', 'client_id = "b_c0"'),
            r"site\.toml: key 'site': .*has no shards/b_c0\.npz",
        ),
        (GOOD.replace('"state"', '"prepared/state"'), r"site\.toml: key 'state_dir': .*inside the site folder"),
        (GOOD + 'devise = "cpu"\n', r"site\.toml: key 'devise': unknown key"),
        (GOOD + 'device = "gpu"\n', r"site\.toml: key 'device': got 'gpu'"),
        (GOOD.replace('"art_c0"', '"art\\"c0"'), r"site\.toml: key 'client_id': .*double quote"),
        ("client_id = art_c0\n", r"site\.toml: not TOML"),
        (GOOD + "max_delta = 1e-5\n", r"site\.toml: key 'max_delta': .*give max_epsilon too"),
        (GOOD + "max_epsilon = 0\n", r"site\.toml: key 'max_epsilon': "),
        (GOOD + "max_study_epsilon = 9.0\n", r"site\.toml: key 'max_study_epsilon': .*give max_epsilon too"),
        (GOOD + "max_epsilon = nan\n", r"site\.toml: key 'max_epsilon': "),
    ],
    ids=[
        "missing-key",
        "wrong-type",
        "port-out-of-range",
        "missing-certificate",
        "missing-auth-key",
        "auth-without-tls",
        "tls-and-insecure",
        "url-prefix",
        "client-not-prepared",
        "state-inside-site",
        "unknown-key",
        "bad-device",
        "unquotable",
        "not-toml",
        "delta-without-epsilon",
        "zero-epsilon",
        "study-without-epsilon",
        "nan-epsilon",
    ],
)
def test_a_bad_join_config_is_refused_naming_the_file_and_key(site, text, match):
    with pytest.raises(DataError, match=match):
        load_site_config(_config(site, text))


def test_the_supernode_command_line_of_a_tls_site(site):
    (site / "keys").mkdir()
    (site / "keys" / "site_art").write_text("key")
    text = GOOD + 'auth_private_key = "keys/site_art"\nport = 9101\ndevice = "cpu"\n'
    cfg = load_site_config(_config(site, text))
    argv = supernode_argv(cfg, "/bin/flower-supernode")
    node = (
        f'client-id="art_c0" shards="{site}/prepared/shards" pools="{site}/prepared/pools" '
        f'state-dir="{site}/state" device="cpu"'
    )
    assert argv == [
        "/bin/flower-supernode",
        "--superlink",
        "superlink.example.org:8000",
        "--root-certificates",
        f"{site}/certs/ca.crt",
        "--auth-supernode-private-key",
        f"{site}/keys/site_art",
        "--port",
        "9101",
        "--node-config",
        node,
    ]
    from flwr.common.config import parse_config_args  # Flower's own reading of the flag

    assert parse_config_args([argv[-1]]) == {
        "client-id": "art_c0",
        "shards": f"{site}/prepared/shards",
        "pools": f"{site}/prepared/pools",
        "state-dir": f"{site}/state",
        "device": "cpu",
    }


def test_a_sites_privacy_ceiling_reaches_its_clientapp_as_numbers(site, not_private):
    """site.toml's max_epsilon / max_delta -> the SuperNode's --node-config -> Flower's reading of it -> the
    ClientApp's check (fedccrl_flower/site_ceiling.py), which refuses a run over the ceiling and admits one within."""
    from flwr.app import Context, RecordDict
    from flwr.common.config import parse_config_args

    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.privacy.settings import PrivacySettings
    from fedccrl_flower.site_ceiling import check_ceiling

    text = GOOD + "max_epsilon = 8\nmax_delta = 1e-6\nmax_study_epsilon = 20.5\n"
    node = parse_config_args([supernode_argv(load_site_config(_config(site, text)))[-1]])
    assert (node["max-epsilon"], node["max-delta"], node["max-study-epsilon"]) == (8.0, 1e-6, 20.5)
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})

    def local(**kw):
        return LocalConfig(privacy=PrivacySettings(enabled=True, noise_seed=1, **kw))

    check_ceiling(context, local(max_epsilon=8.0, delta=1e-6), "art_c0")
    with pytest.raises(ValueError, match="delta 1e-05 is over this site's max_epsilon 8 at delta <= 1e-06"):
        check_ceiling(context, local(max_epsilon=8.0), "art_c0")


def test_the_supernode_command_line_of_a_loopback_site_from_another_working_folder(site, monkeypatch):
    text = GOOD.replace('root_certificates = "certs/ca.crt"\n', "insecure = true\n")
    path = _config(site, text.replace('"prepared"', '"./prepared/"'))
    monkeypatch.chdir("/")
    argv = supernode_argv(load_site_config(path.relative_to("/")))
    node = f'client-id="art_c0" shards="{site}/prepared/shards" pools="{site}/prepared/pools" state-dir="{site}/state"'
    assert argv == [
        "flower-supernode",
        "--superlink",
        "superlink.example.org:8000",
        "--insecure",
        "--node-config",
        node,
    ]


def test_the_config_site_prepare_writes_reads_back(site):
    from fedccrl_flower.site_config import site_config_text

    cfg = SiteConfig(
        client_id="art_c0",
        site=str(site / "prepared"),
        state_dir=str(site / "state"),
        superlink="superlink.example.org:8000",
        root_certificates=str(site / "certs" / "ca.crt"),
        port=9101,
        max_epsilon=8.0,
    )
    text = site_config_text(cfg, site)
    assert 'site = "prepared"' in text and 'root_certificates = "certs/ca.crt"' in text and "insecure" not in text
    assert "max_epsilon = 8.0" in text and "max_delta" not in text
    assert load_site_config(_config(site, text)) == cfg


# ---------------------------------------------------------------- fedccrl site join
def _join(site: Path, bin_: Path, config: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    args = [sys.executable, "-m", "fedccrl_pipeline.cli", "site", "join", "--config", str(config)]
    return subprocess.Popen(args, cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_site_join_runs_flower_supernode_from_path_and_passes_its_exit_code(site):
    bin_ = _fake_supernode(site / "bin")
    config = _config(site, GOOD)
    proc = _join(site, bin_, config)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    argv = supernode_argv(load_site_config(config), str(bin_ / "flower-supernode"))
    assert json.loads((bin_ / "argv.json").read_text()) == argv[1:]
    assert f"site join: {bin_ / 'flower-supernode'} --superlink superlink.example.org:8000" in err
    assert "flower-supernode exited with code 3" in err


def test_site_join_says_what_the_site_admits_and_refuses_a_bad_ledger_before_starting(site):
    from fedccrl_flower.site_budget import LEDGER_FILE

    bin_ = _fake_supernode(site / "bin")
    config = _config(site, GOOD + "max_epsilon = 8.0\nmax_study_epsilon = 24.0\n")
    (site / "state").mkdir()
    line = '{"run_key": "r1", "client": "art_c0", "max_epsilon": 8.0, "delta": 1e-05}\n'
    (site / "state" / LEDGER_FILE).write_text(line)
    _, err = _join(site, bin_, config).communicate(timeout=60)
    assert (
        "site join: privacy: each run under train.privacy, at most max_epsilon 8 at delta <= 1e-05; 1 runs trained "
        f"in, max_epsilon 8 in all of max_study_epsilon 24 ({site / 'state' / LEDGER_FILE})"
    ) in err
    (bin_ / "argv.json").unlink()
    (site / "state" / LEDGER_FILE).write_text(line + "not json\n")
    proc = _join(site, bin_, config)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"key 'state_dir': {site / 'state' / LEDGER_FILE}: line 2 is not a run" in err
    assert not (bin_ / "argv.json").exists()


def test_site_join_passes_sigterm_on_and_exits_as_the_supernode_does(site):
    body = f"trap 'echo term > {site}/got; exit 7' TERM\ntouch {site}/ready\nwhile :; do sleep 0.1; done"
    bin_ = _fake_supernode(site / "bin", body)
    proc = _join(site, bin_, _config(site, GOOD))
    deadline = time.monotonic() + 60
    while not (site / "ready").exists() and time.monotonic() < deadline:  # its trap is set
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, err
    assert (site / "got").read_text().strip() == "term"


def test_site_join_refuses_a_bad_config_before_starting_anything(site):
    bin_ = _fake_supernode(site / "bin")
    proc = _join(site, bin_, _config(site, GOOD + "port = 'x'\n"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"error: {site / 'site.toml'}: key 'port': got 'x'" in err
    assert not (bin_ / "argv.json").exists()


def test_site_prepare_refuses_join_options_before_any_work(tmp_path, params):
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    _images(tmp_path / "img")
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    p = params({"dataset.name": "imagefolder", "preprocess.image_size": 8})
    args = ["site", "prepare", "--images", str(tmp_path / "img"), "--domain", "photo", "--client-id", "photo_c0"]
    args += ["--classes", str(tmp_path / "classes.txt"), "--params", str(p), "--out", str(tmp_path / "site")]
    join = ["--join-config", str(tmp_path / "site.toml"), "--superlink", "h:1"]
    for extra_args, match in [
        ([*join, "--root-certificates", str(tmp_path / "ca.crt")], "key 'root_certificates': .*ca.crt is not a file"),
        ([*join], "give exactly one of root_certificates"),
        (["--superlink", "h:1"], "--superlink belongs to the join config: give --join-config"),
        ([*join, "--insecure", "--max-delta", "1e-6"], "key 'max_delta': .*give max_epsilon too"),
        (
            ["--join-config", str(tmp_path / "site" / "site.toml"), "--superlink", "h:1", "--insecure"],
            "the same folder, or one inside the other",
        ),
    ]:
        res = CliRunner().invoke(main, [*args, *extra_args])
        assert res.exit_code == 2 and match.split(".*")[0] in res.output, res.output
        assert not (tmp_path / "site").exists() and not (tmp_path / "site.toml").exists()


def test_the_documented_site_config_runs_the_documented_supernode_command(tmp_path):
    """docs/flower.md: the `site.toml` of the TLS recipe gives the `flower-supernode` command printed under it (its
    relative paths and $PWD read from the config's folder), the one tests/test_flower_secure.py runs."""
    import re
    import shlex

    from doc_blocks import BLOCKS

    page = (REPO / "docs" / "flower.md").read_text()
    (toml,) = re.findall(r"```toml\n(.*?)```", page, flags=re.S)
    (doc,) = [b.code for b in BLOCKS if b.code.startswith("flower-supernode --superlink superlink.example.org")]
    for rel in ("prepared/shards/manifest.json", "prepared/shards/art_c0.npz", "prepared/pools/art_c0.npz"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    for rel in ("certs/ca.crt", "keys/site_art"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("pem")
    argv = supernode_argv(load_site_config(_config(tmp_path, toml)))
    documented = shlex.split(doc.replace("\\\n", " ").replace("$PWD", str(tmp_path)))
    for flag in ("--root-certificates", "--auth-supernode-private-key"):
        documented[documented.index(flag) + 1] = str(tmp_path / documented[documented.index(flag) + 1])
    assert argv == documented
