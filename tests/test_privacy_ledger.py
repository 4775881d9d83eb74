"""train.privacy's ledger on every path (fedccrl_core/privacy/accountant.py RunPrivacy, federation/loop.py): a round
interrupted after a release and resumed is charged for every release that happened (the ledger file beside the round
checkpoint), max_epsilon's pre-round check charges a client whose size is not known as the worst case, a run stopped
after a release logs the epsilon it spent, a duplicated Flower client id is refused and both of its uploads charged,
and a finished DP run leaves no client state in its files.

Each epsilon is checked against an independent one: dp_accounting's RDP accountant composing the events of the
releases the test itself counted (not the ledger's)."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from fixtures import held_out_run
from test_round_loop import toy_clients

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.federation.checkpoints import RoundCheckpoints
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.federation.engine import InProcessEngine, InProcessTransport
from fedccrl_core.foundation import contract

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PRIV = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0}
DELTA = 1e-5  # train.privacy.delta's default
N_EACH = 12  # training images per toy client


class Crash(RuntimeError):
    pass


def independent_epsilon(stats: list[dict[str, tuple[int, int]]], weights: list[tuple[int, int]], priv=PRIV) -> float:
    """epsilon at DELTA of the releases counted: each statistics release {client: (n_i, k_i)} is the sampled Gaussian
    (without replacement, replace-one) of its client with the largest k_i / n_i; each weights release (N, m) that of
    the sampled clients, noise z / 2 (sensitivity 2 S / m against a std of z S / m)."""
    events: list[dp_accounting.DpEvent] = []
    for sizes in stats:
        n, k = max(sizes.values(), key=lambda nk: nk[1] / nk[0])
        g = dp_accounting.GaussianDpEvent(priv["stats_noise_multiplier"])
        events.append(g if k == n else dp_accounting.SampledWithoutReplacementDpEvent(n, k, g))
    for clients, sampled in weights:
        g = dp_accounting.GaussianDpEvent(priv["weights_noise_multiplier"] / 2)
        events.append(g if sampled == clients else dp_accounting.SampledWithoutReplacementDpEvent(clients, sampled, g))
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(DELTA))


def test_every_release_is_kept_as_it_is_charged_and_loading_keeps_nothing():
    """RunPrivacy.keep gets the whole ledger at each release (statistics, weights), in order; loading a state (a
    resume) is no release; released_in names the rounds that released."""
    from fedccrl_core.privacy import accountant as A
    from fedccrl_core.privacy.settings import PrivacySettings

    run = A.RunPrivacy(PrivacySettings(**PRIV))
    kept: list[list] = []
    run.keep = kept.append
    run.statistics(1, {"a": (12, 2), "b": (10, 2)})
    run.weights(1, 4, 2)
    run.statistics(2, {})  # nothing uploaded: no release
    assert kept == [[["statistics", 1, 10, 2, 2.0]], [["statistics", 1, 10, 2, 2.0], ["weights", 1, 4, 2, 2.0]]]
    assert run.released_in(1) and not run.released_in(2) and not run.released_in(0)
    run.load_state([["weights", 3, 4, 2, 2.0]])
    assert len(kept) == 2 and run.released_in(3) and not run.released_in(1)


def test_the_ledger_file_is_read_for_its_run_only_and_refused_when_malformed(tmp_path):
    from fedccrl_core.privacy import accountant as A
    from fedccrl_core.privacy.ledger_file import read_ledger, resume
    from fedccrl_core.privacy.settings import PrivacySettings

    path = tmp_path / "ck.pt.ledger.json"
    run = A.RunPrivacy(PrivacySettings(**PRIV))
    assert resume(run, None, path, {"run": 1}) == 0 and read_ledger(path, {"run": 1}) == []
    run.weights(1, 4, 2)
    assert read_ledger(path, {"run": 1}) == [["weights", 1, 4, 2, 2.0]]
    assert read_ledger(path, {"run": 2}) is None  # another configuration's: not this run's releases
    again = A.RunPrivacy(PrivacySettings(**PRIV))
    assert resume(again, None, path, {"run": 1}) == 1 and again.state() == run.state()  # no checkpoint: still charged
    other = A.RunPrivacy(PrivacySettings(**PRIV))
    assert resume(other, None, path, {"run": 2}) == 0 and read_ledger(path, {"run": 2}) == []  # replaced
    for text, why in [
        ("[", "not JSON"),
        ("{}", "no 'fedccrl_privacy_ledger': 1"),
        ('{"fedccrl_privacy_ledger": 1, "owner": null, "releases": {}}', "key 'releases' must be a list"),
        ('{"fedccrl_privacy_ledger": 1, "owner": null, "releases": [["weights", 1, 4, 5, 1.0]]}', "releases.0. ="),
        ('{"fedccrl_privacy_ledger": 1, "owner": null, "releases": [["weights", 1, 4, 2, true]]}', "releases.0. ="),
        ('{"fedccrl_privacy_ledger": 1, "owner": null, "releases": [["model", 1, 4, 2, 1.0]]}', "releases.0. ="),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"ck\.pt\.ledger\.json: .*{why}"):
            read_ledger(path, None)


def counting_engine(released: dict, crash_round: int = 0, late: tuple[str, int] | None = None, claimed_n: int = 0):
    """An InProcessEngine whose transport counts every release as it happens: released["statistics"] gets the
    {client: (n_i, k_i)} of each collect_uploads, released["weights"] the (N, m) of each round whose clients
    trained (the loop aggregates and releases right after). crash_round: training that round raises Crash (after
    its statistics left the clients). late: (client, round): the transport does not know that client's size before that
    round (it missed the previous query).
    claimed_n: the size known_n announces for every client (a client that announced another size before)."""

    class Counting(InProcessTransport):
        def collect_uploads(self, rnd, charged=None):
            ups = super().collect_uploads(rnd, charged)
            released["statistics"].append(
                {cid: (len(self.clients[cid].train_y), len(u["mu"])) for cid, u in ups.items() if u is not None}
            )
            return ups

        def known_n(self):
            known = super().known_n()
            if claimed_n:
                known = dict.fromkeys(known, claimed_n)
            if late is not None and len(released["statistics"]) + 1 == late[1]:
                known[late[0]] = None
            return known

        def train(self, rnd, sampled, global_w, payloads, fold):
            if rnd == crash_round:
                raise Crash(f"interrupted in round {rnd}, after its statistics upload")
            out = super().train(rnd, sampled, global_w, payloads, fold)
            released["weights"].append((len(self.ids), len(sampled)))
            return out

    class Engine(InProcessEngine):
        transport_class = Counting

    return Engine


def run(tmp: Path | None, priv=PRIV, rounds=2, engine=InProcessEngine, on_round=None, log=None, fraction=1.0):
    """FedCCRL on 4 toy clients of N_EACH images (k_i = 2 rows each round), checkpointed at <tmp>/ck.pt."""
    clients = toy_clients(4, N_EACH)
    for c in clients:  # the statistics rows FedCCRL uploads
        x = c.train_x.float() / 255
        c.stats_mu, c.stats_sigma = x.mean((2, 3)).numpy(), x.std((2, 3)).numpy()
    alg = build_algorithm("fedccrl", LocalConfig(rounds=rounds, local_epochs=1, batch_size=4, privacy=priv))
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    r = held_out_run(
        alg,
        model,
        clients,
        (clients[0].train_x, clients[0].train_y),
        rounds,
        client_fraction=fraction,
        checkpoint_path=None if tmp is None else tmp / "ck.pt",
        run_info={"test": "ledger"},
    )
    return train(r, on_round, log or (lambda m: None), engine=engine)


def ledger_releases(tmp: Path) -> list:
    return json.loads((tmp / "ck.pt.ledger.json").read_text())["releases"]


def test_a_round_interrupted_after_its_statistics_release_is_charged_again_on_resume(tmp_path):
    released: dict[str, list] = {"statistics": [], "weights": []}
    with pytest.raises(Crash):
        run(tmp_path, rounds=2, engine=counting_engine(released, crash_round=2))
    assert len(released["statistics"]) == 2 and len(released["weights"]) == 1  # round 2's statistics went out
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert ck["round"] == 1 and len(ck["privacy"]) == 2  # the checkpoint covers round 1 alone
    assert len(ledger_releases(tmp_path)) == 3  # the ledger file holds round 2's statistics too
    logs: list[str] = []
    res = run(tmp_path, rounds=2, engine=counting_engine(released), log=logs.append)
    assert res.resumed_from == 1
    assert len(released["statistics"]) == 3 and len(released["weights"]) == 2  # round 2's statistics released twice
    want = independent_epsilon(released["statistics"], released["weights"])
    assert res.history[-1].metric(contract.DP_EPSILON) == pytest.approx(want, rel=1e-9)
    assert len(ledger_releases(tmp_path)) == 5
    # what the checkpoint alone would have counted is less: the test tells the two apart
    lost = independent_epsilon(released["statistics"][1:], released["weights"])
    assert lost < want * (1 - 1e-3)
    assert any("1 release(s) that no round checkpoint covers" in m for m in logs)
    # no study pointer: the records carry the releases for an operator to count (one ledger id across the resume);
    # the resumed process's first record from the ledger's start, the release no record carried included
    kept = json.loads((tmp_path / "ck.pt.ledger.json").read_text())
    first, last = res.history[0].dp_releases, res.history[-1].dp_releases
    assert first is not None and (first.ledger, first.start, len(first.releases)) == (kept["id"], 0, 2)
    assert last is not None and (last.ledger, last.start, last.releases) == (kept["id"], 0, kept["releases"])


def test_the_ledger_file_is_refused_when_it_does_not_extend_the_checkpoint(tmp_path):
    run(tmp_path, rounds=1)
    path = tmp_path / "ck.pt.ledger.json"
    d = json.loads(path.read_text())
    d["releases"][0][3] += 1  # another sample size than the checkpoint's first release
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"ck\.pt\.ledger\.json: the privacy ledger's releases do not extend"):
        run(tmp_path, rounds=2)


# every toy client: n_i = N_EACH, k_i = ceil(0.1 n_i) = 2 (Eq. 8, train.fedccrl.r and upload's defaults)
TOY_SIZES = {f"c{i:03d}": (N_EACH, 2) for i in range(4)}


def test_max_epsilon_charges_a_client_whose_size_is_not_known_as_the_worst_case():
    """Round 2 within the budget with every size known; the same budget stops the run before round 2's first release
    when one client's size is not known (it missed the previous query): it is charged as releasing every row."""
    exact = independent_epsilon([TOY_SIZES, TOY_SIZES], [(4, 4), (4, 4)])
    limit = {**PRIV, "max_epsilon": exact * 1.001}
    assert len(run(None, limit, rounds=2).history) == 2  # every size known: round 2 fits
    released: dict[str, list] = {"statistics": [], "weights": []}
    logs: list[str] = []
    res = run(None, limit, rounds=2, engine=counting_engine(released, late=("c003", 2)), log=logs.append)
    assert len(res.history) == 1 and released["statistics"] == [TOY_SIZES]  # round 2's statistics never left
    worst = independent_epsilon([TOY_SIZES, {"c003": (1, 1)}], [(4, 4), (4, 4)])
    stop = next(m for m in logs if "privacy budget: round 2" in m)
    assert f"would bring epsilon to {worst:.3f}" in stop


