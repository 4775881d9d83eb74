"""Every fenced ```bash block of README.md and of the documentation pages runs, in one scratch clone: the
README's blocks in order, then each page's in the order of mkdocs.yml's `nav`, so the README's `make repro`
block runs first and every later block starts from its outputs.

One test per block; its id is the file and the line of the opening fence (`README.md:23`,
`docs/serving.md:11`). A block fails the test when any of its commands exits non-zero
(`set -eo pipefail`), and the failure names the block and the output's tail.

The clone. `git clone` of this repository into a temporary folder, plus the working tree's uncommitted
changes, so the test runs what a developer sees. `../shared` is linked beside it when present. Its
`.venv` mirrors the running interpreter's environment (each entry linked) with a fresh `.installed` stamp,
so `source .venv/bin/activate` and `make` use the installed environment and never pip-install; the
blocks run with that environment's bin first on PATH (its packages: this checkout's, installed editable), and with no
MLFLOW_TRACKING_URI, so MLflow uses the README's store (the clone's mlflow.db). After the `make repro`
block its dvc.lock is committed in the clone, and before each block params.yaml and dvc.lock are reset
to the committed ones and `dvc checkout` restores their outputs: each block is a recipe a reader runs
after `make repro` (the serve block reads its exports), not a continuation of the previous recipe's
`dvc exp run`, which leaves its params and outputs in the workspace.

Tiny scale. TINY below is written into the clone's params.yaml and committed, so that `make repro`,
`dvc repro`, `dvc exp run` (queued ones too, which start from the committed params) and the bench
commands all run 1 round of 1 local epoch of the small CNN at 32 px on one held-out domain.
SUBSTITUTIONS then rewrite what a block sets itself (a schedule, a sweep grid, seeds, a server that
never exits); each names its reason, and the test fails when one no longer matches any block, so the
table cannot go stale. Blocks that start `dvc queue start` are followed by a wait for the queue, and
fail when one of the queued experiments failed.

PACS. The PACS recipe (docs/experiments.md) downloads from the dataset registry (`dataset.source: registry`). Here
../shared/datasets/pacs/pacs_128.zip is served on 127.0.0.1 under the registry's file name and
FEDCCRL_DATASET_MIRROR points the download at it (fedccrl_core/data/sources.py). A block that uses PACS
skips with a stated reason when ../shared is absent, and fails instead when FEDCCRL_REQUIRE_SHARED=1.

Markers. A block that is not run carries, on the line above its fence, `<!-- ci: skip (reason) -->`,
and the reason is required. There is no other kind: the queued sweeps, the Flower rehearsal and the
benchmarks run in the default suite (.ci/run), made cheap by SUBSTITUTIONS. Each block prints its wall
seconds to stderr (`pytest -s` shows them).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from doc_blocks import BLOCKS, MARKER, REPO, Block, doc_files, nav_pages
from fixtures import write_params

from fedccrl_flower.processes import free_port

README = REPO / "README.md"
SHARED = Path(os.environ.get("FEDCCRL_SHARED", REPO.parent / "shared"))
REQUIRE_SHARED = os.environ.get("FEDCCRL_REQUIRE_SHARED") == "1"
BLOCK_TIMEOUT_S = 1200

# dotted params.yaml key -> value, committed in the clone (see the module docstring)
TINY = {
    "train.rounds": 1,
    "train.local_epochs": 1,
    "train.held_out": [3],
    "model.backbone": "small_cnn",
    "model.pretrained": "none",
    "preprocess.image_size": 32,
    "figures.tsne_points": 40,
    "figures.gradcam_images": 2,
    "figures.preview_images": 2,
}

# (block regex, replacement, reason); every regex must match at least one block
SUBSTITUTIONS = [
    (
        r"^make test(?![-\w]).*$",
        ": make test skipped",
        "the suite this test belongs to (CI runs it: .ci/run runs `make test-all`)",
    ),
    (
        r"^mlflow ui (.*?)\s*(#.*)?$",
        r"ci_serves mlflow ui \1 --port $CI_PORT",
        "a server never exits: start it, wait until it answers on a free port, stop it",
    ),
    (r"train\.local_epochs=3", "train.local_epochs=1", "the paper's 3 local epochs: 1 is enough to run"),
    (
        r"'train\.algorithms=\[fedavg,fedprox[^\]]*\]'",
        "'train.algorithms=[fedavg,fedccrl]'",
        "the 12 algorithms of Table 1: two run the same commands",
    ),
    (
        r"'train\.algorithms=\[fedavg,fedccrl,fedomg,fedccrl_omg\]'",
        "'train.algorithms=[fedomg,fedccrl_omg]'",
        "FedOMG's page: its two algorithms run the same commands as the four (a list, not a sweep grid)",
    ),
    (r"'train\.seeds=\[0,1,2\]'", "'train.seeds=[0]'", "3 seeds: one runs the same commands"),
    (r"--seeds 0,1,2", "--seeds 0", "3 seeds: one runs the same commands"),
    (
        r"^dvc exp run --queue -S 'train\.fedccrl\.r=[^']*'$",
        ": the r sweep is not queued in CI",
        "Figure 6's r grid: a one-key grid of train.fedccrl, the command form of the Figure 4 line above it and "
        "of the lambda line below it (each queued experiment costs 1-2 minutes on 2 shared cores)",
    ),
    (
        r"(-S 'train\.fedccrl\.\w+=)([^,'\s]+),[^'\s]+'",
        r"\1\2'",
        "Figure 6's lambda1 x lambda2 grid: its first values run the same command",
    ),
    (
        r"'partition\.lambda=1,0\.1,0'",
        "partition.lambda=1",
        "FedDG-Bench's lambda grid: one value runs the same command",
    ),
    (
        r"^dvc exp run --queue -S partition\.scheme=feddg_bench -S partition\.lambda=0 .*$",
        ": the client counts at lambda 0 are not queued in CI",
        "FedDG-Bench's client counts at lambda 0: the line above's command with other partition values (every "
        "lambda's partition: tests/test_feddg_bench_partition.py); the queue still runs the line above's experiment",
    ),
    (
        r"'partition\.clients_per_domain=1,2,3,4'",
        "partition.clients_per_domain=1",
        "Figure 4's client counts: one (a new partition, its pools and both algorithms) runs the same command; a "
        "value grid of `dvc exp run -S` is DVC's own (each of its experiments is a run like this one)",
    ),
    (r"for c in ccdt difp l_ra l_js;", "for c in l_js;", "Table 2's four switches: one runs the same loop"),
    (
        r"^make (bench-accuracy|bench-table1)\b",
        r"make \1 TABLE_ALGORITHMS=fedavg,fedccrl",
        "the 12 algorithms of Table 1: two run the same recipe",
    ),
    (
        r"^fedccrl-bench scale(?=\s+#)",
        "fedccrl-bench scale --clients 6,30",
        "4 client counts: two give the ratio to 6 clients the same way",
    ),
    (
        r"fedccrl-bench scale\b",
        "fedccrl-bench scale --total 960 --rounds 1",
        "3840 images and 2 rounds per client count: 960 and 1 run the same bench",
    ),
    (
        r"^fedccrl-bench repro$",
        "fedccrl-bench repro --thread-steps 10",
        "40 steps per thread-policy measurement: 10 run the same measurement",
    ),
    (
        r"fedccrl-bench threads --steps 40 --repeats 2",
        "fedccrl-bench threads --steps 10 --repeats 1",
        "40 steps, best of 2: 10 steps once run the same measurement",
    ),
    (
        r"scripts/privacy_tradeoff\.py --epsilons inf,8,1 --seeds 0 ",
        "scripts/privacy_tradeoff.py --rounds 1 --epsilons inf,8 --seeds 0 ",
        "10 rounds at 3 epsilons: one round at no DP and at epsilon 8 runs every configuration the same way",
    ),
    (
        r"fedccrl_benchmarks\.fedomg_step --clients 6,120",
        "fedccrl_benchmarks.fedomg_step --clients 6,12",
        "120 clients (MobileNetV3: minutes of local steps): 12 give the ratio to 6 clients the same way",
    ),
    (
        r"(dvc exp run -S train\.engine=flower -S train\.flower\.mode=deployment) ",
        r"\1 -S partition.clients_per_domain=1 -S 'train.algorithms=[fedccrl]' ",
        "six SuperNodes (2 clients per source domain): three run the same deployment; the train stage of each "
        "algorithm starts its own federation: FedCCRL's (every message kind, its statistics on the wire) runs it",
    ),
    (
        r"^make bench(?=\s+#)",
        "make -n bench",
        "the block's next line runs the same bench (fedccrl-bench speed at 32 px, one thread) at the sizes of the "
        "table below: `make -n` checks the target's command, the line below runs it",
    ),
]

NUM = r"(\d+(?:\.\d+)?)"


def fig(name: str) -> str:
    """A printed figure, captured under `name` for a claim of BENCH_OUTPUTS."""
    return rf"(?P<{name}>\d+(?:\.\d+)?)"


# (command in a block, [what its output must show], [claims]): a benchmark block passes on what it printed, not on
# its exit code alone. Each regex must match the block's stdout + stderr; every number a regex captures (the
# measured figures and their ratios) must be finite and positive. A claim (ratio, numerator, denominator, factor)
# names captured figures: the printed ratio must be factor x numerator / denominator of the printed figures, within
# their rounding (half a unit of each one's last printed digit).
BENCH_OUTPUTS = [
    (
        r"^fedccrl-bench repro\b",
        [
            rf"^everything but training: {fig('share')} % of dvc repro's wall \({fig('other')}s of {fig('wall')}s; "
            rf"training {NUM}s",
            rf"^dvc repro of the default, from scratch: wall {NUM}s  cpu {NUM}s",
            *[rf"^  {stage:<10} +\d+ +{NUM} +{NUM} +[\d.]+$" for stage in ("download", "train", "evaluate", "figures")],
            rf"^after figures\.seed=\d+: dvc repro {fig('fig_s')}s = {fig('fig_share')} % of the full one; "
            r".*stages run: figures$",
            rf"^after export\.batch_size=\d+: dvc repro {fig('exp_s')}s = {fig('exp_share')} % of the full one; "
            r"stages run: export$",
            rf"spin / passive wall {fig('spin_ratio')}x cpu {NUM}x \(spin {fig('spin')}s, passive {fig('passive')}s\)",
        ],
        [
            ("share", "other", "wall", 100),
            ("fig_share", "fig_s", "wall", 100),
            ("exp_share", "exp_s", "wall", 100),
            ("spin_ratio", "spin", "passive", 1),
        ],
    ),
    (
        r"^fedccrl-bench threads\b",
        [
            rf"^  spin +\(OMP_WAIT_POLICY=ACTIVE\): +wall {fig('sw')}s  cpu {fig('sc')}s$",
            rf"^  passive \(project policy\): +wall {fig('pw')}s  cpu {fig('pc')}s$",
            rf"^  spin / passive: wall {fig('wall')}x  cpu {fig('cpu')}x$",
        ],
        [("wall", "sw", "pw", 1), ("cpu", "sc", "pc", 1)],
    ),
    (
        r"scripts/privacy_tradeoff\.py\b",
        [
            rf"^\| FedCCRL, both channels \(rows\) \| 8 \| {NUM} \| {NUM} \| {NUM} ± [\d.]+ \| [\d.]+ ± [\d.]+ \| "
            rf"{NUM} ± [\d.]+ \| {NUM} \|$",
            rf"^\| FedCCRL, both channels \(moments\) \| 8 \| {NUM} \| {NUM} \| {NUM} ± [\d.]+ \| [\d.]+ ± [\d.]+ \| "
            rf"{NUM} ± [\d.]+ \| {NUM} \|$",
            rf"^\| FedAvg, weights \| ∞ \| 0\.00 \| 0\.00 \| {NUM} ± [\d.]+ \| - \| - \| ∞ \|$",
        ],
        [],
    ),
    (
        r"^(make bench-accuracy|.*fedccrl-bench accuracy)\b",
        [
            r"^final-round target accuracy \(%\), mean ± std over seeds",
            rf"^\| (fedccrl|fedomg)[^|]* \|(?: {NUM} ± [\d.]+ \|)+ {NUM} \|$",
        ],
        [],
    ),  # FedCCRL's row, or FedOMG's (its page)
    (r"^make bench-table1\b", [rf"^\| fedccrl \|(?: {NUM} \|)+$", rf"^\| fedavg \|(?: {NUM} \|)+$"], []),
    (
        r"^(make bench(?![-\w])|fedccrl-bench speed --size)",
        [
            rf"^\| FedCCRL local step on client 0, source images/s \| {fig('fast_ips')} \| {fig('plain_ips')} \|",
            rf"^\| peak RSS of the child process, MiB \| {fig('fast_rss')} \| [\d.]+ \| {fig('pps_rss')} \|",
            rf"^ratio fast/plain, FedCCRL local step on client 0, source images/s: {fig('ips')}$",
            rf"^ratio fast/plain_per_sample, peak RSS of the child process, MiB: {fig('rss')}$",
        ],
        [("ips", "fast_ips", "plain_ips", 1), ("rss", "fast_rss", "pps_rss", 1)],
    ),
    (
        r"^fedccrl-bench int8\b",
        [
            rf"^ratio int8/float32, small_cnn: file size {NUM}x  batch-32 images/s {NUM}x  batch-1 latency {NUM}x",
            rf"^ratio int8/float32, mobilenet_v3_large: file size {fig('rs')}x  batch-32 images/s {fig('ri')}x  "
            rf"batch-1 latency {NUM}x",
            rf"^\| mobilenet_v3_large \| \d+ px \| random, seed 0 \| float32 \| {fig('fs')} \| {NUM} \| {fig('fi')} \| "
            r"[\d.]+ \|$",
            rf"^\| mobilenet_v3_large \| \d+ px \| random, seed 0 \| int8 \| {fig('qs')} \| {NUM} \| {fig('qi')} \| "
            r"[\d.]+ \|$",
            r"^target on mobilenet_v3_large: images/s at batch 32 >= 2x \((met|not met): [\d.]+x\), size <= 1/3",
            r"^time by operator at batch 32, mobilenet_v3_large int8: \w+ \d+ %",
        ],
        [("rs", "qs", "fs", 1), ("ri", "qi", "fi", 1)],  # int8/float32 of the printed sizes and images/s
    ),
    (
        r"^fedccrl-bench deploy-round\b",
        [
            rf"^\| inprocess \| {NUM} \| {NUM} \| {fig('ip')} \| 1\.0x \|$",
            rf"^\| flower \| {NUM} \| {NUM} \| {fig('fl')} \| {fig('ratio')}x \|$",
            rf"^ClientApp start-up: a fresh interpreter importing fedccrl_flower\.client_app {fig('start')} s, torch alone "
            rf"{NUM} s, a bare one {NUM} s$",
            rf"^a round starts {fig('n')} ClientApp processes .*: {fig('total')} s of start-up = {fig('share')}x the "
            r"in-process round$",
        ],
        [("ratio", "fl", "ip", 1), ("share", "total", "ip", 1)],
    ),
    (
        r"^fedccrl-bench scale\b",
        [
            rf"^\| fedavg \| 6 \| {fig('s6')} \| 1\.00 \| {NUM} \| 1\.00 \|",
            rf"^\| fedavg \| (?!6 )\d+ \| {fig('sk')} \| {fig('xk')} \|",
        ],
        [("xk", "sk", "s6", 1)],
    ),
]


def _printed(text: str) -> tuple[float, float]:
    """A printed figure and half a unit of its last digit (its rounding)."""
    decimals = len(text.partition(".")[2])
    return float(text), 0.5 * 10.0**-decimals


def claim_problem(figures: dict[str, str], ratio: str, num: str, den: str, factor: float) -> str | None:
    """Why the printed `ratio` is not factor x num / den of the printed figures within their rounding (None if it is)."""
    (r, er), (n, en), (d, ed) = (_printed(figures[k]) for k in (ratio, num, den))
    lo = factor * (n - en) / (d + ed) - er
    hi = factor * (n + en) / (d - ed) + er if d > ed else float("inf")
    if lo <= r <= hi:
        return None
    return f"{ratio} {figures[ratio]} is not {factor:g} x {num} {figures[num]} / {den} {figures[den]} (within rounding)"


def check_bench_output(code: str, out: str) -> list[str]:
    """What is wrong with a block's output under BENCH_OUTPUTS (empty when the block runs no benchmark)."""
    problems = []
    for command, patterns, claims in BENCH_OUTPUTS:
        if not re.search(command, code, flags=re.M):
            continue
        figures: dict[str, str] = {}
        for pattern in patterns:
            m = re.search(pattern, out, flags=re.M)
            if m is None:
                problems.append(f"{command}: no line matches {pattern!r}")
                continue
            figures |= m.groupdict()
            bad = [g for g in m.groups() if g is not None and re.fullmatch(r"[\d.]+", g) and not float(g) > 0]
            if bad:
                problems.append(f"{command}: {m[0]!r} has figures that are not positive: {bad}")
        for claim in claims:
            if all(figures.get(k) for k in claim[:3]):
                problem = claim_problem(figures, *claim)
                if problem:
                    problems.append(f"{command}: {problem}")
    if any(re.search(c, code, flags=re.M) for c, _, _ in BENCH_OUTPUTS):
        problems += [
            f"a figure is not finite: {line!r}"
            for line in out.splitlines()
            if re.search(r"\b(nan|inf)\b", line, flags=re.I)
        ]
    return problems


