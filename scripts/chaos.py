"""`make chaos`: the fault suite, one row per fault.

A tiny experiment (the embedded synthetic data, K=1 client per domain, fedavg, 2 rounds of 1 local epoch,
held-out domains 0 and 3, so `fedccrl train` runs two spawned workers) is set up in a temporary DVC
workspace and run once uninterrupted: that run is the reference. Then each fault is injected into a fresh
run and the run is repeated the way a user would (the same command again), and the row reports:

  outcome            the recovery command's exit code and the notice it gave (resumed, fell back, healed, ...)
  orphans            processes of the faulted run still alive 5 s after the kill: the PID tree taken (psutil)
                     just before the kill, plus every process carrying the fault's CHAOS_TOKEN environment
  temps left         fsio temporary paths (.<name>.tmp-<pid>-<token>) anywhere in the workspace after recovery
  data lost          rounds missing from the recovered history or from the MLflow metric history
  metrics identical  the recovered run's per-round metrics against the reference run's (evaluate, export, figures:
                     the files the stage writes, each stage's own reference run)
  mlflow             the fault's MLflow run statuses after the kill -> after recovery (FINISHED expected)

Faults are injected at exact points by scripts/chaos_hooks/sitecustomize.py (the process reaching the
point holds still; this script then kills its target), or, for the stages after training, at a share of the
stage's own reference run time (timed alone first). Every wait has a deadline. Usage:

  python scripts/chaos.py [--only NAME,...] [--keep] [--workspace DIR]

(--workspace with a kept workspace reuses its reference run, after a `dvc repro` that restores it.)

Exit code 0 when every row reads clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import yaml

from fedccrl_core.foundation.temp_paths import TEMP_RE
from fedccrl_pipeline.params_yaml import set_key

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
HOOKS = Path(__file__).resolve().parent / "chaos_hooks"
ALGORITHM, SEED = "fedavg", 0
TINY = {
    "partition.clients_per_domain": 1,
    "train.rounds": 2,
    "train.local_epochs": 1,
    "train.held_out": [0, 3],
    "train.algorithms": [ALGORITHM],
    "train.seeds": [SEED],
    "train.flower.client_threads": 1,
    "figures.tsne_points": 60,
    "figures.preview_images": 2,
    "figures.gradcam_images": 2,
}
STABLE = ("round", "val_acc", "target_acc", "loss", "train_acc", "lr", "bytes_up", "bytes_down")  # not seconds
TRAIN_ARGS = [
    "train",
    "--shards",
    "data/shards",
    "--pools",
    "data/pools",
    "--algorithm",
    ALGORITHM,
    "--seed",
    str(SEED),
]


def say(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the workspace and the reference run
def write_params(path: Path, **overrides) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in {**TINY, **overrides}.items():
        set_key(params, dotted, value)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def env_for(ws: Path, db: Path, hook: str = "", fault_dir: Path | None = None, token: str = "") -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # the installed packages
    if hook:  # the fault-injection hook, copied out of the repository: Python imports its sitecustomize.py at start-up
        assert fault_dir is not None, "a hook writes into its fault folder"
        hooks = fault_dir / "hooks"
        hooks.mkdir(parents=True, exist_ok=True)
        shutil.copy2(HOOKS / "sitecustomize.py", hooks / "sitecustomize.py")
        env["PYTHONPATH"] = str(hooks)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{db}"
    env["DVC_NO_ANALYTICS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("CHAOS_HOOK", None)
    if hook:
        env.update(CHAOS_HOOK=hook, CHAOS_DIR=str(fault_dir))
    if token:
        env["CHAOS_TOKEN"] = token
    return env


def run(args: list[str], ws: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ws, env=env, capture_output=True, text=True, timeout=timeout)


def setup(ws: Path) -> None:
    ws.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dvc.yaml", ws / "dvc.yaml")
    for code in ("fedccrl_core", "fedccrl_flower", "serving", "pipeline"):
        (ws / code).symlink_to(REPO / code)
    write_params(ws / "params.yaml")
    env = env_for(ws, ws / "mlflow.db")
    for args in (["dvc", "init", "--no-scm", "-q"], ["dvc", "repro"]):
        t0 = time.perf_counter()
        p = run(args, ws, env)
        if p.returncode != 0:
            raise SystemExit(f"chaos: reference `{' '.join(args)}` failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        say(f"reference `{' '.join(args)}`: {time.perf_counter() - t0:.0f}s")


def rounds(run_dir: Path) -> list[dict]:
    doc = json.loads((run_dir / "history.json").read_text())
    return [{k: v for k, v in r.items() if k in STABLE or k.startswith(("l_", "train_acc/"))} for r in doc["rounds"]]


# ---------------------------------------------------------------- observing a fault
def tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tokened(token: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("CHAOS_TOKEN") == token and alive(p):
                out.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def orphans_after(snapshot: list[psutil.Process], token: str, wait_s: float = 5.0) -> list[str]:
    """What is still running of the faulted run `wait_s` after its kill (PDEATHSIG needs a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {p.pid: p for p in snapshot if alive(p)}
        left.update({p.pid: p for p in tokened(token)})
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = []
    for p in left.values():
        try:
            names.append(f"{p.pid}:{p.name()}")
        except psutil.NoSuchProcess:
            continue
        try:
            p.kill()  # our own leftovers: this run's processes, by pid
        except psutil.NoSuchProcess:
            pass
    return names


def temps(root: Path, own: Path) -> list[str]:
    """fsio temporary paths in the workspace (of the other faults' folders, none: they are not this fault's)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in (".dvc", "fedccrl_core", "fedccrl_flower", "serving", "pipeline")
            and (Path(dirpath) != root / "faults" or d == own.name)
        ]
        found += [os.path.join(dirpath, n) for n in dirnames + filenames if TEMP_RE.match(n)]
    return sorted(os.path.relpath(f, root) for f in found)


def statuses(db: Path) -> list[str]:
    """The child runs' statuses (a fresh sqlite connection: no MLflow client caches)."""
    if not db.is_file():
        return []
    with sqlite3.connect(db) as con:
        return sorted(
            s
            for (s,) in con.execute(
                "select r.status from runs r join tags t on t.run_uuid = r.run_uuid "
                "where t.key = 'fedccrl.role' and t.value = 'child'"
            )
        )


def mlflow_steps(db: Path) -> dict[str, dict[int, float]]:
    """Per child run (by held-out tag): target_acc per step, the last value logged for each step."""
    if not db.is_file():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "select t.value, m.step, m.value from metrics m join tags t on t.run_uuid = m.run_uuid "
            "where m.key = 'target_acc' and t.key = 'held_out' order by m.timestamp"
        ).fetchall()
    out: dict[str, dict[int, float]] = {}
    for held_out, step, value in rows:
        out.setdefault(held_out, {})[int(step)] = value
    return out


