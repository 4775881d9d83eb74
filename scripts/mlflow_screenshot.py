"""Screenshots of the MLflow UI for the docs' MLflow page (docs/mlflow_runs.png, docs/mlflow_compare.png), taken in a real
browser against a running `mlflow ui`: headless Chromium (Debian: `apt-get install chromium`) driven by Playwright
(`pip install playwright`; only its driver is used, no browser download).

    python scripts/mlflow_screenshot.py --url http://127.0.0.1:5000 --out docs

The runs page is the experiment's table in the classic "Model training" view, every parent run expanded to its
children; the compare page puts the runs of the newest queued sweep (the child runs whose parent carries a
`dvc.exp_name` tag, at one git commit) side by side, their params and metrics filtered to what differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def api(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"{url}/api/2.0/mlflow/{path}",
        method="POST" if body is not None else "GET",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def sweep_children(url: str, experiment_id: str) -> list[str]:
    runs = api(url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 1000})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
    parents = sorted(
        (
            r
            for r in runs
            if tags[r["info"]["run_id"]].get("fedccrl.role") == "parent" and "dvc.exp_name" in tags[r["info"]["run_id"]]
        ),
        key=lambda r: -int(r["info"]["start_time"]),
    )
    commit = tags[parents[0]["info"]["run_id"]].get("git_commit") if parents else None
    sweep = {p["info"]["run_id"] for p in parents if tags[p["info"]["run_id"]].get("git_commit") == commit}
    return [r["info"]["run_id"] for r in runs if tags[r["info"]["run_id"]].get("mlflow.parentRunId") in sweep]


def shoot(url: str, experiment_id: str, children: list[str], out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{url}/#/experiments/{experiment_id}/runs")
        page.wait_for_timeout(6000)
        page.get_by_role("button", name="Model training").click()  # the classic view, not GenAI
        page.wait_for_timeout(1500)
        close = page.locator("[aria-label=Close]")  # the assistant side panel, when shown
        if close.count():
            close.first.click()
        page.goto(f"{url}/#/experiments/{experiment_id}/runs")
        page.wait_for_timeout(5000)
        expanders = page.locator(".ag-row [role=button], .ag-row button")  # every parent run opened to its children
        for i in range(expanders.count()):
            expanders.nth(i).click()
            page.wait_for_timeout(300)
        header = page.locator(".ag-header-cell", has_text="Run Name").first.bounding_box()
        box = header and {
            "x": header["x"] + header["width"] - 3,
            "y": header["y"],
            "width": 2,
            "height": header["height"],
        }  # the column's resize edge
        if box:  # widen the name column to show whole names
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.down()
            page.mouse.move(box["x"] + 170, box["y"] + box["height"] / 2, steps=10)
            page.mouse.up()
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out / "mlflow_runs.png"))
        query = urllib.parse.urlencode({"runs": json.dumps(children), "experiments": json.dumps([experiment_id])})
        page.goto(f"{url}/#/compare-runs?{query}")
        page.wait_for_timeout(6000)
        page.get_by_role("button", name="Visualizations").click()  # folded: the tables come first
        for name in ("Parameters - Show diff only", "Metrics - Show diff only"):
            page.get_by_role("switch", name=name).click()
        page.wait_for_timeout(1500)
        page.screenshot(
            path=str(out / "mlflow_compare.png"), full_page=True, clip={"x": 0, "y": 0, "width": 1600, "height": 1400}
        )
        browser.close()
    for name in ("mlflow_runs.png", "mlflow_compare.png"):
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:5000", help="a running `mlflow ui`")
    ap.add_argument("--experiment", default="fedccrl-synthetic")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("scripts/mlflow_screenshot.py needs Chromium on PATH (Debian: apt-get install chromium)")
    try:
        import playwright  # noqa: F401 (only whether it is installed)
    except ImportError:
        raise SystemExit(
            "scripts/mlflow_screenshot.py needs Playwright's driver: pip install playwright "
            "(no browser download: it drives the Chromium on PATH)"
        ) from None
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
    shoot(url, eid, children, args.out, chromium)


if __name__ == "__main__":
    main()
