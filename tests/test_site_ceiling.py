"""A site's own ceiling on a run's privacy (site.toml max_epsilon / max_delta, fedccrl_flower/site_ceiling.py): the
site, not the server, decides that its images are released only under train.privacy and how much one run may spend."""

from __future__ import annotations

from pathlib import Path

import pytest
from flower_harness import SOURCES, loopback, make_spec, serve

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower import messages as M
from fedccrl_flower.node_config import NODE_MAX_DELTA, NODE_MAX_EPSILON, NODE_MAX_STUDY_EPSILON, NODE_STATE_DIR
from fedccrl_flower.site_budget import LEDGER_FILE, admit_run, read_ledger
from fedccrl_flower.site_ceiling import check_ceiling, check_eval_split

PRIV = {"enabled": True, "weights_noise_multiplier": 4.0, "noise_seed": 3}


def _context(node_config: dict):
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def _local(privacy: dict | None) -> LocalConfig:
    return LocalConfig(privacy=None if privacy is None else PrivacySettings(**privacy))


@pytest.mark.parametrize(
    ("node", "privacy", "refused"),
    [
        ({}, None, None),  # no ceiling: any run
        ({NODE_MAX_EPSILON: 8.0}, None, "train.privacy off"),
        ({NODE_MAX_EPSILON: 8.0}, {**PRIV, "enabled": False}, "train.privacy off"),
        ({NODE_MAX_EPSILON: 8.0}, PRIV, "max_epsilon is 0 (no limit)"),
        ({NODE_MAX_EPSILON: 8.0}, {**PRIV, "max_epsilon": 8.5}, "max_epsilon 8.5 is over this site's max_epsilon 8"),
        ({NODE_MAX_EPSILON: 8.0}, {**PRIV, "max_epsilon": 8.0}, None),
        ({NODE_MAX_EPSILON: 8.0}, {**PRIV, "max_epsilon": 2.0, "delta": 1e-4}, "delta 0.0001 is over"),
        ({NODE_MAX_EPSILON: 8.0, NODE_MAX_DELTA: 1e-3}, {**PRIV, "max_epsilon": 2.0, "delta": 1e-4}, None),
        ({NODE_MAX_EPSILON: 8}, {**PRIV, "max_epsilon": 8.0}, None),  # a TOML integer
        ({NODE_MAX_EPSILON: True}, {**PRIV, "max_epsilon": 1.0}, "'max-epsilon': True is not a number"),
        ({NODE_MAX_EPSILON: "eight"}, {**PRIV, "max_epsilon": 1.0}, "'max-epsilon': 'eight' is not a number"),
    ],
)
def test_the_ceiling_admits_only_runs_that_spend_at_most_it(node, privacy, refused, not_private):
    ctx, local = _context(node), _local(privacy)
    if refused is None:
        check_ceiling(ctx, local, "art_c0")
    else:
        with pytest.raises(ValueError) as e:
            check_ceiling(ctx, local, "art_c0")
        assert refused in str(e.value)
        assert "not a number" in refused or str(e.value).startswith("client art_c0: refused:")


def test_an_evaluation_only_run_counts_only_the_val_rows_of_a_site_with_a_ceiling():
    check_eval_split(_context({}), "all", "art_c0")  # no ceiling: the operator's choice
    check_eval_split(_context({NODE_MAX_EPSILON: 4.0}), "val", "art_c0")
    with pytest.raises(ValueError, match="client art_c0: refused: split 'all' would count the site's train rows"):
        check_eval_split(_context({NODE_MAX_EPSILON: 4.0}), "all", "art_c0")


def test_loopback_a_site_with_a_ceiling_is_refused_by_name_from_runs_that_may_spend_more(data, tmp_path, not_private):
    """art_c0 sets max_epsilon 8: a run without train.privacy, and one whose max_epsilon is 20, go on without it
    (refused at every QUERY, by client id, with the reason); a run at max_epsilon 8 trains on it."""

    def run(work, privacy):
        grid = loopback(data)
        grid.contexts[100].node_config[NODE_MAX_EPSILON] = 8.0
        assert grid.contexts[100].node_config[M.NODE_CLIENT_ID] == SOURCES[0] == "art_c0"
        return serve(grid, make_spec(data, tmp_path / work, "fedavg", rounds=1, min_clients=2, privacy=privacy))

    for work, privacy, reason in [
        ("off", None, "the run has train.privacy off; this site's max_epsilon 8 at delta <= 1e-05"),
        ("loose", {**PRIV, "max_epsilon": 20.0}, "the run's train.privacy.max_epsilon 20 is over this site's"),
    ]:
        (rec,) = run(work, privacy).history
        assert [(r.client, reason in r.reason) for r in rec.refused_clients or []] == [("art_c0", True)], work
        assert rec.metric("clients") == 2
    (rec,) = run("within", {**PRIV, "max_epsilon": 8.0}).history
    assert not rec.refused_clients and rec.metric("clients") == 3


