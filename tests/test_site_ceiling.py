"""A site's own ceiling on a run's privacy (site.toml max_epsilon / max_delta, fedccrl_flower/site_ceiling.py): the
site, not the server, decides that its images are released only under train.privacy and how much one run may spend."""

from __future__ import annotations

import pytest
from flower_harness import SOURCES, loopback, make_spec, serve

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower import messages as M
from fedccrl_flower.node_config import NODE_MAX_DELTA, NODE_MAX_EPSILON
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