def stopped_after_a_release():
    """The sizes the clients announced before the round (known_n) are larger than those their uploads state: the
    pre-round check of round 2 passes, its statistics go out, and its weights would pass max_epsilon, so the run stops
    there. Returns (result, the records on_round received, the epsilon of the releases counted)."""
    weights = [(4, 4), (4, 4)]
    announced = independent_epsilon([TOY_SIZES, {"c000": (1000, 100)}], weights)  # round 2 as announced: k/n 0.1
    actual = independent_epsilon([TOY_SIZES, TOY_SIZES], weights)  # as released: k/n 2/12
    limit = {**PRIV, "max_epsilon": (announced + actual) / 2}
    released: dict[str, list] = {"statistics": [], "weights": []}
    records: list[dict] = []
    res = run(None, limit, rounds=3, engine=counting_engine(released, claimed_n=1000), on_round=records.append)
    assert len(res.history) == 1 and released["statistics"] == [TOY_SIZES] * 2 and released["weights"] == [(4, 4)]
    return res, records, independent_epsilon(released["statistics"], released["weights"])


def test_a_run_stopped_after_a_release_logs_the_epsilon_it_spent():
    """The last dp_epsilon on_round receives is the epsilon spent, the stopped round's statistics included."""
    res, records, spent = stopped_after_a_release()
    assert spent > res.history[-1].metric(contract.DP_EPSILON) * (1 + 1e-3)  # round 2's statistics: no round record
    last = records[-1]
    assert last.metric(contract.ROUND) == 2 and last.metric(contract.DP_STOPPED) == 1.0
    assert last.metric(contract.DP_EPSILON) == pytest.approx(spent, rel=1e-9)
    assert contract.TARGET_ACC not in last and records[:-1] == res.history


