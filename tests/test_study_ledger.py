"""The study ledger (fedccrl_core/privacy/study_ledger.py, pipeline/fedccrl_pipeline/study_privacy.py): every release
of every run on one set of images in one append-only file, wherever the runs train. Two runs in two DVC workspace
copies compose there and the second is refused by max_sweep_epsilon before it trains; a run that crashed and is rerun
after a code change (a new run key) counts both attempts and leaves no client state of the first; a named study starts
from zero; writers at once lose no line; a bad line is an error naming the file and the line.

Each epsilon is checked against an independent one: dp_accounting's RDP accountant composing the releases the test
itself counted."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from fixtures import ONE_ROUND, held_out_run
from test_privacy_ledger import PRIV, Crash, counting_engine, independent_epsilon
from test_round_loop import toy_clients
from test_sweep_epsilon import _runs, _train_cli, independent

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.privacy import study_ledger as sl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DELTA = 1e-5
DOMAINS = ["art", "cartoon"]


def pointer(ledger: Path, run: str = "fedccrl s0 held-out photo", study: str = "d1", name: str = "") -> sl.StudyPointer:
    return sl.StudyPointer(
        fedccrl_study_pointer=1,
        ledger=str(ledger),
        study=study,
        data="d1",
        name=name,
        run=run,
        trained_domains=DOMAINS,
    )


def entry(i: int, run_key: str = "k") -> dict:
    return {
        "run_key": run_key,
        "run": "r",
        "attempt": 1,
        "trained_domains": DOMAINS,
        "channel": "weights",
        "round": i + 1,
        "population": 6,
        "sample": 3,
        "z": 0.5,
    }


def test_writers_at_once_lose_no_line(tmp_path):
    """Four writers append 50 releases each to one study ledger at the same time (queued workers): the file holds the
    header and all 200 lines, each whole, and the study composes all of them. Each append opens its own descriptor,
    so the writers' flock excludes them from each other as it does processes' (a lock belongs to the open file)."""
    path = tmp_path / "study.jsonl"
    start = threading.Barrier(4)

    def append_many(worker: int) -> None:
        on_release = sl.recorder(pointer(path), f"worker{worker}")
        start.wait()
        for i in range(50):
            on_release(["weights", i + 1, 6, 3, 0.5])

    threads = [threading.Thread(target=append_many, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    header, entries = sl.read_study(path)
    assert header is not None and header.study == "d1"
    assert len(entries) == 200 and len(path.read_text().splitlines()) == 201
    assert sorted({e.run_key for e in entries}) == [f"worker{w}" for w in range(4)]
    for w in range(4):  # each writer's lines in its own order
        assert [e.round for e in entries if e.run_key == f"worker{w}"] == list(range(1, 51))
    gauss = dp_accounting.GaussianDpEvent(0.5)
    bounds = []  # the sampled and the unsampled compositions both bound it (accountant.py epsilon_of): the smaller
    for event in (dp_accounting.SampledWithoutReplacementDpEvent(6, 3, gauss), gauss):
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(event, 200)
        bounds.append(acc.get_epsilon(DELTA))
    assert sl.study_epsilon(entries, DELTA)["art"] == pytest.approx(min(bounds), rel=1e-9)


@pytest.mark.parametrize(
    "line, why",
    [
        ("[1, 2\n", "line 3: not JSON"),
        (json.dumps({**entry(0), "sample": 7}) + "\n", "line 3.*a sample of 7 out of 6"),
        (json.dumps({**entry(0), "channel": "model"}) + "\n", "line 3.*channel"),
        (json.dumps({**entry(0), "py/object": "os.system"}) + "\n", "line 3.*py/object"),
        (json.dumps(entry(0)), "line 3: cut short"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_file_and_the_line(tmp_path, line, why):
    path = tmp_path / "study.jsonl"
    sl.recorder(pointer(path), "k")(["weights", 1, 6, 3, 0.5])
    with open(path, "a") as f:
        f.write(line)
    with pytest.raises(ValueError, match=rf"study\.jsonl: {why}"):
        sl.read_study(path)


def test_another_studys_file_and_a_missing_folder_are_refused_before_a_release(tmp_path):
    path = tmp_path / "study.jsonl"
    sl.recorder(pointer(path), "k")
    with pytest.raises(ValueError, match=r"study\.jsonl: the study ledger of study d1, not d2"):
        sl.recorder(pointer(path, study="d2"), "k")
    with pytest.raises(ValueError, match=r"nowhere: the study ledger's folder does not exist"):
        sl.recorder(pointer(tmp_path / "nowhere" / "s.jsonl"), "k")


def test_reported_releases_are_counted_once_each_by_their_ledger_and_index(tmp_path):
    """append_reported (a deployment's operator counting its ServerApp's records): a record read again adds nothing,
    a resumed ServerApp whose first record carries its ledger from index 0 adds only what no record carried, a ledger
    that started over (a new id) is the run's next attempt, and a release the ServerApp appended itself through its
    pointer (the recorder, keyed) is not counted again."""
    path, p = tmp_path / "study.jsonl", pointer(tmp_path / "study.jsonl")
    r = [
        ["statistics", 1, 12, 2, 2.0],
        ["weights", 1, 4, 2, 0.5],
        ["statistics", 2, 12, 2, 2.0],
        ["weights", 2, 4, 2, 0.5],
    ]
    assert sl.append_reported(p, "k", "A", 0, r[:2]) == [0, 1]
    assert sl.append_reported(p, "k", "A", 0, r[:2]) == []  # the same record, read again
    assert sl.append_reported(p, "k", "A", 0, r[:3]) == [2]  # resumed after a crash between the release and its record
    assert sl.append_reported(p, "k", "A", 3, r[3:]) == [3]
    assert sl.append_reported(p, "k", "B", 0, r[:1]) == [0]  # the run started over: another ledger
    sl.recorder(p, "k", lambda: sl.release_key("C", 0))(r[1])  # a ServerApp that read the pointer wrote this one
    assert sl.append_reported(p, "k", "C", 0, r[1:2]) == []
    _, entries = sl.read_study(path)
    assert [(e.release, e.attempt) for e in entries] == [(f"A/{i}", 1) for i in range(4)] + [("B/0", 2), ("C/0", 3)]
    counted = [*r, r[0], r[1]]
    assert [e.as_ledger() for e in entries] == counted
    want = independent([(c, n, k, z) for c, _, n, k, z in counted])
    assert sl.study_epsilon(entries, DELTA) == pytest.approx(dict.fromkeys(DOMAINS, want), rel=1e-9)


def attempt(tmp: Path, key: str, engine, rounds: int = 2, logs: list | None = None):
    """FedCCRL on 4 toy clients under DP, its round checkpoint <tmp>/<key>.pt (the run key names it, as plan_runs
    does), the study pointer beside it."""
    ledger = tmp / "studies" / "d1.jsonl"
    ledger.parent.mkdir(exist_ok=True)
    sl.write_pointer(tmp / f"{key}.pt", pointer(ledger))
    clients = toy_clients(4, 12)
    for c in clients:
        x = c.train_x.float() / 255
        c.stats_mu, c.stats_sigma = x.mean((2, 3)).numpy(), x.std((2, 3)).numpy()
    alg = build_algorithm("fedccrl", LocalConfig(rounds=rounds, local_epochs=1, batch_size=4, privacy=PRIV))
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    run = held_out_run(
        alg, model, clients, (clients[0].train_x, clients[0].train_y), rounds,
        checkpoint_path=tmp / f"{key}.pt", run_info={"run_key": key},
    )  # fmt: skip
    return train(run, None, (logs if logs is not None else []).append, engine=engine), ledger


def test_a_crash_then_a_code_change_and_a_rerun_counts_both_attempts_and_drops_the_first_ones_state(tmp_path):
    """Attempt 1 (run key A) crashes in round 2 after its statistics went out: 2 statistics and 1 weights releases,
    each appended to the study as it was charged, and its clients' Adam states in A.pt.clients/. The code changes
    (run key B; here also one round): the rerun starts over, removes A's client states, and the study's epsilon
    composes both attempts."""
    released: dict[str, list] = {"statistics": [], "weights": []}
    with pytest.raises(Crash):
        attempt(tmp_path, "A", counting_engine(released, crash_round=2))
    assert (len(released["statistics"]), len(released["weights"])) == (2, 1)
    assert any((tmp_path / "A.pt.clients").iterdir())  # the crashed attempt's client states, kept for its resume
    first = independent_epsilon(released["statistics"], released["weights"])
    _, entries = sl.read_study(tmp_path / "studies" / "d1.jsonl")
    assert len(entries) == 3 and sl.study_epsilon(entries, DELTA)["art"] == pytest.approx(first, rel=1e-9)

    logs: list[str] = []
    res, ledger = attempt(tmp_path, "B", counting_engine(released), rounds=1, logs=logs)
    assert res.resumed_from == 0  # another key: the run started over
    assert (len(released["statistics"]), len(released["weights"])) == (3, 2)
    both = independent_epsilon(released["statistics"], released["weights"])
    _, entries = sl.read_study(ledger)
    assert [(e.run_key, e.attempt) for e in entries] == [("A", 1)] * 3 + [("B", 1)] * 2
    eps = sl.study_epsilon(entries, DELTA)
    assert eps == {"art": pytest.approx(both, rel=1e-9), "cartoon": pytest.approx(both, rel=1e-9)}
    assert res.history[-1].metric("dp_epsilon") < both * (1 - 1e-3)  # the run alone reports less: B's releases
    assert not (tmp_path / "A.pt.clients").exists() and not (tmp_path / "B.pt.clients").exists()
    assert not torch.load(tmp_path / "A.pt", weights_only=True)["client_records"]
    assert any("removed the client states of" in m and "A.pt" in m for m in logs)


def test_a_resumed_attempt_is_the_next_attempt_of_its_run_key(tmp_path):
    released: dict[str, list] = {"statistics": [], "weights": []}
    with pytest.raises(Crash):
        attempt(tmp_path, "A", counting_engine(released, crash_round=1), rounds=1)
    res, ledger = attempt(tmp_path, "A", counting_engine(released), rounds=1)
    assert res.resumed_from == 0 and len(released["statistics"]) == 2
    _, entries = sl.read_study(ledger)
    assert [e.attempt for e in entries] == [1, 2, 2]  # round 1's statistics charged again, by attempt 2
    want = independent_epsilon(released["statistics"], released["weights"])
    assert sl.study_epsilon(entries, DELTA)["art"] == pytest.approx(want, rel=1e-9)


def two_copies(params, tmp_path, monkeypatch):
    """Two queued experiments: DVC copies of the workspace under <repo>/.dvc/tmp/exps, on the same shards, one
    round of FedAvg held-out photo each (another train.lr), max_sweep_epsilon between one such run's epsilon and
    two's: each passes on its own plan, the two together do not. -> (repo, copies, overrides, limit, one, two)."""
    monkeypatch.delenv("DVC_ROOT", raising=False)
    repo = tmp_path / "repo"
    over = {**ONE_ROUND, "train.privacy.enabled": True, "train.algorithms": ["fedavg"], "train.held_out": [0]}
    one, two = independent([WEIGHTS]), independent([WEIGHTS] * 2)
    limit = (one + two) / 2
    copies = [repo / ".dvc" / "tmp" / "exps" / name for name in ("q1", "q2")]
    for ws, lr in zip(copies, (0.003, 0.002)):
        ws.mkdir(parents=True)
        params({**over, "train.lr": lr}, to=ws, new_keys={"train.privacy.max_sweep_epsilon": limit})
    return repo, copies, over, limit, one, two