# bash prelude of every block: `ci_serves CMD...` runs a server in its own process group until
# http://127.0.0.1:$CI_PORT/ answers (at most 180 s), then stops the group
PRELUDE = r"""set -eo pipefail
ci_serves() {
  setsid "$@" > .ci_server.log 2>&1 &
  local pid=$! ok=1
  for _ in $(seq 180); do
    if python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$CI_PORT/', timeout=5)" 2>/dev/null
    then ok=0; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  kill -TERM -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  if [ "$ok" != 0 ]; then echo "ci_serves: $* never answered on port $CI_PORT" >&2; tail -20 .ci_server.log >&2; fi
  return "$ok"
}
"""


def ci_code(code: str) -> str:
    for pattern, repl, _ in SUBSTITUTIONS:
        code = re.sub(pattern, repl, code, flags=re.M)
    return code


# ------------------------------------------------------------------ the marker and substitution rules
def test_blocks_start_with_the_readme_make_repro_and_cover_the_docs():
    assert BLOCKS[0].source == "README.md" and re.search(r"^make repro\b", BLOCKS[0].code, flags=re.M), BLOCKS[0]
    assert any(b.source.startswith("docs/") for b in BLOCKS), "no block collected from the documentation pages"
    assert nav_pages([{"A": "a.md"}, {"B": [{"C": "b/c.md"}, "d.md"]}, "e.md"]) == ["a.md", "b/c.md", "d.md", "e.md"]


