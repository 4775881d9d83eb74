"""The project's thread policy (fedccrl_core/foundation/threads.py) reaches every `fedccrl` process before torch loads."""

import os
import subprocess
import sys

from fedccrl_core.foundation.threads import POLICY, apply_thread_policy

PROBE = (
    "import os, sys; sys.argv = ['fedccrl', '--version']; import fedccrl_pipeline.cli; "
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('KMP_BLOCKTIME'), 'torch' in sys.modules)"
)


def _probe(env):
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    return r.stdout.split()


def test_cli_applies_passive_policy_before_torch():
    env = {k: v for k, v in os.environ.items() if k not in POLICY}
    assert _probe(env) == ["PASSIVE", "0", "False"]


def test_a_users_explicit_setting_is_kept():
    env = {k: v for k, v in os.environ.items() if k not in POLICY}
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    assert _probe(env)[:2] == ["ACTIVE", "0"]


def test_apply_reports_what_it_set():
    env = {"KMP_BLOCKTIME": "5"}
    assert apply_thread_policy(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"KMP_BLOCKTIME": "5", "OMP_WAIT_POLICY": "PASSIVE"}
