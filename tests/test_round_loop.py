"""The one round loop (federation/loop.py): streamed Eq. 2, per-client state files written only for
the clients a round trains, stateless clients, resume at many clients, round checkpoints that keep
the previous one and fall back from a corrupt latest one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from fixtures import evalsets_for

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.algorithms.base import ListAggregation, Reply
from fedccrl_core.federation.checkpoints import CheckpointFallbackWarning
from fedccrl_core.federation.engine import InProcessEngine
from fedccrl_core.federation.loop import EvalSets
from fedccrl_core.learning.clients import ClientData

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HPARAMS = {"ccst": {"adain_weights": "random", "K": 2}}
SIZE = 16


def toy_clients(n_clients: int, n_each: int, seed: int = 0) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        x = torch.randint(0, 256, (n_each, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 6, (n_each,), generator=g)
        out.append(ClientData(f"c{i:03d}", f"d{i % 3}", x, y, x[:2], y[:2]))
    return out


def evalsets(clients) -> EvalSets:
    return evalsets_for(clients[:6], (clients[0].train_x, clients[0].train_y))


def test_evalsets_for_a_target_are_the_clients_val_splits_and_the_target_images_as_nchw():
    clients = toy_clients(3, 5)
    x = np.random.default_rng(0).integers(0, 256, (7, SIZE, SIZE, 3), dtype=np.uint8)  # NHWC, as the shards hold it
    y = (np.arange(7) % 6).astype(np.int32)
    ev = EvalSets.for_target(clients, x, y, 32, "cpu")
    assert torch.equal(ev.val_x, torch.cat([c.val_x for c in clients]))
    assert torch.equal(ev.val_y, torch.cat([c.val_y for c in clients]))
    assert ev.target_x.dtype == torch.uint8 and ev.target_x.is_contiguous()
    assert torch.equal(ev.target_x, torch.from_numpy(x).permute(0, 3, 1, 2))
    assert ev.target_y.dtype == torch.int64 and ev.target_y.tolist() == y.tolist() and ev.batch_size == 32


def engine(
    clients, rounds=2, fraction=1.0, ckpt=None, algorithm="fedavg", client_state="persistent", on_round=None
) -> InProcessEngine:
    alg = build_algorithm(algorithm, LocalConfig(rounds=rounds, local_epochs=1, batch_size=4))
    torch.manual_seed(0)
    model = alg.build_model("small_cnn", 6, "none", alg.hp)
    return InProcessEngine(
        alg,
        model,
        clients,
        evalsets(clients),
        rounds,
        seed=0,
        client_fraction=fraction,
        checkpoint_path=ckpt,
        log=lambda m: None,
        client_state=client_state,
        run_info={"test": algorithm},
        on_round=on_round,
    )


# ------------------------------------------------------------------ streamed Eq. 2
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_streamed_aggregate_equals_list_aggregate(algorithm):
    local = LocalConfig(rounds=2)
    torch.manual_seed(0)
    model = build_algorithm(algorithm, local, HPARAMS.get(algorithm)).build_model(
        "small_cnn", 6, "none", build_algorithm(algorithm, local, HPARAMS.get(algorithm)).hp
    )
    global_w = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    replies = [
        Reply(
            f"c{i}",
            {
                k: (v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + i)
                for k, v in global_w.items()
            },
            n,
            {"train_acc": 0.5, "ga_gap": 0.1 * i},
        )
        for i, n in enumerate([7, 30, 12, 1])
    ]
    as_list = build_algorithm(algorithm, local, HPARAMS.get(algorithm)).aggregate(global_w, replies)
    for total in (None, float(sum(r.n for r in replies))):  # N unknown, or announced before the replies
        agg = build_algorithm(algorithm, local, HPARAMS.get(algorithm)).aggregation(global_w, total)
        for r in replies:
            agg.add(r)
        streamed = agg.result()
        assert streamed.keys() == as_list.keys()
        for k in as_list:
            assert streamed[k].dtype == as_list[k].dtype, k
            diff = (streamed[k].double() - as_list[k].double()).abs().max().item()
            if total is not None and not isinstance(agg, ListAggregation):
                assert diff == 0.0, (k, diff)  # the same terms in the same order: the same bits
            assert diff <= 1e-6, (k, diff)
    if algorithm != "ga":  # GA's weights need every client's gap before any sum: the list form, said so
        assert not isinstance(
            build_algorithm(algorithm, local, HPARAMS.get(algorithm)).aggregation(global_w), ListAggregation
        )


# ------------------------------------------------------------------ per-client state: incremental checkpoints
@pytest.mark.parametrize("algorithm", ["fedavg", "fedbn"])
def test_checkpoint_bytes_follow_the_clients_trained(tmp_path, algorithm):
    """60 clients at client_fraction 0.1 and 6 clients at 1.0 both train 6 clients a round: a round's
    checkpoint writes within 10 % of the same bytes: a round's checkpoint costs what its clients did."""
    written = {}
    for n, fraction in ((6, 1.0), (60, 0.1)):
        e = engine(
            toy_clients(n, 8), rounds=2, fraction=fraction, ckpt=tmp_path / f"{n}" / "ck.pt", algorithm=algorithm
        )
        res = e.run()
        assert all(len([k for k in r.to_dict() if k.startswith("train_acc/")]) == 6 for r in res.history)
        written[n] = e.checkpoints.bytes_written
        # one state file per round, one record per client trained (its newest state)
        state_files = sorted(f.name for f in (tmp_path / f"{n}" / "ck.pt.clients").iterdir())
        assert state_files == sorted({f"r{r}.bin" for r, _, _ in e.checkpoints.client_records.values()})
        assert state_files == (["r2.bin"] if n == 6 else ["r1.bin", "r2.bin"]), state_files  # all retrained at 6
        assert len(e.checkpoints.client_records) == len(
            {k for r in res.history for k in r.to_dict() if k.startswith("train_acc/")}
        )
    assert abs(written[60] - written[6]) <= 0.1 * written[6], written
    assert written[6] > 6 * 1000  # the client states are in it (Adam moments of the small CNN)