WEIGHTS = ("weights", 6, 6, 0.5)  # FedAvg's round on the 6 source clients of held-out photo, all sampled; z / 2


def assert_refused(tiny, copy: Path, monkeypatch, ledger: Path, spent: float, together: float, tmp_path) -> None:
    """`fedccrl train` in `copy` stops before any MLflow run, checkpoint or model, naming the study and the numbers."""
    store = tmp_path / "mlflow.db"  # MLFLOW_TRACKING_URI (conftest.py)
    before = len(_runs(tmp_path)[1]) if store.exists() else None
    res = _train_cli(tiny, copy, monkeypatch, "fedavg", ["0"])
    assert res.exit_code == 2, res.output[-3000:]
    text = res.stderr.replace("\n", "")
    assert f"study {ledger.stem}" in text and str(ledger) in text, text
    assert f"already spent epsilon {spent:.3f}" in text and f"together {together:.3f}" in text, text
    assert (len(_runs(tmp_path)[1]) if before is not None else store.exists()) == (before or False)
    assert not (copy / "models").exists() and not (copy / "ck").exists()


def test_two_workspace_copies_share_the_study_and_the_second_is_refused_before_training(
    tiny, params, tmp_path, monkeypatch
):
    """The first copy's run joins the study (its pointer) and charges its round's release as the round loop does; the
    study ledger lies in <repo>, which the second copy reaches: its `fedccrl train` is refused before it trains. A study
    named on purpose (train.privacy.study) starts from zero and passes."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.study_privacy import check_study_budget, join_study
    from fedccrl_pipeline.sweep_privacy import manifest_plan
    from fedccrl_pipeline.training import run_settings

    repo, copies, over, limit, one, two = two_copies(params, tmp_path, monkeypatch)
    manifest = load_manifest(tiny / "data" / "shards")

    def joined(copy: Path, **new_keys):
        monkeypatch.chdir(copy)
        keys = {"train.privacy.max_sweep_epsilon": limit, **new_keys}
        cfg = load_config(params({**over, "train.lr": 0.003}, to=copy, new_keys=keys))
        part = cfg.partition.model_dump(by_alias=True)
        args = (manifest, "fedavg", 0, [0], ["photo"], copy / "m", copy / "ck", cfg.train.fedavg)
        jobs = plan_runs(run_settings(cfg), part, *args)
        return cfg, jobs, join_study(cfg, manifest_plan(cfg, manifest), "fedavg", 0, ["photo"], jobs)

    _, (job,), study = joined(copies[0])
    assert study is not None and study.ledger.parent == repo.resolve() / ".fedccrl" / "studies"
    sl.recorder(sl.read_pointer(job.ckpt), job.run_key)(["weights", 1, 6, 6, 0.5])  # round 1's aggregate, charged
    assert_refused(tiny, copies[1], monkeypatch, study.ledger, one, two, tmp_path)

    cfg, (job,), named = joined(copies[1], **{"train.privacy.study": "retrained"})
    assert named is not None and named.ledger.parent == study.ledger.parent and named.ledger != study.ledger
    assert named.ledger.stem.startswith(study.key) and job.data_key == study.data
    assert check_study_budget(cfg, named, manifest_plan(cfg, manifest), "fedavg", 0, ["photo"]) == {}
    sl.recorder(sl.read_pointer(job.ckpt), job.run_key)(["weights", 1, 6, 6, 0.5])
    header, entries = sl.read_study(named.ledger)
    assert header is not None and header.name == "retrained" and len(entries) == 1  # the name, recorded


@pytest.mark.full("a DP FedAvg train stage on the tiny data, one round, then a refusal: ~15 s on the shared CPU")
def test_a_queued_experiments_run_reaches_the_study_and_its_parent_reports_it(tiny, params, tmp_path, monkeypatch):
    """The first copy trains for real: its round's release reaches the study ledger in <repo> as it is charged, the
    parent run reports the study's epsilon per image, and so does history.json; the second copy is refused."""
    from fedccrl_pipeline.study_privacy import STUDY_EPSILON

    repo, copies, _, _, one, two = two_copies(params, tmp_path, monkeypatch)
    res = _train_cli(tiny, copies[0], monkeypatch, "fedavg", ["0"])
    assert res.exit_code == 0, res.output[-3000:]
    (ledger,) = (repo / ".fedccrl" / "studies").iterdir()
    _, entries = sl.read_study(ledger)
    assert [(e.channel, e.population, e.sample, e.z) for e in entries] == [WEIGHTS]
    _, runs = _runs(tmp_path)
    parent = next(r for r in runs if r.data.tags.get("fedccrl.role") == "parent")
    assert parent.data.tags["fedccrl.study"] == ledger.stem
    assert parent.data.metrics[f"{STUDY_EPSILON}/art"] == pytest.approx(one, rel=1e-9)
    history = json.loads((copies[0] / "models" / "m" / "d0" / "history.json").read_text())
    assert history["dp"]["study"] == ledger.stem and history["dp"]["study_epsilon"]["art"] == pytest.approx(one)
    assert_refused(tiny, copies[1], monkeypatch, ledger, one, two, tmp_path)