@pytest.mark.full("a DP run and a fresh MLflow store: 15-30 s on the shared CPU")
def test_the_epsilon_spent_is_mlflows_last_dp_epsilon():
    """The records of a run stopped after a release, logged as the train stage logs them (TrainTracking: on_round ->
    ChildRun.log_round): the child run's dp_epsilon in MLflow is the epsilon spent."""
    from mlflow.tracking import MlflowClient

    from fedccrl_pipeline.tracking import ChildRun, parent_run_id

    res, records, spent = stopped_after_a_release()
    child = ChildRun("ledger", parent_run_id("ledger", "k", {}), "r", {}, {})  # conftest: this test's own store
    for rec in records:
        child.log_round(rec)
    child.finish()
    metrics = MlflowClient().get_run(child.run_id).data.metrics  # the latest value of each
    assert metrics[contract.DP_EPSILON] == pytest.approx(spent, rel=1e-9) and metrics[contract.DP_STOPPED] == 1.0
    assert metrics[contract.TARGET_ACC] == res.history[-1].metric(contract.TARGET_ACC)


def _snippets_of_client_states(written: list[dict]) -> list[bytes]:
    """64 bytes from the middle of each optimizer moment the clients' states held (none zero)."""
    out = []
    for state in written:
        for slot in state["optimizer"]["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                raw = slot[key].detach().cpu().contiguous().numpy().tobytes()
                mid = len(raw) // 2
                if len(raw) >= 256 and any(raw[mid : mid + 64]):
                    out.append(raw[mid : mid + 64])
    return out


def _files_holding(folder: Path, snippets: list[bytes]) -> list[str]:
    found = []
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if any(s in data for s in snippets):
            found.append(str(f.relative_to(folder)))
    return found


@pytest.mark.parametrize("private", [True, False])
def test_a_finished_dp_run_leaves_no_client_state_in_its_files(tmp_path, private):
    """Every file the run left (the checkpoint folder) is read through for the bytes of the clients' Adam moments
    (captured as they were written): under DP none holds them and only the checkpoint and the ledger are left; the
    run still resumes (it is complete). Without DP the state files stay, as before (persistent clients)."""
    written: list[dict] = []

    class Capturing(RoundCheckpoints):
        def write_client(self, cid, rnd, state):
            written.append(state)
            super().write_client(cid, rnd, state)

    class Engine(InProcessEngine):
        checkpoints_class = Capturing

    priv = PRIV if private else None
    res = run(tmp_path, priv, rounds=2, engine=Engine)
    snippets = _snippets_of_client_states(written)
    assert len(snippets) > 10
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    if private:
        assert left == ["ck.pt", "ck.pt.ledger.json"], left
        assert _files_holding(tmp_path, snippets) == []
        ck = torch.load(tmp_path / "ck.pt", weights_only=True)
        assert ck["client_records"] == {} and "states" not in ck
        released_or_the_servers = {"global", "best", "best_round", "best_val", "history", "run_info", "server_state"}
        assert set(ck) == released_or_the_servers | {"engine", "privacy", "round", "client_records"}, sorted(ck)
        again = run(tmp_path, priv, rounds=2)
        assert again.resumed_from == 2 and again.history == res.history
    else:
        assert any(name.startswith("ck.pt.clients/") for name in left)
        assert _files_holding(tmp_path, snippets)  # the check finds them where they are


# ---------------------------------------------------------------- over Flower (the loopback Grid of tests/flower_harness.py)
FLOWER_PRIV = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0}


