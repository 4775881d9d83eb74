"""`fedccrl-bench scale` : a tiny run through the CLI, each size in a child process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.full("the bench-scale command: child processes per client count")
def test_bench_scale_prints_a_row_per_algorithm_and_client_count():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedccrl_benchmarks.cli",
            "scale",
            "--algorithms",
            "fedavg",
            "--clients",
            "2,4",
            "--total",
            "24",
            "--size",
            "8",
            "--rounds",
            "1",
            "--batch-size",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if re.match(r"\| fedavg \| \d+ \|", line)]
    assert [int(r[1]) for r in rows] == [2, 4]
    assert float(rows[0][3]) == 1.0 and float(rows[0][5]) == 1.0  # wall and CPU ratios to the fewest clients
    assert all(float(r[4]) > 0 for r in rows)  # CPU seconds per round, measured in the child
    peak = [float(r[10]) for r in rows]
    assert all(v > 50 for v in peak)  # measured in the child (torch alone is well above 50 MiB)
    ckpt = [int(r[13]) for r in rows]
    assert ckpt[1] > ckpt[0]  # every client trains each round: twice the states in the round's file
    sent = [float(r[14]) for r in rows]
    assert sent[1] == 2 * sent[0]  # each client receives and returns the model


def test_bench_scale_rejects_bad_input_before_running():
    p = subprocess.run(
        [sys.executable, "-m", "fedccrl_benchmarks.cli", "scale", "--algorithms", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "--algorithms" in p.stderr and "nope" in p.stderr


def test_the_scale_table_divides_each_row_by_the_fewest_clients():
    """x6 columns: each client count's seconds, CPU seconds and peak RSS over those of the fewest clients; the
    goal (at most 1.2x at 120 clients against 6) reads from them."""
    from fedccrl_benchmarks.scale import table

    def row(seconds, cpu, peak):
        return {
            "seconds_per_round": seconds,
            "cpu_seconds_per_round": cpu,
            "phases": {"train": seconds / 2},
            "peak_rss_mib": peak,
            "rss_start_mib": 100.0,
            "checkpoint_bytes": 10,
            "bytes_per_round": 20.0,
        }

    lines = table({"fedavg": {120: row(2.4, 3.0, 600.0), 6: row(2.0, 2.0, 400.0)}}).splitlines()
    cells = {int(c[2]): [c[4], c[6], c[12]] for c in (line.split("|") for line in lines[2:])}
    assert cells == {6: [" 1.00 ", " 1.00 ", " 1.00 "], 120: [" 1.20 ", " 1.50 ", " 1.50 "]}