def _site(state: Path | None, budget: float, ceiling: float = 8.0):
    node = {NODE_MAX_EPSILON: ceiling, NODE_MAX_STUDY_EPSILON: budget}
    return _context(node if state is None else {**node, NODE_STATE_DIR: str(state)})


def test_a_site_admits_runs_while_the_sum_of_their_ceilings_fits_its_budget(tmp_path, not_private):
    """Basic composition: the runs a site trains in are together (sum of their max_epsilon)-DP on its images."""
    ctx, ledger = _site(tmp_path / "state", 20.0), tmp_path / "state" / LEDGER_FILE
    admit_run(ctx, _local({**PRIV, "max_epsilon": 8.0}), "run-a", "art_c0")
    admit_run(ctx, _local({**PRIV, "max_epsilon": 8.0}), "run-a", "art_c0")  # its later rounds, a resume: once
    admit_run(ctx, _local({**PRIV, "max_epsilon": 6.0, "delta": 1e-6}), "run-b", "art_c0")
    before = ledger.read_bytes()
    with pytest.raises(ValueError, match=r"client art_c0: refused: this site has admitted 2 runs of max_epsilon 14 in"):
        admit_run(ctx, _local({**PRIV, "max_epsilon": 8.0}), "run-c", "art_c0")  # 14 + 8 > 20
    assert ledger.read_bytes() == before  # a refused run is not written
    admit_run(ctx, _local({**PRIV, "max_epsilon": 6.0}), "run-d", "art_c0")  # 14 + 6 = 20: fits
    assert [(r.run_key, r.max_epsilon, r.delta) for r in read_ledger(ledger)] == [
        ("run-a", 8.0, 1e-5),
        ("run-b", 6.0, 1e-6),
        ("run-d", 6.0, 1e-5),
    ]
    admit_run(_context({}), _local(None), "run-e", "art_c0")  # no budget: nothing kept
    assert len(read_ledger(ledger)) == 3


def test_a_site_budget_refuses_what_it_cannot_keep_or_read(tmp_path, not_private):
    local = _local({**PRIV, "max_epsilon": 1.0})
    with pytest.raises(ValueError, match="needs the site's max-epsilon and state-dir"):
        admit_run(_site(None, 20.0), local, "run-a", "art_c0")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / LEDGER_FILE).write_text('{"run_key": "a", "client": "x", "max_epsilon": 1, "delta": 0.1}\n[]\n')
    with pytest.raises(ValueError, match=rf"bad/{LEDGER_FILE}: line 2 is not a run"):
        admit_run(_site(tmp_path / "bad", 20.0), local, "run-a", "art_c0")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / LEDGER_FILE).symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(ValueError, match="cannot open the site's privacy ledger"):
        admit_run(_site(tmp_path / "link", 20.0), local, "run-a", "art_c0")
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_loopback_a_site_out_of_budget_is_refused_by_name_and_trains_in_the_runs_it_admitted(
    data, tmp_path, not_private
):
    """art_c0: each run at most max_epsilon 8, 12 over all runs. The first run (ceiling 8) trains on it, and so does
    that run resumed; a second run (ceiling 7: 15 in all) goes on without it, refused at every QUERY by client id."""
    state = tmp_path / "state"

    def run(work, max_epsilon):
        grid = loopback(data, state_dir=state)
        grid.contexts[100].node_config.update({NODE_MAX_EPSILON: 8.0, NODE_MAX_STUDY_EPSILON: 12.0})
        spec = make_spec(
            data, tmp_path / work, "fedavg", rounds=1, min_clients=2, privacy={**PRIV, "max_epsilon": max_epsilon}
        )
        return serve(grid, spec.model_copy(update={"run_info": {"test": work}}))  # a run key of its own per `work`

    (first,) = run("a", 8.0).history
    assert not first.refused_clients and first.metric("clients") == 3
    (again,) = run("a", 8.0).history  # the same run key: admitted already
    assert not again.refused_clients
    (second,) = run("b", 7.0).history
    assert [r.client for r in second.refused_clients or []] == ["art_c0"]
    assert "admitted 1 runs of max_epsilon 8 in all" in second.refused_clients[0].reason
    assert "max_study_epsilon 12" in second.refused_clients[0].reason and second.metric("clients") == 2
    assert second.refused_clients == run("b", 7.0).history[0].refused_clients  # and refused again
    assert [r.max_epsilon for r in read_ledger(state / LEDGER_FILE)] == [8.0]
