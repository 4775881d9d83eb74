"""Screenshots of the MLflow UI for the README (docs/mlflow_runs.png, docs/mlflow_compare.png), taken in a real
browser: headless Chromium (Debian: `apt-get install chromium`) against a running `mlflow ui`.

    python scripts/mlflow_screenshot.py --url http://127.0.0.1:5000 --out docs

The runs page is the experiment's table (classic view); the compare page puts the runs of the newest queued sweep
(the child runs whose parent carries a `dvc.exp_name` tag) side by side, with their params and metrics.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def api(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def sweep_children(url: str, experiment_id: str) -> list[str]:
    runs = api(url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 1000})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
    parents = sorted((r for r in runs if tags[r["info"]["run_id"]].get("fedccrl.role") == "parent"
                      and "dvc.exp_name" in tags[r["info"]["run_id"]]), key=lambda r: -int(r["info"]["start_time"]))
    baseline = tags[parents[0]["info"]["run_id"]].get("git_commit") if parents else None
    sweep = {p["info"]["run_id"] for p in parents if tags[p["info"]["run_id"]].get("git_commit") == baseline}
    return [r["info"]["run_id"] for r in runs if tags[r["info"]["run_id"]].get("mlflow.parentRunId") in sweep]


def shoot(chromium: str, page: str, out: Path, size: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        p = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                            "--virtual-time-budget=30000", f"--screenshot={out}", page],
                           capture_output=True, text=True, timeout=180)
    if p.returncode != 0 or not out.is_file():
        raise SystemExit(f"chromium could not take {out}: {p.stderr[-1000:]}")
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB) from {page}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:5000", help="a running `mlflow ui`")
    ap.add_argument("--experiment", default="fedccrl-synthetic")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--size", default="1600,1000", help="browser window, width,height")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("scripts/mlflow_screenshot.py needs Chromium on PATH (Debian: apt-get install chromium)")
    url = args.url.rstrip("/")
    try:
        exp = api(url, "experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": args.experiment}))
    except OSError as e:
        raise SystemExit(f"{url}: no MLflow server answers ({e}); start `mlflow ui` first") from e
    eid = exp["experiment"]["experiment_id"]
    children = sweep_children(url, eid)
    if len(children) < 2:
        raise SystemExit(f"{url}: experiment {args.experiment} has no queued sweep with 2 or more runs to compare")
    args.out.mkdir(parents=True, exist_ok=True)
    shoot(chromium, f"{url}/#/experiments/{eid}", args.out / "mlflow_runs.png", args.size)
    query = urllib.parse.urlencode({"runs": json.dumps(children), "experiments": json.dumps([eid])})
    shoot(chromium, f"{url}/#/compare-runs?{query}", args.out / "mlflow_compare.png", args.size)


if __name__ == "__main__":
    main()