def test_stateless_clients_write_no_client_state(tmp_path):
    sizes = {}
    for n, fraction in ((6, 1.0), (60, 0.1)):
        e = engine(
            toy_clients(n, 8), rounds=2, fraction=fraction, ckpt=tmp_path / f"{n}" / "ck.pt", client_state="stateless"
        )
        e.run()
        sizes[n] = (e.checkpoints.bytes_written, (tmp_path / f"{n}" / "ck.pt").stat().st_size)
        assert not (tmp_path / f"{n}" / "ck.pt.clients").exists() or not list(
            (tmp_path / f"{n}" / "ck.pt.clients").iterdir()
        )
    # no per-client state: the checkpoint does not grow with the clients (a persistent client's Adam state is
    # > 1 KB, so 54 more clients would add > 10 %); what differs is the round records' client ids and metrics
    assert abs(sizes[60][0] - sizes[6][0]) <= 0.01 * sizes[6][0], sizes
    assert all(written == on_disk for written, on_disk in sizes.values()), sizes


def test_stateless_clients_start_each_round_with_a_fresh_optimizer():
    clients = toy_clients(3, 8)
    persistent = engine(clients, rounds=2).run()
    stateless = engine(clients, rounds=2, client_state="stateless").run()
    assert (
        persistent.history[0].to_dict()["loss"] == stateless.history[0].to_dict()["loss"]
    )  # round 1: both start fresh
    assert (
        persistent.history[1].to_dict()["loss"] != stateless.history[1].to_dict()["loss"]
    )  # round 2: Adam's moments differ
    # another value of train.client_state is the schema's to refuse (tests/test_schema_bounds.py)


class Crash(RuntimeError):
    pass


def crash_at(rnd):
    def on_round(rec):
        if rec.to_dict()["round"] == rnd:
            raise Crash(f"killed in round {rnd}")

    return on_round


def assert_same_run(a, b):
    assert [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in a.history] == [
        {k: v for k, v in r.to_dict().items() if k != "seconds"} for r in b.history
    ]
    for k, v in a.final_weights.items():
        assert torch.equal(v, b.final_weights[k]), k


def test_resume_at_60_clients_gives_identical_metrics(tmp_path):
    clients = toy_clients(60, 8)
    whole = engine(clients, rounds=4, fraction=0.1).run()
    ck = tmp_path / "ck.pt"
    with pytest.raises(Crash):
        engine(clients, rounds=4, fraction=0.1, ckpt=ck, on_round=crash_at(3)).run()
    resumed = engine(clients, rounds=4, fraction=0.1, ckpt=ck).run()
    assert resumed.resumed_from == 2
    assert_same_run(resumed, whole)
    trained = [{k[len("train_acc/") :] for k in r.to_dict() if k.startswith("train_acc/")} for r in whole.history]
    assert trained[1] & trained[2] or trained[0] & trained[2] or trained[0] & trained[3], (
        "a client must train twice for the resume to read a state file back"
    )