def _count_queries(grid, released: list, tag: str) -> None:
    """Every QUERY reply with an upload, as the client sent it: released gets (tag, round, client, node, n_i, k_i)."""
    from fedccrl_flower import messages as M
    from fedccrl_flower.replies import read_query_reply

    before = grid.tamper

    def tamper(node, reply):
        if before is not None:
            reply = before(node, reply)
        if reply.has_content() and M.WEIGHTS not in reply.content and M.UPLOAD in reply.content:
            cid, n, upload = read_query_reply(reply)
            released.append((tag, int(reply.metadata.group_id), cid, node, n, len(upload["mu"])))
        return reply

    grid.tamper = tamper


def _statistics_events(released: list) -> list[dict[str, tuple[int, int]]]:
    """The statistics releases of the counted query replies: per query (tag, round), the j-th upload of each client
    is the j-th release (a client that answered twice released twice)."""
    out = []
    for q in sorted({(t, r) for t, r, *_ in released}):
        per: dict[str, list] = {}
        for t, r, cid, _node, n, k in released:
            if (t, r) == q:
                per.setdefault(cid, []).append((n, k))
        for j in range(max(len(v) for v in per.values())):
            out.append({cid: v[j] for cid, v in per.items() if len(v) > j})
    return out


@pytest.mark.full("FedCCRL under DP over the loopback Grid, one round of two clients: ~10 s on the CPU")
def test_flower_max_epsilon_charges_a_client_that_joins_late_as_the_worst_case(data, tmp_path):
    """photo_c0 misses round 1's query and joins in round 2. Its size is not known before round 2, so max_epsilon's
    check charges it as releasing every row (Gaussian, unsampled): a budget the known clients' sizes would fit stops
    the run before round 2's query, and no statistics of round 2 leave any client."""
    from flower_harness import loopback, make_spec, serve

    from fedccrl_core.data.shards import load_client
    from fedccrl_flower import messages as M

    alg = build_algorithm("fedccrl", LocalConfig(rounds=2, privacy=FLOWER_PRIV))
    sizes = {}
    for cid in ("art_c0", "cartoon_c0"):
        n = len(load_client(data / "shards", cid).train_y)
        sizes[cid] = (n, alg.released_rows(n))
    known_fits = independent_epsilon([sizes, sizes], [(2, 2), (3, 3)], FLOWER_PRIV)
    worst = independent_epsilon([sizes, {"photo_c0": (1, 1)}], [(2, 2), (3, 3)], FLOWER_PRIV)
    assert worst > known_fits * 1.01
    grid = loopback(data)
    grid.dead = {102}  # photo_c0: no answer to round 1's query

    def revive(node, reply):
        if reply.has_content() and M.WEIGHTS in reply.content:
            grid.dead.clear()  # answers from round 2 on
        return reply

    grid.tamper = revive
    released: list = []
    _count_queries(grid, released, "run")
    logs: list[str] = []
    priv = {**FLOWER_PRIV, "max_epsilon": known_fits * 1.001}
    spec = make_spec(data, tmp_path, "fedccrl", rounds=2, privacy=priv, min_clients=2, query_timeout_s=5)
    res = serve(grid, spec, log=logs.append)
    assert len(res.history) == 1 and {r[2] for r in released} == {"art_c0", "cartoon_c0"}
    assert not [m for m in grid.sent if m.metadata.message_type == M.QUERY and m.metadata.group_id == "2"]
    stop = next(m for m in logs if "privacy budget: round 2" in m)
    assert f"would bring epsilon to {worst:.3f}" in stop