def test_markers_name_a_kind_and_a_reason():
    for rel in doc_files():
        for n, line in enumerate((REPO / rel).read_text().splitlines(), 1):
            if "<!-- ci:" in line or "<!--ci:" in line:
                m = MARKER.search(line)
                assert m and m["kind"] == "skip", f"{rel}:{n}: marker {line.strip()!r}: the one kind is skip"
                assert m["reason"] and m["reason"].strip(), f"{rel}:{n}: marker {line.strip()!r} gives no reason"
    marked = [b for b in BLOCKS if b.marker == "skip"]
    assert len(marked) <= len(BLOCKS) // 4, f"{len(marked)} of {len(BLOCKS)} blocks are skipped: keep them few"


def test_every_substitution_matches_a_block():
    codes = [b.code for b in BLOCKS if b.marker != "skip"]
    for pattern, repl, reason in SUBSTITUTIONS:  # in order, as ci_code applies them
        assert any(re.search(pattern, c, flags=re.M) for c in codes), (
            f"substitution {pattern!r} ({reason}) matches no block of README.md or docs/: remove it or update it"
        )
        codes = [re.sub(pattern, repl, c, flags=re.M) for c in codes]


def test_sweep_grid_substitutions_keep_a_value_of_each_grid():
    grid = "-S 'partition.clients_per_domain=1,2,3,4' -S 'train.algorithms=[fedccrl,fedavg]'"
    assert ci_code(grid) == "-S partition.clients_per_domain=1 -S 'train.algorithms=[fedccrl,fedavg]'"
    grid = "-S 'train.fedccrl.lambda1=0,0.01,0.1,1' -S 'train.fedccrl.lambda2=0,0.01,0.1,1'"
    assert ci_code(grid) == "-S 'train.fedccrl.lambda1=0' -S 'train.fedccrl.lambda2=0'"


