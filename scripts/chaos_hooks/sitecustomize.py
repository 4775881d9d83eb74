"""Fault points for scripts/chaos.py, loaded by every Python process of a fault run (this folder is put first on
PYTHONPATH, and Python imports `sitecustomize` at start-up). Nothing happens unless CHAOS_HOOK names a point.

At its point, the first process that reaches it (once per fault: the trigger file is created exclusively) writes
`<CHAOS_DIR>/trigger` with its pid and holds still; scripts/chaos.py then kills the process it targets (the
`fedccrl train` parent, the `dvc repro` parent, the Flower launcher, `fedccrl figures`) while this process is
exactly there. Points:

  mid-step        an optimizer step of round 2 (after round 1's checkpoint was saved)
  mid-checkpoint  round 2's checkpoint written to its temporary file, not yet verified and renamed
  after-round-2   round 2's checkpoint verified and in place (the test of a corrupt latest checkpoint)
  mid-mlflow      half of round 2's metrics logged to MLflow, the other half not
  round-1-logged  round 1's record logged to MLflow (the Flower launcher's federation is up and running)
  mid-figure      the first figure saved into the temporary plots folder
"""

from __future__ import annotations

import os

HOOK = os.environ.get("CHAOS_HOOK", "")


def _hold(point: str) -> None:
    """Claim the fault (once), tell chaos.py where we are, and wait to be killed."""
    import time

    path = os.path.join(os.environ["CHAOS_DIR"], "trigger")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # another process of this fault got there first
    os.write(fd, f"{os.getpid()} {point}\n".encode())
    os.close(fd)
    time.sleep(float(os.environ.get("CHAOS_HOLD_S", "300")))
    os._exit(97)  # never killed: chaos.py reports the fault as not injected


def _install() -> None:
    if HOOK in ("mid-step", "mid-checkpoint", "after-round-2"):
        from fedccrl_core.federation import checkpoints

        saves = [0]
        real_save, real_atomic = checkpoints.RoundCheckpoints.save, checkpoints.atomic_file

        def save(self, rnd, main, trained):
            out = real_save(self, rnd, main, trained)
            saves[0] += 1
            if HOOK == "after-round-2" and rnd == 2:
                _hold(HOOK)
            return out

        checkpoints.RoundCheckpoints.save = save
        if HOOK == "mid-step":
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            def pre_step(optimizer, args, kwargs):
                if saves[0] >= 1:
                    _hold(HOOK)

            register_optimizer_step_pre_hook(pre_step)
        if HOOK == "mid-checkpoint":
            from contextlib import contextmanager

            @contextmanager
            def atomic_file(path, *a, **kw):
                with real_atomic(path, *a, **kw) as f:
                    yield f
                    if saves[0] >= 1:  # round 2's bytes are in the temporary file
                        f.flush()
                        _hold(HOOK)

            checkpoints.atomic_file = atomic_file
    elif HOOK == "mid-mlflow":
        from mlflow.tracking import MlflowClient

        real = MlflowClient.log_batch

        def log_batch(self, run_id, metrics=(), *a, **kw):
            metrics = list(metrics or [])
            if metrics and any(m.step == 2 for m in metrics) and len(metrics) > 1:
                real(self, run_id, metrics[: len(metrics) // 2], *a, **kw)
                _hold(HOOK)
            return real(self, run_id, metrics, *a, **kw)

        MlflowClient.log_batch = log_batch
    elif HOOK == "round-1-logged":
        from fedccrl_pipeline import tracking

        real_round = tracking.ChildRun.log_round

        def log_round(self, rec):
            real_round(self, rec)
            if rec.round == 1:  # a RoundRecord (fedccrl_core/federation/round_record.py)
                _hold(HOOK)

        tracking.ChildRun.log_round = log_round
    elif HOOK == "mid-figure":
        from matplotlib.figure import Figure

        real_savefig = Figure.savefig

        def savefig(self, *a, **kw):
            out = real_savefig(self, *a, **kw)
            _hold(HOOK)
            return out

        Figure.savefig = savefig


if HOOK:
    try:
        _install()
    except BaseException as e:  # Python would only print "Error in sitecustomize": leave chaos.py the reason
        with open(os.path.join(os.environ["CHAOS_DIR"], "hook-error"), "a") as f:
            f.write(f"{os.getpid()}: {e.__class__.__name__}: {e}\n")
        raise