def _shrunk_copy(data: Path, out: Path, cid: str, n: int) -> Path:
    """A copy of data/{shards,pools} in which client `cid` holds only its first `n` training images and their
    statistics (its site's image folder shrank, and it prepared its shards again)."""
    import shutil

    import numpy as np

    from fedccrl_core.data.shards import class_hist

    for part in ("shards", "pools"):
        shutil.copytree(data / part, out / part)
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    entry = next(c for c in manifest["clients"] if c["id"] == cid)
    with np.load(out / "shards" / entry["file"]) as z:
        arrays = {k: z[k][:n] if k.startswith("train_") else z[k] for k in z.files}
    np.savez(out / "shards" / entry["file"], **arrays)
    entry["n_train"], entry["train_class_hist"] = n, class_hist(arrays["train_y"], manifest["num_classes"])
    (out / "shards" / "manifest.json").write_text(json.dumps(manifest))
    pools = json.loads((out / "pools" / "manifest.json").read_text())
    pool = next(c for c in pools["clients"] if c["id"] == cid)
    with np.load(out / "pools" / pool["file"]) as z:
        np.savez(out / "pools" / pool["file"], mu=z["mu"][:n], sigma=z["sigma"][:n])
    pool["n"] = n
    (out / "pools" / "manifest.json").write_text(json.dumps(pools))
    return out