# ------------------------------------------------------------------ the clone
def _git(*args, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _mirror_venv(dest: Path) -> None:
    """dest/.venv: every entry of the running environment linked, and a fresh `.installed` stamp."""
    dest.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed":
            (dest / entry.name).symlink_to(entry)
    (dest / ".installed").touch()


@pytest.fixture(scope="module")
def mirror():
    """PACS: ../shared/datasets/pacs/pacs_128.zip served on 127.0.0.1 under the registry's file name."""
    from fedccrl_core.data.registry import get_dataset

    pacs = SHARED / "datasets" / "pacs" / "pacs_128.zip"
    if not pacs.is_file():
        yield None
        return
    import tempfile

    with tempfile.TemporaryDirectory() as served:
        for src in get_dataset("pacs").sources:
            (Path(served) / src.filename).symlink_to(pacs)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=served))
        t = threading.Thread(target=httpd.serve_forever, daemon=True)
        t.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror):
    top = tmp_path_factory.mktemp("readme")
    dest = top / "fedccrl"
    _git("clone", "-q", str(REPO), str(dest), cwd=top)
    for rel in _git("ls-files", "-m", "-o", "--exclude-standard", "-z", cwd=REPO).split("\0"):
        if rel and (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    for rel in _git("ls-files", "-d", "-z", cwd=REPO).split("\0"):
        if rel:
            (dest / rel).unlink(missing_ok=True)
    if SHARED.is_dir():
        (top / "shared").symlink_to(SHARED)
    write_params(dest, TINY)  # the clone's params.yaml is the checkout's, copied above
    _git(
        "-c",
        "user.name=ci",
        "-c",
        "user.email=ci@localhost",
        "commit",
        "-qam",
        "CI: tiny scale",
        "--allow-empty",
        cwd=dest,
    )
    _mirror_venv(dest / ".venv")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_TRACKING_URI", "FEDCCRL_MLFLOW_ARTIFACTS", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST")
    }
    env.update(
        PATH=f"{dest / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        GIT_AUTHOR_NAME="ci",
        GIT_AUTHOR_EMAIL="ci@localhost",
        GIT_COMMITTER_NAME="ci",
        GIT_COMMITTER_EMAIL="ci@localhost",
    )
    if mirror:
        env["FEDCCRL_DATASET_MIRROR"] = mirror
    yield dest, env
    subprocess.run(["dvc", "queue", "stop", "--kill"], cwd=dest, env=env, capture_output=True)  # no worker outlives it