# ------------------------------------------------------------------ round checkpoints
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    clients = toy_clients(6, 8)
    whole = engine(clients, rounds=4, fraction=0.5).run()
    ck = tmp_path / "ck.pt"
    with pytest.raises(Crash):
        engine(clients, rounds=4, fraction=0.5, ckpt=ck, on_round=crash_at(4)).run()
    prev = ck.with_name("ck.pt.prev")
    assert torch.load(ck, weights_only=False)["round"] == 3 and torch.load(prev, weights_only=False)["round"] == 2
    ck.write_bytes(ck.read_bytes()[:1000])  # a torn latest checkpoint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = engine(clients, rounds=4, fraction=0.5, ckpt=ck).run()
    assert any(issubclass(w.category, CheckpointFallbackWarning) for w in caught)
    assert resumed.resumed_from == 2  # from the previous checkpoint, not from scratch
    assert_same_run(resumed, whole)
    # completed: pruned to the latest checkpoint and the state files it names
    assert not prev.exists() and not ck.with_name("ck.pt.corrupt").exists()
    named = torch.load(ck, weights_only=False)["client_records"]
    assert sorted(f.name for f in (tmp_path / "ck.pt.clients").iterdir()) == sorted(
        {f"r{r}.bin" for r, _, _ in named.values()}
    )


def test_unreadable_checkpoint_without_a_previous_one_starts_fresh(tmp_path):
    ck = tmp_path / "ck.pt"
    ck.write_bytes(b"not a checkpoint")
    clients = toy_clients(3, 8)
    res = engine(clients, rounds=1, ckpt=ck).run()
    assert res.resumed_from == 0 and torch.load(ck, weights_only=False)["round"] == 1


# ------------------------------------------------------------------ one state file per round
def test_a_client_record_reads_back_bit_identical():
    """Raw tensor bytes behind a pickle: every dtype and shape (0-dim Adam steps, bfloat16, empty), numpy
    arrays and the containers' types come back as they went in, and a record starts at ALIGN."""
    import io
    from collections import OrderedDict

    import numpy as np

    from fedccrl_core.federation.checkpoints import ALIGN, read_record, write_record

    g = torch.Generator().manual_seed(3)
    state = {
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(7.0),
                    "exp_avg": torch.randn(5, 3, generator=g),
                    "exp_avg_sq": torch.randn(5, 3, generator=g).t(),
                }
            },  # not contiguous
            "param_groups": [{"lr": 0.003, "betas": (0.9, 0.999), "params": [0]}],
        },
        "scheduler": None,
        "extra": {
            "bn": OrderedDict(
                w=torch.randn(4, generator=g).bfloat16(),
                n=torch.tensor(3),
                e=torch.zeros(0, 2),
                b=torch.tensor([True, False]),
            ),
            "bank": {"mu": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "loss": 0.25,
        },
    }
    f = io.BytesIO()
    n = write_record(state, f)
    write_record(state, f)  # a second record behind the first
    assert n % ALIGN == 0 and f.tell() == 2 * n
    raw = np.frombuffer(f.getvalue(), dtype=np.uint8).copy()
    for back in (read_record(raw[:n]), read_record(raw[n:])):
        o, s = back["optimizer"]["state"][0], state["optimizer"]["state"][0]
        for k in s:
            assert o[k].dtype == s[k].dtype and torch.equal(o[k], s[k]), k
        assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
        assert type(back["extra"]["bn"]) is OrderedDict and list(back["extra"]["bn"]) == ["w", "n", "e", "b"]
        for k, v in state["extra"]["bn"].items():
            assert back["extra"]["bn"][k].dtype == v.dtype and torch.equal(back["extra"]["bn"][k], v), k
        assert np.array_equal(back["extra"]["bank"]["mu"], state["extra"]["bank"]["mu"])
        assert back["scheduler"] is None and back["extra"]["loss"] == 0.25