@pytest.mark.full("FedCCRL under DP over the loopback Grid, two rounds of three then two clients: ~8 s on the CPU")
def test_flower_max_epsilon_a_site_whose_folder_shrank_refuses_and_is_charged_next_round(data, tmp_path):
    """photo_c0's folder shrinks to 11 images before round 2 (k = 2 of 11, a larger sampling ratio than any size the
    pre-round check read). It refuses round 2's release before drawing a row, named in the round's record with both
    sizes; art_c0 and cartoon_c0 train. Round 3's check charges its new size and stops the run. epsilon equals an
    independent accountant's over the releases counted here and never exceeds max_epsilon, which round 2 would have
    passed had photo_c0 released."""
    from flower_harness import SOURCES, loopback, make_spec, serve

    from fedccrl_core.data.shards import load_client
    from fedccrl_flower import messages as M

    alg = build_algorithm("fedccrl", LocalConfig(rounds=3, privacy=FLOWER_PRIV))
    sizes = {c: len(load_client(data / "shards", c).train_y) for c in SOURCES}
    nk = {c: (n, alg.released_rows(n)) for c, n in sizes.items()}  # what round 1 releases, and round 2's check reads
    shrunk = {**nk, "photo_c0": (11, alg.released_rows(11))}
    assert shrunk["photo_c0"] == (11, 2) and all(2 / 11 > k / n for n, k in nk.values())
    checked = independent_epsilon([nk, nk], [(3, 3), (3, 3)], FLOWER_PRIV)  # round 2 as its check reads it
    unchecked = independent_epsilon([nk, shrunk], [(3, 3), (3, 3)], FLOWER_PRIV)  # photo_c0 releasing in round 2
    limit = (checked + unchecked) / 2
    small = _shrunk_copy(data, tmp_path / "small", "photo_c0", 11)
    grid = loopback(data)
    push = grid.push_messages

    def shrink_before_round_2(messages):
        if messages and messages[0].metadata.message_type == M.QUERY and messages[0].metadata.group_id == "2":
            grid.contexts[102].node_config.update(
                {M.NODE_SHARDS: str(small / "shards"), M.NODE_POOLS: str(small / "pools")}
            )
        return push(messages)

    grid.push_messages = shrink_before_round_2
    released: list = []
    _count_queries(grid, released, "run")
    logs: list[str] = []
    spec = make_spec(
        data, tmp_path / "run", "fedccrl", rounds=3, privacy={**FLOWER_PRIV, "max_epsilon": limit}, min_clients=2
    )
    res = serve(grid, spec, log=logs.append)
    assert [r.metric(contract.ROUND) for r in res.history] == [1, 2]
    assert sorted((r[1], r[2]) for r in released) == [(1, c) for c in SOURCES] + [(2, "art_c0"), (2, "cartoon_c0")]
    refused = _records(tmp_path / "run")[1].refused_clients
    assert [r.client for r in refused] == ["photo_c0"]
    old = nk["photo_c0"][0]
    assert f"from the n = {old} the pre-round check read to n = 11" in refused[0].reason
    assert "k = 2 of its n = 11 rows" in refused[0].reason and "refused before any row was drawn" in refused[0].reason
    assert any("REFUSED reply of photo_c0" in m for m in logs)
    trained = [
        (r, sum(m.metadata.message_type == M.TRAIN and m.metadata.group_id == str(r) for m in grid.sent))
        for r in (1, 2)
    ]
    weights = [(sum(x[1] == r for x in released), m) for r, m in trained]
    assert weights == [(3, 3), (2, 2)]
    spent = independent_epsilon(_statistics_events(released), weights, FLOWER_PRIV)
    assert res.history[-1].metric(contract.DP_EPSILON) == pytest.approx(spent, rel=1e-9)
    assert spent <= limit < unchecked
    assert max(r.metric(contract.DP_EPSILON) for r in _records(tmp_path / "run")) <= limit  # every record MLflow got
    stop = next(m for m in logs if "privacy budget: round 3" in m)
    round_3 = independent_epsilon([*_statistics_events(released), shrunk], [*weights, (3, 3)], FLOWER_PRIV)
    assert f"would bring epsilon to {round_3:.3f}" in stop and round_3 > limit
    assert not [m for m in grid.sent if m.metadata.message_type == M.QUERY and m.metadata.group_id == "3"]


