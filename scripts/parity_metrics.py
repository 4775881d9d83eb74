"""Before/after parity of the round loop refactor: every registered algorithm at its params.yaml
defaults, 2 rounds x 1 local epoch on a tiny embedded dataset (4 images per class), 6 clients,
in-process engine on the CPU with one thread. Prints one JSON line per algorithm: the history
(floats as repr) and a sha256 of the final weights. Usage:
    OMP_NUM_THREADS=1 python scripts/parity_metrics.py OUT.jsonl [alg ...]
Environment PARITY_FRACTION=0.5 PARITY_ROUNDS=3 PARITY_CKPT=1 samples half the clients over 3 rounds
with round checkpoints (the per-client state files are then written and read back).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.data.partition import PartitionSettings, partition
from fedccrl_core.data.pools import build_pools
from fedccrl_core.data.registry import get_dataset
from fedccrl_core.data.synthetic import generate
from fedccrl_core.federation.driver import RunData, held_out_run, train
from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import read_yaml
from fedccrl_pipeline.training import run_settings

ROOT = Path(__file__).resolve().parents[1]


def main(out: str, algs: list[str], fraction: float = 1.0, rounds: int = 2, ckpt: bool = False) -> None:
    torch.set_num_threads(1)
    params = read_yaml(ROOT / "params.yaml")
    validate_params(params)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        generate(base / "raw", seed=params["dataset"]["seed"], images_per_class=6, progress=False)
        partition(
            base / "raw",
            base / "shards",
            get_dataset("synthetic"),
            PartitionSettings(
                32,
                clients_per_domain=params["partition"]["clients_per_domain"],
                val_fraction=params["partition"]["val_fraction"],
                seed=params["partition"]["seed"],
            ),
            progress=False,
        )
        build_pools(
            base / "shards", base / "pools", params["preprocess"]["mean"], params["preprocess"]["std"], progress=False
        )
        manifest = load_manifest(base / "shards")
        domains = list(manifest.domains)
        with open(out, "w") as f:
            for name in algs or sorted(ALGORITHMS):
                p = {**params, "train": {**params["train"], "rounds": rounds, "local_epochs": 1, "device": "cpu"}}
                if name == "ccst":  # untrained AdaIN weights: validated like any other reading of the group
                    p["train"]["ccst"] = {**(p["train"].get("ccst") or {}), "adain_weights": "random"}
                cfg = validate_params(p, (name,))
                s = run_settings(cfg)
                data = RunData.load(base / "shards", base / "pools", domains[3], "cpu", 256, domains[:3])
                alg = build_algorithm(name, s.local, getattr(cfg.train, name).model_dump())
                run = held_out_run(
                    alg,
                    data,
                    s.backbone,
                    len(manifest.classes),
                    s.pretrained,
                    0,
                    "cpu",
                    rounds,
                    client_fraction=fraction,
                    checkpoint_path=(base / "ck" / f"{name}.pt") if ckpt else None,
                )
                res = train(run, log=lambda m: None)
                h = hashlib.sha256()
                for k in sorted(res.final_weights):
                    h.update(k.encode() + res.final_weights[k].detach().cpu().contiguous().numpy().tobytes())
                hist = [
                    {
                        k: (repr(v) if isinstance(v, float) else v)
                        for k, v in sorted(r.to_dict().items())
                        if k != "seconds"
                    }
                    for r in res.history
                ]
                h2 = hashlib.sha256()  # without FedIIR's former grad_g.* buffers (g_bar moved to the server half)
                for k in sorted(k for k in res.final_weights if not k.startswith("grad_g.")):
                    h2.update(k.encode() + res.final_weights[k].detach().cpu().contiguous().numpy().tobytes())
                f.write(
                    json.dumps(
                        {
                            "algorithm": name,
                            "weights_sha256": h.hexdigest(),
                            "model_sha256": h2.hexdigest(),
                            "history": hist,
                        }
                    )
                    + "\n"
                )
                f.flush()
                print(name, hist[-1].get("val_acc"), hist[-1].get("target_acc"), flush=True)


if __name__ == "__main__":  # PARITY_FRACTION / PARITY_ROUNDS / PARITY_CKPT=1 vary the setting
    import os

    main(
        sys.argv[1],
        sys.argv[2:],
        float(os.environ.get("PARITY_FRACTION", 1.0)),
        int(os.environ.get("PARITY_ROUNDS", 2)),
        os.environ.get("PARITY_CKPT") == "1",
    )