def test_round_state_files_stay_near_the_live_states(tmp_path):
    """Clients trained in round t keep round t's file alive; a file less than half live has its live
    records copied forward, so the state files on disk stay under about twice the live states, and a
    resume after many rounds still reads every client back (identical run)."""
    clients = toy_clients(12, 4)
    ck = tmp_path / "ck.pt"
    rounds = 8
    whole = engine(clients, rounds=rounds, fraction=0.25).run()

    e = engine(clients, rounds=rounds, fraction=0.25, ckpt=ck, on_round=crash_at(rounds))
    sizes = []
    orig_save = e.checkpoints.save

    def save(rnd, main, trained):
        out = orig_save(rnd, main, trained)
        disk = sum(f.stat().st_size for f in (tmp_path / "ck.pt.clients").iterdir() if f.name.startswith("r"))
        live = sum(n for _, _, n in e.checkpoints.client_records.values())
        prev_only = {r for r, _, _ in e.checkpoints._prev_records.values()} - {
            r for r, _, _ in e.checkpoints.client_records.values()
        }
        disk -= sum(e.checkpoints.round_file(r).stat().st_size for r in prev_only)  # kept for P.prev only
        sizes.append((disk, live))
        return out

    e.checkpoints.save = save
    with pytest.raises(Crash):
        e.run()
    assert all(disk <= 2 * live + 3 * (live // 12 + 1) for disk, live in sizes), sizes
    assert len(list((tmp_path / "ck.pt.clients").iterdir())) < rounds - 1
    trained = [{k[len("train_acc/") :] for k in r.to_dict() if k.startswith("train_acc/")} for r in whole.history]
    copied = [c for c, (r, _, _) in e.checkpoints.client_records.items() if c not in trained[r - 1]]
    assert copied, "no record was copied forward: the test does not reach a half-live round file"
    resumed = engine(clients, rounds=rounds, fraction=0.25, ckpt=ck).run()
    assert resumed.resumed_from == rounds - 1
    assert_same_run(resumed, whole)


def test_a_checkpoint_of_the_one_file_per_client_format_is_not_resumed(tmp_path):
    clients = toy_clients(3, 8)
    ck = tmp_path / "ck.pt"
    engine(clients, rounds=1, ckpt=ck).run()
    old = torch.load(ck, weights_only=False)
    old["client_files"] = {"c000": 1}
    torch.save(old, ck)
    logs = []
    e = engine(clients, rounds=2, ckpt=ck)
    e.checkpoints.log = logs.append
    assert e.run().resumed_from == 0
    assert any("one-file-per-client" in m for m in logs), logs


@pytest.mark.parametrize(
    "script, best",
    [
        # round: (val_acc, sites that did not evaluate): round 2's 0.9 is over fewer sites, round 3 is the best of
        # the complete rounds
        ({1: (0.3, ()), 2: (0.9, ("sketch_c0",)), 3: (0.6, ()), 4: (0.95, ("art_c0", "sketch_c0"))}, 3),
        ({1: (0.3, ("art_c0",)), 2: (0.5, ("art_c0",)), 3: (0.4, ("b",))}, 2),  # no complete round: the best partial
        ({1: (0.9, ("art_c0",)), 2: (0.2, ())}, 2),  # the first complete round beats any partial one
    ],
    ids=["a-partial-round-is-not-compared", "only-partial-rounds", "complete-beats-partial"],
)
def test_best_val_compares_only_rounds_evaluated_by_the_same_sites(script, best):
    """Best-val selection over comparable rounds: a round whose evaluation missed a site of the run (a federated
    evaluation with a site dropped, fedccrl_flower/evalsets.py `pool`) is not compared with complete rounds, even
    with the highest validation accuracy; the sites it missed are in its record."""
    from fedccrl_core.federation.loop import Evaluation

    class Scripted:  # the Evaluator protocol, as the Flower ServerApp's evaluation on the sites
        def evaluate(self, rnd, global_w):
            val, missing = script[rnd]
            record = {"eval_missing": list(missing)} if missing else {}
            return Evaluation(val, 0.5, 2, 2, 10, record=record, missing=missing)

    e = engine(toy_clients(2, 8), rounds=len(script))
    e.loop.evalsets = Scripted()
    res = e.run()
    assert res.best_round == best
    assert [r.eval_missing or [] for r in res.history] == [list(script[r][1]) for r in sorted(script)]