@pytest.mark.full("FedCCRL under DP over the loopback Grid, three ServerApp runs, two rounds in all: ~25 s on the CPU")
def test_flower_resume_after_a_release_with_a_late_client_and_a_duplicated_id(data, tmp_path):
    """Run 1: photo_c0 misses round 1's query and joins in round 2; the ServerApp dies in round 2 after the
    statistics upload. Run 2 (a resume): art_c0 answers from a second SuperNode too: the run is refused, naming the
    client and both nodes, before any upload is used, and both uploads are charged. Run 3 resumes and completes. The
    ledger's epsilon equals an independent accountant's over every statistics upload the clients sent and every
    aggregate released."""
    from flower_harness import loopback, make_spec, serve

    from fedccrl_flower import messages as M
    from fedccrl_flower.query_phase import DuplicateClient

    spec = make_spec(data, tmp_path, "fedccrl", rounds=2, privacy=FLOWER_PRIV, min_clients=2, query_timeout_s=5)
    released: list = []
    grid = loopback(data)
    grid.dead = {102}
    trained = []

    def crash(node, reply):
        if reply.has_content() and M.WEIGHTS in reply.content:
            grid.dead.clear()
            trained.append(int(reply.metadata.group_id))
            if trained[-1] == 2:
                raise Crash("the ServerApp dies in round 2, after its statistics upload")
        return reply

    grid.tamper = crash
    _count_queries(grid, released, "1")
    with pytest.raises(Crash):
        serve(grid, spec)
    assert sorted({(r[1], r[2]) for r in released}) == [
        (1, "art_c0"),
        (1, "cartoon_c0"),
        (2, "art_c0"),
        (2, "cartoon_c0"),
        (2, "photo_c0"),
    ]
    grid = loopback(data, clients=["art_c0", "cartoon_c0", "photo_c0", "art_c0"])  # node 103: art_c0 again
    _count_queries(grid, released, "2")
    with pytest.raises(
        DuplicateClient, match=r"round 2: client art_c0 answered the query from two SuperNodes, nodes 100 and 103"
    ):
        serve(grid, spec)
    assert not [m for m in grid.sent if m.metadata.message_type == M.TRAIN]  # nothing used
    assert len([r for r in released if r[0] == "2" and r[2] == "art_c0"]) == 2
    grid = loopback(data)
    _count_queries(grid, released, "3")
    res = serve(grid, spec)
    assert res.resumed_from == 1 and [r.metric(contract.ROUND) for r in res.history] == [1, 2]
    weights = [(2, 2), (3, 3)]  # the aggregates released: round 1 of 2 clients, round 2 of 3 (client_fraction 1)
    want = independent_epsilon(_statistics_events(released), weights, FLOWER_PRIV)
    assert res.history[-1].metric(contract.DP_EPSILON) == pytest.approx(want, rel=1e-9)
    assert len(json.loads((tmp_path / "checkpoint.pt.ledger.json").read_text())["releases"]) == 7
    assert [r.metric("clients") for r in res.history] == [2, 3]
    assert not (tmp_path / "checkpoint.pt.clients").exists()  # the clients' states stay on the SuperNodes


def _records(folder: Path) -> list:
    """The records the ServerApp passed to on_round (its rounds.jsonl), typed as the launcher reads them."""
    from fedccrl_core.federation.round_record import parse_round

    lines = (folder / contract.FLOWER_ROUNDS_FILE).read_text().splitlines()
    return [parse_round(json.loads(line), f"line {i}") for i, line in enumerate(lines, 1)]


def _stop_on_the_second_pull(grid) -> None:
    """The ServerApp is stopped (`flwr stop`: Flower's SIGTERM handler raises SystemExit in the ServerApp's main
    thread) while the query's replies come in: after the first pull of the exchange returned some."""
    pull, calls = grid.pull_messages, []

    def pull_messages(ids):
        calls.append(ids)
        if len(calls) == 2:
            raise SystemExit(3)
        return pull(ids)

    grid.pull_messages = pull_messages


def _no_train_reply(grid) -> None:
    """Every node goes silent once the TRAIN messages are sent: the round fails in its train phase."""
    from fedccrl_flower import messages as M

    push = grid.push_messages

    def push_messages(messages):
        if messages and messages[0].metadata.message_type == M.TRAIN:
            grid.dead = set(grid.contexts)
        return push(messages)

    grid.push_messages = push_messages