def start_and_kill(
    args: list[str],
    ws: Path,
    env: dict,
    fault_dir: Path,
    sig: int = signal.SIGKILL,
    timeout: float = 600,
    after_s: float | None = None,
):
    """Start the faulted command; when a process reaches the fault point (or, with `after_s`, that many seconds
    after the start), snapshot the command's PID tree and send `sig` to the command's own process (`fedccrl train`,
    `dvc repro`, a `fedccrl` stage). Its output goes to a file, not a pipe: a process it left behind cannot hold
    this script's read open. Every wait has a deadline."""
    trigger = fault_dir / "trigger"
    log_path = fault_dir / "command.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=ws, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    deadline = started + timeout
    output = lambda: log_path.read_text(errors="replace")  # noqa: E731
    while not (trigger.is_file() if after_s is None else time.monotonic() - started >= after_s):
        if (fault_dir / "hook-error").is_file():
            proc.kill()
            proc.wait(timeout=30)
            return None, [], f"fault hook failed: {(fault_dir / 'hook-error').read_text().strip()}"
        if proc.poll() is not None:
            return None, [], f"fault not injected: the command ended ({proc.returncode}) first:\n{output()[-2000:]}"
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=30)
            return None, [], "fault not injected: timeout"
        time.sleep(0.05)
    if after_s is None:
        time.sleep(0.2)  # the holder has written its pid; let it settle at the point
    snapshot = tree(proc.pid)
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, snapshot, output()


