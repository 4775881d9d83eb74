"""The MLflow tracking store the stages log to: which one (MLFLOW_TRACKING_URI, else sqlite:///<repository>/mlflow.db),
a new SQLite store created whole, a store that cannot be read stopped at once with its name (never taken for an
empty one), and the experiment with its artifact root."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from fedccrl_core.foundation.errors import FedCCRLError

KIND_TAG, CLASSIC_UI = "mlflow.experimentKind", "custom_model_development"  # MLflow's classic (model development) UI


class TrackingStoreError(FedCCRLError):
    """The tracking store cannot be read (a file that is not an MLflow database, a folder without permission...)."""


def project_root(cwd: Path | None = None) -> Path:
    """The repository whose mlflow.db the README's `mlflow ui` opens. `dvc exp run --temp` and `--queue` run
    the stages in a copy under <repo>/.dvc/tmp/exps/..., deleted afterwards: their runs belong to <repo>. DVC
    names the parent repository in DVC_ROOT for experiment runs; the path is the fallback."""
    if cwd is None and os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    cwd = (cwd or Path.cwd()).resolve()
    for p in (cwd, *cwd.parents):
        if p.name == "exps" and p.parent.name == "tmp" and p.parent.parent.name == ".dvc":
            return p.parent.parent.parent
    return cwd


def default_tracking_uri() -> str:
    """The store of the repository: sqlite:///<project_root()>/mlflow.db."""
    return f"sqlite:///{project_root() / 'mlflow.db'}"


def tracking_uri() -> str:
    """The store the stages log to: MLFLOW_TRACKING_URI, else default_tracking_uri()."""
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def mlflow_module():
    """mlflow, pointed at MLFLOW_TRACKING_URI or, by default, sqlite:///<project_root()>/mlflow.db (an absolute
    path, so that every DVC way of running, --temp and --queue included, logs to the one store). A missing SQLite
    store is created whole; a store that cannot be read raises TrackingStoreError naming it."""
    import mlflow

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri(tracking_uri())
    uri = mlflow.get_tracking_uri()
    with store_errors(uri):
        _create_sqlite_store_whole(uri)
        mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # a store MLflow cannot read fails here
    return mlflow


@contextlib.contextmanager
def store_errors(uri: str):
    """What a store that cannot be read, or a tracking server that stays unreachable once MLflow's own bounded
    retries are spent (MLFLOW_HTTP_REQUEST_MAX_RETRIES, about 4 minutes by default; each retry a warning on stderr),
    raises (MLflow's, SQLAlchemy's or the OS's error) -> one TrackingStoreError naming the store."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (MlflowException, SQLAlchemyError, OSError) as e:
        first = (str(e).splitlines() or [e.__class__.__name__])[0][:300]
        if uri.startswith(("http://", "https://")):
            raise TrackingStoreError(
                f"MLflow tracking server {uri} failed after MLflow's retries ({first}); check that "
                "it runs (make tracking-server-status) and run the stage again: it resumes where "
                "it stopped"
            ) from e
        raise TrackingStoreError(
            f"MLflow tracking store {uri} cannot be read ({first}); repair or move it (a missing "
            "SQLite store is created afresh), or set MLFLOW_TRACKING_URI to another store"
        ) from e


def _create_sqlite_store_whole(uri: str) -> None:
    """A new SQLite store comes into being whole or not at all. MLflow creates its tables in many migration
    steps, and a process killed among them (kill -9 of `train` while its MLflow starts up) leaves a store that
    every later run fails on ("table _alembic_tmp_experiments already exists"). So a missing store is built in an
    fsio scratch folder beside it, by MLflow's own client (its first query creates and migrates the store), and
    hard-linked into place (a store another process created meanwhile wins); a scratch folder left by a killed
    process is removed by the next run."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///") :])
    if path.exists() or not path.parent.is_dir():
        return
    import mlflow

    from fedccrl_core.foundation.fsio import scratch_dir

    with scratch_dir(path) as tmp:
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp / path.name}").search_experiments(max_results=1)
        try:
            os.link(tmp / path.name, path)
        except FileExistsError:  # another process created the store meanwhile: it wins
            pass


def _artifact_root(uri: str) -> Path | None:
    """Where a new experiment keeps its artifacts: FEDCCRL_MLFLOW_ARTIFACTS (tests point it at a temp folder),
    else <project_root()>/mlartifacts with the repository's own store, else (another store) MLflow's default.
    The store is told by its URI, not by MLFLOW_TRACKING_URI being set: mlflow.set_tracking_uri sets that too."""
    if os.environ.get("FEDCCRL_MLFLOW_ARTIFACTS"):
        return Path(os.environ["FEDCCRL_MLFLOW_ARTIFACTS"]).resolve()
    if uri == default_tracking_uri():
        return project_root() / "mlartifacts"
    return None


def set_experiment(name: str):
    """Get or create the experiment, in MLflow's classic (model development) UI mode. A new experiment keeps its
    artifacts under _artifact_root(), never inside a DVC temp copy. Stages that run side by side (`dvc queue
    start -j 2`) race to create it: the experiment is created with its tag in one transaction, and a loser of the
    race takes the winner's experiment."""
    mlflow = mlflow_module()
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    if mlflow.get_experiment_by_name(name) is None:
        root = _artifact_root(mlflow.get_tracking_uri())
        try:
            mlflow.create_experiment(
                name, artifact_location=None if root is None else (root / name).as_uri(), tags={KIND_TAG: CLASSIC_UI}
            )
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            # created meanwhile by another process: set_experiment below finds it
    exp = mlflow.set_experiment(name)
    if exp.tags.get(KIND_TAG) != CLASSIC_UI:  # an experiment made elsewhere: the classic UI, not GenAI
        try:
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, KIND_TAG, CLASSIC_UI)
        except (MlflowException, SQLAlchemyError):
            # another process tagged it meanwhile (both inserted the tag): theirs stands
            if mlflow.get_experiment(exp.experiment_id).tags.get(KIND_TAG) != CLASSIC_UI:
                raise
    return exp


def find_run(mlflow, run_id: str):
    """The run, or None when the store has no such run (the store was deleted or replaced since). Any other
    failure is a TrackingStoreError naming the store: an unreadable store is never taken for a missing run."""
    from mlflow.exceptions import MlflowException

    with store_errors(mlflow.get_tracking_uri()):
        try:
            return mlflow.MlflowClient().get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise


def trained_run(run_id: str, stage: str):
    """The MLflow run that training logged (named in a model's meta), for a later stage to log into; None when
    the store has no such run (moved or replaced since training): `stage` says so on stderr and logs nothing. A
    store that cannot be read is a TrackingStoreError, never taken for a missing run."""
    mlflow = mlflow_module()
    run = find_run(mlflow, run_id)
    if run is None:
        print(
            f"{stage}: MLflow run {run_id} is not in the tracking store {mlflow.get_tracking_uri()}; not logged",
            file=sys.stderr,
        )
    return run