@pytest.mark.parametrize("how", ["silent", "stopped", "train"])
def test_flower_uploads_of_a_failed_round_are_charged_and_logged(data, tmp_path, how):
    """FedCCRL under DP over the loopback Grid, min_clients 3; round 1 fails after statistics uploads reached the
    ServerApp: photo_c0 is silent in the query (too few clients), or the ServerApp is stopped while the query's replies
    come in (photo_c0's never does), or no client answers TRAIN (too few updates). Every upload that arrived is charged
    in the ledger file, and the last record on_round received (rounds.jsonl, what MLflow logs) is a SpentRecord whose
    dp_epsilon is an independent accountant's over the uploads the test counted."""
    from flower_harness import loopback, make_spec, serve

    from fedccrl_flower.transport import RoundFailure

    grid = loopback(data)
    released: list = []
    _count_queries(grid, released, "run")
    if how in ("silent", "stopped"):
        grid.dead = {102}  # photo_c0
    if how == "stopped":
        _stop_on_the_second_pull(grid)
    if how == "train":
        _no_train_reply(grid)
    spec = make_spec(data, tmp_path, "fedccrl", rounds=2, privacy=FLOWER_PRIV, min_clients=3, query_timeout_s=5)
    error, status = {
        "silent": (RoundFailure, "failed"),
        "stopped": (SystemExit, "stopped"),
        "train": (RoundFailure, "failed"),
    }[how]
    with pytest.raises(error):
        serve(grid, spec)
    assert json.loads((tmp_path / contract.FLOWER_STATUS_FILE).read_text())["status"] == status
    counted = sorted(r[2] for r in released)
    assert counted == (["art_c0", "cartoon_c0", "photo_c0"] if how == "train" else ["art_c0", "cartoon_c0"])
    spent = independent_epsilon(_statistics_events(released), [], FLOWER_PRIV)
    kept = json.loads((tmp_path / "checkpoint.pt.ledger.json").read_text())["releases"]
    assert [r[:2] for r in kept] == [["statistics", 1]]
    last = _records(tmp_path)[-1]
    assert last.metric(contract.ROUND) == 1 and last.metric(contract.DP_STOPPED) == 1.0
    assert last.metric(contract.DP_EPSILON) == pytest.approx(spent, rel=1e-9)


@pytest.mark.parametrize("private", [True, False])
def test_a_finished_dp_flower_run_leaves_no_client_state_in_its_folders(data, tmp_path, monkeypatch, private):
    """`train.engine: flower` (fedccrl_flower/run.py run_flower) with its local SuperNodes on the loopback Grid
    (flower_harness.LoopbackFederation: the node configs run_flower gives them, client-state folder included): every
    file left under the run's folders is read through for the bytes of the clients' Adam moments (captured as the
    ClientApps saved them). Under DP none holds them and <work_dir>/client-state/ is gone; without DP it stays."""
    from flower_harness import SOURCES, LoopbackFederation, make_spec

    from fedccrl_flower import client_app, run
    from fedccrl_flower.settings import FlowerSettings

    written: list[dict] = []
    save = client_app.save_client_state

    def capturing(context, state_key, cid, rnd, state, base):
        written.append(state.to_dict())
        save(context, state_key, cid, rnd, state, base)

    monkeypatch.setattr(client_app, "save_client_state", capturing)
    monkeypatch.setattr(run, "LocalFederation", LoopbackFederation)
    work = tmp_path / "ck.flower"
    spec = make_spec(data, work, "fedavg", rounds=1, privacy=FLOWER_PRIV if private else None, min_clients=3)
    logs: list[str] = []
    res = run.run_flower(FlowerSettings(min_clients=3), spec, data / "shards", data / "pools", log=logs.append)
    assert len(res.history) == 1 and len(written) == len(SOURCES)
    snippets = _snippets_of_client_states(written)
    assert len(snippets) > 10
    if private:
        assert not (work / "client-state").exists() and _files_holding(tmp_path, snippets) == []
        assert any("client-state" in m and "removed" in m for m in logs)
    else:
        assert sorted(p.name for p in (work / "client-state").rglob("*.npz")) == [f"{c}.npz" for c in SOURCES]
        assert _files_holding(tmp_path, snippets)  # the check finds them where they are