# ---------------------------------------------------------------- the faults
class Fault:
    def __init__(self, name: str, hook: str, kill: str, what: str, at: float | None = None):
        self.name, self.hook, self.kill, self.what, self.at = name, hook, kill, what, at


# the stages after training, each killed as a command of its own: (its command, the folder it writes)
STAGES = {
    "evaluate": (
        ["fedccrl", "evaluate", "--shards", "data/shards", "--models", "models", "--out", "results/runs"],
        "results/runs",
    ),
    "export": (
        [
            "fedccrl",
            "export",
            "--models",
            "models",
            "--shards",
            "data/shards",
            "--out",
            "exports",
            "--summary",
            "results/parity.json",
        ],
        "exports",
    ),
    "figures": (
        [
            "fedccrl",
            "figures",
            "--shards",
            "data/shards",
            "--pools",
            "data/pools",
            "--models",
            "models",
            "--runs",
            "results/runs",
            "--out",
            "plots",
        ],
        "plots",
    ),
}

FAULTS = [
    Fault("train kill -9 mid-step", "mid-step", "train", "kill -9 of `fedccrl train` during a round-2 optimizer step"),
    Fault(
        "train kill -9 mid-checkpoint",
        "mid-checkpoint",
        "train",
        "kill -9 with round 2's checkpoint in its temporary file",
    ),
    Fault("train kill -9 mid-MLflow-write", "mid-mlflow", "train", "kill -9 with half of round 2's metrics logged"),
    Fault("SIGTERM to dvc repro", "mid-step", "dvc", "SIGTERM to the `dvc repro` parent while train runs"),
    Fault(
        "kill -9 Flower launcher",
        "round-1-logged",
        "flower",
        "kill -9 of `fedccrl train` (train.engine: flower) after round 1",
    ),
    Fault(
        "corrupt latest checkpoint",
        "after-round-2",
        "corrupt",
        "kill -9 after round 2's checkpoint, which is then truncated",
    ),
    Fault("deleted mlflow.db", "mid-mlflow", "deldb", "kill -9 mid-MLflow-write, then mlflow.db deleted"),
    Fault("kill -9 fedccrl evaluate", "", "evaluate", "kill -9 of `fedccrl evaluate` at 50 % of its run", at=0.5),
    Fault("kill -9 fedccrl export", "", "export", "kill -9 of `fedccrl export` at 50 % of its run", at=0.5),
    Fault("kill -9 fedccrl figures", "mid-figure", "figures", "kill -9 of `fedccrl figures` after its first PNG"),
    *[
        Fault(
            f"kill -9 fedccrl figures at {pct} %",
            "",
            "figures",
            f"kill -9 of `fedccrl figures` at {pct} % of its run",
            at=pct / 100,
        )
        for pct in (30, 50, 70)
    ],
]


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file a stage wrote that must come back the same (an ONNX graph's bytes may differ between
    two exports of the same weights: its parity.json stands for it)."""
    return {
        q.relative_to(folder).as_posix(): hashlib.sha256(q.read_bytes()).hexdigest()
        for q in sorted(folder.rglob("*"))
        if q.is_file() and q.suffix != ".onnx"
    }


def run_stage_fault(f: Fault, ws: Path, fd: Path, token: str, reference: dict) -> dict:
    """kill -9 of one stage after training (at its hook point, or at a share of its reference run time), then the
    same command again: it must succeed and write what the reference run wrote."""
    cmd, out = STAGES[f.kill]
    db = ws / "mlflow.db"  # the stages log to the reference sweep's runs
    row = {"fault": f.name, "orphans": [], "temps": [], "lost": [], "identical": None, "mlflow": ""}
    if f.kill not in reference:  # the workspace as the faults before left it (`dvc repro -f` retrains the models)
        t1 = time.perf_counter()
        p = run(cmd, ws, env_for(ws, db))  # timed alone: the time-based faults kill at a share of it
        if p.returncode != 0:
            raise SystemExit(f"chaos: reference `{' '.join(cmd)}` failed:\n{p.stderr[-3000:]}")
        reference[f.kill] = (time.perf_counter() - t1, digests(ws / out))
        say(f"reference `{' '.join(cmd[:2])}`: {reference[f.kill][0]:.1f}s")
    seconds, ref = reference[f.kill]
    after = None if f.at is None else f.at * seconds
    rc, snap, log = start_and_kill(cmd, ws, env_for(ws, db, f.hook, fd, token), fd, after_s=after)
    before = statuses(db)
    row["orphans"] = orphans_after(snap, token)
    left = temps(ws, fd)
    p = run(cmd, ws, env_for(ws, db))
    got = digests(ws / out)
    row["temps"] = temps(ws, fd)
    row["lost"] = sorted(set(ref) - set(got))
    row["identical"] = got == ref
    notice = "removed stale temp" if any("notice: removed" in ln for ln in p.stderr.splitlines()) else ""
    row["outcome"] = (
        f"rerun rc {p.returncode}"
        + (f", {notice}" if notice else "")
        + ("" if rc is not None else f" ({log.splitlines()[0] if log else ''})")
        + (f"; {len(left)} temp(s) after kill" if left else "")
    )
    row["mlflow"] = f"{'/'.join(before) or '-'} -> {'/'.join(statuses(db)) or '-'}"
    row["ok"] = p.returncode == 0 and rc is not None
    return row


def run_fault(f: Fault, ws: Path, reference: dict[str, list[dict]], reference_stages: dict) -> dict:
    slug = f.name.replace(" ", "_").replace("-", "").replace("`", "")
    fd = ws / "faults" / slug
    fd.mkdir(parents=True)
    token = uuid.uuid4().hex
    db = fd / "mlflow.db"
    out, ck = fd / "out", fd / "ck"
    row = {"fault": f.name, "orphans": [], "temps": [], "lost": [], "identical": None, "mlflow": ""}
    train = ["fedccrl", *TRAIN_ARGS, "--out", str(out), "--checkpoints", str(ck)]

    if f.kill in STAGES:
        return run_stage_fault(f, ws, fd, token, reference_stages)

    if f.kill == "dvc":
        shutil.rmtree(ws / ".fedccrl", ignore_errors=True)
        shutil.rmtree(ws / "models" / ALGORITHM, ignore_errors=True)
        repro = ["dvc", "repro", "-f", "-s", f"train@{ALGORITHM}-{SEED}"]  # -f: train, not a restore from the cache
        rc, snap, log = start_and_kill(repro, ws, env_for(ws, db, f.hook, fd, token), fd, sig=signal.SIGTERM)
        row["orphans"] = orphans_after(snap, token)
        before = statuses(db)
        p = run(repro, ws, env_for(ws, db))
        result_dir = ws / "models" / ALGORITHM / f"s{SEED}"
    else:
        params_env = env_for(ws, db, f.hook, fd, token)
        cmd = list(train)
        if f.kill == "flower":
            flower_params = write_params(fd / "params.yaml", **{"train.engine": "flower"})
            cmd += ["--params", str(flower_params), "--held-out", "3"]
        rc, snap, log = start_and_kill(cmd, ws, params_env, fd)
        row["orphans"] = orphans_after(snap, token)
        before = statuses(db)
        if f.kill == "corrupt":
            latest = [q for q in ck.rglob("*.pt") if not q.parent.name.endswith(".clients")]
            for q in latest:
                q.write_bytes(q.read_bytes()[: q.stat().st_size // 2])  # a torn write the OS did not finish
        if f.kill == "deldb":
            db.unlink()
        p = run(cmd, ws, env_for(ws, db))
        result_dir = out
    row["temps"] = temps(ws, fd)
    logs = p.stderr + "".join(q.read_text(errors="replace") for q in fd.rglob("server.log"))  # + the ServerApp's
    notes = [
        n
        for n, key in (
            ("resumed", "resuming from checkpoint"),
            ("fell back to .prev", "falling back"),
            ("healed deleted run", "no longer exists"),
            ("removed stale temp", "notice: removed"),
            ("closed a run left RUNNING", "was left RUNNING"),
        )
        if key in logs
    ]
    row["outcome"] = (
        f"rerun rc {p.returncode}"
        + (f", {', '.join(notes)}" if notes else "")
        + ("" if rc is not None else f" ({log.splitlines()[0] if log else ''})")
    )
    if p.returncode != 0:
        row["outcome"] += f": {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
    after = statuses(db)
    row["mlflow"] = f"{'/'.join(before) or '-'} -> {'/'.join(after) or '-'}"
    held = ["3"] if f.kill == "flower" else sorted(reference)
    identical, lost = True, []
    steps = mlflow_steps(db)
    for h in held:
        d = result_dir / f"d{h}"
        if not (d / "history.json").is_file():
            lost.append(f"d{h}/history.json")
            identical = False
            continue
        got, ref = rounds(d), reference[h]
        identical &= got == ref
        lost += [f"d{h} round {r['round']}" for r in ref if r["round"] not in {g["round"] for g in got}]
        name = json.loads((d / "history.json").read_text())["meta"]["held_out_domain"]
        logged = steps.get(name, {})
        lost += [f"MLflow {name} step {r['round']}" for r in ref if r["round"] not in logged]
        lost += [
            f"MLflow {name} step {s} differs"
            for s, v in logged.items()
            if any(r["round"] == s and r["target_acc"] != v for r in got)
        ]
    row["identical"], row["lost"] = identical, lost
    row["ok"] = p.returncode == 0 and rc is not None and after and all(s == "FINISHED" for s in after)
    return row


def clean(row: dict) -> bool:
    return bool(row["ok"] and not row["orphans"] and not row["temps"] and not row["lost"] and row["identical"])


def table(rows: list[dict]) -> str:
    head = ["fault", "outcome", "orphans", "temps left", "data lost", "metrics identical", "mlflow runs", "clean"]
    body = [
        [
            r["fault"],
            r["outcome"],
            ", ".join(r["orphans"]) or "0",
            ", ".join(r["temps"]) or "0",
            ", ".join(r["lost"]) or "none",
            "yes" if r["identical"] else "NO",
            r["mlflow"],
            "clean" if clean(r) else "NOT CLEAN",
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated substrings of fault names")
    ap.add_argument("--keep", action="store_true", help="keep the workspace")
    ap.add_argument("--workspace", type=Path, help="workspace folder (default: a new temporary folder)")
    args = ap.parse_args(argv)
    faults = [
        f for f in FAULTS if not args.only or any(s.strip() and s.strip() in f.name for s in args.only.split(","))
    ]
    ws = (args.workspace or Path(tempfile.mkdtemp(prefix="fedccrl-chaos-"))).resolve()
    t0 = time.perf_counter()
    try:
        if args.workspace and (ws / "plots").is_dir() and (ws / "dvc.lock").is_file():
            say(f"reusing the reference run in {ws}")  # a kept workspace (--keep): its faults are redone
            shutil.rmtree(ws / "faults", ignore_errors=True)
            subprocess.run(["dvc", "repro", "-q"], cwd=ws, env=env_for(ws, ws / "mlflow.db"), check=True, timeout=900)
        else:
            setup(ws)
        models = ws / "models" / ALGORITHM / f"s{SEED}"
        reference = {d.name[1:]: rounds(d) for d in sorted(models.glob("d*"))}
        reference_stages = {}  # each stage's own reference run, made just before its first fault
        rows = []
        for f in faults:
            t1 = time.perf_counter()
            say(f"{f.name}: {f.what}")
            rows.append(run_fault(f, ws, reference, reference_stages))
            say(
                f"{f.name}: {'clean' if clean(rows[-1]) else 'NOT CLEAN'} ({time.perf_counter() - t1:.0f}s): "
                f"{json.dumps(rows[-1])}"
            )
        print(table(rows), flush=True)
        say(
            f"{len(rows)} fault(s) in {time.perf_counter() - t0:.0f}s; workspace {ws}"
            + ("" if args.keep else " (removed)")
        )
        return 0 if all(clean(r) for r in rows) else 1
    finally:
        if not args.keep:
            shutil.rmtree(ws, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