def _wait_for_queue(dest: Path, env: dict, deadline: float) -> str:
    """Wait until `dvc queue status` lists nothing queued or running; return its last output."""
    while True:
        out = subprocess.run(["dvc", "queue", "status"], cwd=dest, env=env, capture_output=True, text=True).stdout
        if not re.search(r"\b(Queued|Running)\b", out) or time.monotonic() > deadline:
            return out
        time.sleep(5)


def _run_block(code: str, dest: Path, env: dict) -> subprocess.CompletedProcess:
    """bash -c PRELUDE + code in its own process group, killed whole past BLOCK_TIMEOUT_S."""
    p = subprocess.Popen(
        ["bash", "-c", PRELUDE + code],
        cwd=dest,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        err += f"\n(killed after {BLOCK_TIMEOUT_S}s)"
    except BaseException:  # Ctrl-C: no block outlives the test
        os.killpg(p.pid, 9)
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _uses_pacs(code: str) -> bool:
    return "dataset.name=pacs" in code


def test_bench_output_checks_fail_on_a_missing_line_or_a_figure_that_is_not_finite():
    threads = "fedccrl-bench threads --steps 10 --repeats 1"
    good = (
        "thread policy, 10 small-CNN steps\n  spin    (OMP_WAIT_POLICY=ACTIVE):  wall 2.78s  cpu 4.38s\n"
        "  passive (project policy):          wall 2.00s  cpu 2.00s\n  spin / passive: wall 1.39x  cpu 2.19x\n"
    )
    assert check_bench_output(threads, good) == []
    assert check_bench_output("echo hi", "") == []  # not a benchmark: nothing to check
    assert check_bench_output(threads, good.replace("1.39x", "nanx"))  # the line no longer matches
    assert check_bench_output(threads, good.replace("1.39x", "0.00x"))  # a ratio of zero is no measurement
    assert check_bench_output(threads, good + "step time: inf\n")  # any nan or inf in a bench's output
    assert check_bench_output(threads, "")  # it printed nothing
    acc = "make bench-accuracy TABLE_ALGORITHMS=fedavg,fedccrl"
    table = (
        "final-round target accuracy (%), mean ± std over seeds [0], 12s in all\n| Algorithm | sketch | Avg. |\n"
        "|---|---|---|\n| fedccrl | 41.25 ± 0.00 | 41.25 |\n| fedavg | 30.00 ± 0.00 | 30.00 |\n"
    )
    assert check_bench_output(acc, table) == []
    assert check_bench_output(acc, table.replace("| fedccrl |", "| fedavg |"))  # no FedCCRL row


def test_a_ratio_must_be_the_ratio_of_the_printed_figures():
    """A bench line's ratio is checked against the figures it is the ratio of, within their rounding: a ratio
    that is not theirs (a swapped pair, another run's figure) fails, one off by its rounding alone passes."""
    threads = "fedccrl-bench threads --steps 10 --repeats 1"
    good = (
        "  spin    (OMP_WAIT_POLICY=ACTIVE):  wall 2.78s  cpu 4.38s\n"
        "  passive (project policy):          wall 2.00s  cpu 2.00s\n  spin / passive: wall 1.39x  cpu 2.19x\n"
    )
    assert check_bench_output(threads, good) == []
    assert check_bench_output(threads, good.replace("wall 1.39x", "wall 1.40x")) == []  # 2.785 / 1.995 rounds so
    (problem,) = check_bench_output(threads, good.replace("wall 1.39x", "wall 0.72x"))  # passive / spin
    assert "wall 0.72 is not 1 x sw 2.78 / pw 2.00" in problem
    assert check_bench_output(threads, good.replace("cpu 2.19x", "cpu 1.39x"))
    scale = "fedccrl-bench scale --clients 6,30"
    rows = "| fedavg | 6 | 0.50 | 1.00 | 0.40 | 1.00 |\n| fedavg | 30 | 1.50 | 3.00 | 1.20 | 3.00 |\n"
    assert check_bench_output(scale, rows) == []
    assert check_bench_output(scale, rows.replace("| 1.50 | 3.00 |", "| 1.50 | 2.00 |"))
    repro = "fedccrl-bench repro --thread-steps 10"
    out = (
        "everything but training: 40.0 % of dvc repro's wall (20.0s of 50.0s; training 30.0s; target at most 50 %: met)\n"
        "dvc repro of the default, from scratch: wall 50.0s  cpu 60.0s  (2 cores, load average 1.00 at the end)\n"
        + "".join(
            f"  {st:<10} {1:>5} {10.0:>8.1f} {1.0:>10.1f} {0.5:>7.1f}\n"
            for st in ("download", "train", "evaluate", "figures")
        )
        + "after figures.seed=1: dvc repro 5.0s = 10.0 % of the full one; target at most 20 %: met; stages run: figures\n"
        "after export.batch_size=8: dvc repro 2.5s = 5.0 % of the full one; stages run: export\n"
        "thread policy, a busy process sharing the cores: spin / passive wall 1.50x cpu 2.00x (spin 3.00s, passive 2.00s)\n"
    )
    assert check_bench_output(repro, out) == []
    assert check_bench_output(repro, out.replace("40.0 %", "60.0 %"))  # training's share, not the rest's
    assert check_bench_output(repro, out.replace("= 10.0 %", "= 1.0 %"))


@pytest.mark.full(
    "each README and docs block runs in a scratch clone: the pipeline, queued sweeps, Flower, the benches"
)
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 300)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, clone, mirror):
    if block.marker == "skip":
        pytest.skip(f"{block.id}: ci: skip ({block.reason})")
    if _uses_pacs(block.code) and mirror is None:
        msg = f"{block.id} downloads PACS: needs {SHARED}/datasets/pacs/pacs_128.zip (absent in a user's clone)"
        if REQUIRE_SHARED:
            pytest.fail(f"FEDCCRL_REQUIRE_SHARED=1 but {msg}")
        pytest.skip(msg)
    dest, env = clone
    _git("checkout", "--", "params.yaml", cwd=dest)
    if _git("ls-files", "dvc.lock", cwd=dest).strip():  # back to `make repro`'s outputs
        _git("checkout", "--", "dvc.lock", cwd=dest)
        subprocess.run(["dvc", "checkout", "--force", "--quiet"], cwd=dest, env=env, check=True, capture_output=True)
    code = ci_code(block.code)
    t0 = time.monotonic()
    try:
        proc = _run_block(code, dest, {**env, "CI_PORT": str(free_port())})
    finally:
        print(f"\n{block.id}: block ran {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{block.id}: block failed with exit code {proc.returncode} after "
        f"{time.monotonic() - t0:.0f}s\n--- as run ---\n{code}\n--- stderr tail ---\n{proc.stderr[-3000:]}\n"
        f"--- stdout tail ---\n{proc.stdout[-1500:]}"
    )
    if re.search(r"^make repro\b", code, flags=re.M):  # the state every later block starts from
        _git("add", "dvc.lock", cwd=dest)
        _git(
            "-c",
            "user.name=ci",
            "-c",
            "user.email=ci@localhost",
            "commit",
            "-qm",
            "CI: make repro's dvc.lock",
            cwd=dest,
        )
    if "dvc queue start" in code:
        status = _wait_for_queue(dest, env, time.monotonic() + BLOCK_TIMEOUT_S)
        assert not re.search(r"\b(Queued|Running)\b", status), f"{block.id}: queue still busy:\n{status}"
        assert "Failed" not in status, f"{block.id}: a queued experiment failed:\n{status}"
    if _uses_pacs(block.code):
        import json

        rep = json.loads((dest / "data" / "reports" / "download.json").read_text())
        arch = rep["source"]["archives"][0]
        assert rep["source"]["kind"] == "registry" and arch["url"].startswith(mirror), rep["source"]
        assert arch["verified"] and arch["known_as"] == "pacs_128.zip" and rep["total"] == 9991
    if "-S dataset.name=imagefolder" in block.code:  # an experiment of the research pipeline on the tree it wrote
        import json

        rep = json.loads((dest / "data" / "reports" / "download.json").read_text())
        tree = Path(rep["source"]["path"])
        assert rep["source"]["kind"] == "folder" and tree.is_relative_to(dest), rep["source"]
        assert rep["domains"] == sorted(p.name for p in tree.iterdir() if p.is_dir())
        assert rep["total"] == sum(1 for p in tree.rglob("*") if p.is_file())
    assert "Traceback (most recent call last)" not in out, f"{block.id}: a traceback:\n{out[-3000:]}"
    problems = check_bench_output(code, out)
    assert not problems, f"{block.id}: " + "; ".join(problems) + f"\n--- output tail ---\n{out[-3000:]}"