def test_earlier_attempts_are_the_same_run_of_the_same_study_under_another_key(tmp_path):
    """The checkpoints whose client states a rerun removes (round_privacy.py in-process, fedccrl_flower/run.py for
    the SuperNodes' state folder): the same run of the same study beside it, nothing else."""
    ledger = tmp_path / "s.jsonl"
    for key, p in [
        ("A", pointer(ledger)),
        ("B", pointer(ledger)),
        ("C", pointer(ledger, run="fedavg s0 held-out photo")),
        ("D", pointer(ledger, study="d1-named")),
    ]:
        sl.write_pointer(tmp_path / f"{key}.pt", p)
    (tmp_path / "E.pt").write_bytes(b"")  # no pointer: not a run of a study
    assert sl.earlier_attempts(tmp_path / "B.pt") == [tmp_path / "A.pt"]
    assert sl.earlier_attempts(tmp_path / "C.pt") == [] and sl.earlier_attempts(tmp_path / "E.pt") == []


def test_a_named_study_is_part_of_the_run_key_and_the_ledgers_folder_is_not(params, tmp_path):
    """train.privacy.study names a new study: its runs are new runs (their own key and checkpoint), never resumed
    from the old study's; where the ledgers lie changes nothing a run trains."""
    from fixtures import bare_manifest

    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.training import run_settings

    def key(**new_keys):
        cfg = load_config(params({"train.privacy.enabled": True}, new_keys=new_keys))
        part = cfg.partition.model_dump(by_alias=True)
        args = (bare_manifest(), "fedavg", 0, [3], ["sketch"], tmp_path / "m", tmp_path / "ck", cfg.train.fedavg)
        (job,) = plan_runs(run_settings(cfg), part, *args)
        return job.run_key

    plain = key()
    assert key(**{"train.privacy.study_dir": str(tmp_path / "elsewhere")}) == plain
    assert key(**{"train.privacy.study": ""}) == plain
    assert key(**{"train.privacy.study": "second-look"}) != plain


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_study_ledger_that_is_a_symlink_or_a_fifo_is_refused_naming_it(tmp_path, kind):
    """The append never goes through a symlink (to a file elsewhere) nor into a FIFO: an error naming the path."""
    import os

    from fedccrl_core.privacy import study_ledger as sl

    path = tmp_path / "s.jsonl"
    elsewhere = tmp_path / "elsewhere.txt"
    if kind == "symlink":
        elsewhere.write_text("")
        path.symlink_to(elsewhere)
    else:
        os.mkfifo(path)
    header = sl.StudyHeader(fedccrl_study=1, study="k", data="d", name="", created="now")
    with pytest.raises(ValueError, match=str(path)):
        sl.append_lines(path, header, [])
    assert not elsewhere.exists() or elsewhere.read_text() == ""
