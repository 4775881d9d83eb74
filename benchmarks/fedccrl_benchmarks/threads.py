"""`fedccrl-bench threads`: the thread policy (fedccrl_core/foundation/threads.py) against OpenMP's spin-wait default.

The same small-CNN training workload runs in child processes, alternately with OMP_WAIT_POLICY=ACTIVE
(spin) and PASSIVE (the project's policy), while `--load` busy processes share the cores, as other jobs do
on a shared machine. Prints best-of-N wall and CPU seconds of each and their ratios, measured in this run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click

WORKLOAD = r"""
import json, resource, sys, time
import torch
from fedccrl_core.learning.models import build_model
torch.manual_seed(0)
m = build_model("small_cnn", 7)
opt = torch.optim.Adam(m.parameters(), 1e-3)
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 7, (32,))
t0 = time.perf_counter(); c0 = time.process_time()
for _ in range(int(sys.argv[1])):
    opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "threads": torch.get_num_threads()}))
"""
BUSY = "import time\nt = time.time()\nwhile time.time() - t < 600: pass\n"


def _run(policy: str, steps: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    env.pop("KMP_BLOCKTIME", None)
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(steps)], env=env, capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(steps: int, repeats: int, load: int) -> dict:
    """Best-of-`repeats` wall and CPU seconds of each policy, alternating, while `load` busy processes run."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
    try:
        best: dict[str, dict | None] = {"ACTIVE": None, "PASSIVE": None}
        for r in range(repeats):
            for policy in best:
                res = _run(policy, steps)
                print(
                    f"repeat {r + 1}/{repeats} {policy}: wall {res['wall']:.2f}s cpu {res['cpu']:.2f}s "
                    f"({res['threads']} torch threads)",
                    file=sys.stderr,
                    flush=True,
                )
                b = best[policy]
                best[policy] = res if b is None else {k: min(b[k], res[k]) for k in res}
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return best


@click.command("threads")
@click.option("--steps", type=int, default=60, show_default=True, help="training steps per measurement")
@click.option("--repeats", type=int, default=3, show_default=True, help="alternating repeats; best of each kept")
@click.option(
    "--load",
    type=int,
    default=1,
    show_default=True,
    help="busy processes sharing the cores during the measurement (0 = an idle machine)",
)
def command(steps, repeats, load):
    """Spin (OMP_WAIT_POLICY=ACTIVE) vs passive (the project's policy): wall and CPU ratios, same run."""
    best = measure(steps, repeats, load)
    a, p = best["ACTIVE"], best["PASSIVE"]
    click.echo(
        f"thread policy, {steps} small-CNN steps, {load} busy process(es), {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    click.echo(f"  spin    (OMP_WAIT_POLICY=ACTIVE):  wall {a['wall']:.2f}s  cpu {a['cpu']:.2f}s")
    click.echo(f"  passive (project policy):          wall {p['wall']:.2f}s  cpu {p['cpu']:.2f}s")
    click.echo(f"  spin / passive: wall {a['wall'] / p['wall']:.2f}x  cpu {a['cpu'] / p['cpu']:.2f}x")
