"""tests/test_deploy_project.py's stand-in SuperLink: in a `fedccrl` process started by that test's `dvc repro` (the
environment variable FEDCCRL_TEST_LOOPBACK_DATA names the sites' data), the loopback Grid of tests/flower_harness.py
serves `fedccrl federate` and `fedccrl evaluate-sites` as tests/test_deploy_stages.py and test_evaluate_sites.py
serve them in process. Any other process is left alone."""

import os
import sys
from pathlib import Path

_DATA = os.environ.get("FEDCCRL_TEST_LOOPBACK_DATA")
if _DATA and Path(sys.argv[0]).name == "fedccrl" and sys.argv[1:2] in (["federate"], ["evaluate-sites"]):
    import json

    import pytest
    from flower_harness import loopback
    from test_deploy_stages import on_loopback
    from test_evaluate_sites import on_sites

    from fedccrl_flower import messages as M

    _data = Path(_DATA)
    _patch = pytest.MonkeyPatch()
    if sys.argv[1] == "federate":
        on_loopback(_patch, lambda spec: loopback(_data, clients=[*spec.sources, *spec.evaluators]))
    else:
        clients = [c["id"] for c in json.loads((_data / "shards" / "manifest.json").read_text())["clients"]]
        shards, pools = str(_data / "shards"), str(_data / "pools")
        on_sites(
            _patch,
            {
                100 + i: {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: shards, M.NODE_POOLS: pools}
                for i, cid in enumerate(clients)
            },
        )
