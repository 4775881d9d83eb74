"""The privacy trade-off table of docs/privacy.md: epsilon in {inf, 8, 4, 1} x {fedccrl, fedavg}, on the default
data (the shards and pools of `dvc repro`), one held-out domain, params.yaml's training settings, in-process on
the CPU with one torch thread. For each finite epsilon the noise multipliers are set by bisection so that the
accountant (fedccrl_core/privacy/accountant.py) reaches epsilon after train.rounds rounds: FedAvg spends it on
the weights alone; FedCCRL splits it, z_w = 2 z_s (the same Gaussian on both channels, its weights channel seeing
a sensitivity 2 S). Prints one markdown row per cell: target accuracy of the last round, the audit's membership
TPR at FPR 1 % after the last round, epsilon spent.
Usage:  OMP_NUM_THREADS=1 python scripts/privacy_tradeoff.py [data dir (default data)] [held-out domain (sketch)]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from fedccrl_core import contract
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.audit import audit
from fedccrl_core.data.shards import load_domain_test, load_manifest
from fedccrl_core.federation.client import ClientData
from fedccrl_core.federation.engine import EvalSets, InProcessEngine
from fedccrl_core.federation.jobs import load_clients
from fedccrl_core.privacy import accountant as A
from fedccrl_core.privacy.settings import PrivacySettings
from pipeline.audit import load_audit_clients
from pipeline.params import load_config
from pipeline.train import run_settings

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = (float("inf"), 8.0, 4.0, 1.0)


def calibrate(target: float, algorithm: str, rounds: int, n_clients: int, sizes: dict) -> dict:
    """train.privacy for `algorithm` whose epsilon after `rounds` is `target` (bisection on z_s, z_w = 2 z_s)."""
    def settings(z):
        return PrivacySettings(enabled=True, statistics=algorithm == "fedccrl", stats_noise_multiplier=z,
                               weights_noise_multiplier=2 * z)

    def eps(z):
        s = settings(z)
        per_round = [A.weights_event(s, n_clients, n_clients)]
        if s.on_statistics:
            per_round.append(A.statistics_event(s, sizes))
        return A.epsilon_of(per_round * rounds, s.delta)

    lo, hi = 0.05, 200.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return settings(hi).model_dump()


def main(data: Path, held_out: str) -> None:
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "params.yaml")
    settings = run_settings(cfg)
    manifest = load_manifest(data / "shards")
    sources = [d for d in manifest["domains"] if d != held_out]
    rounds, r = cfg.train.rounds, cfg.train.fedccrl.r
    print("| algorithm | epsilon target | z_s | z_w | target acc | membership TPR @ FPR 1 % | epsilon spent |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("fedccrl", "fedavg"):
        clients = load_clients(data / "shards", data / "pools", sources, "cpu")
        sizes = {c.client_id: (c.n_train, int(np.ceil(r * c.n_train))) for c in clients}
        for target in EPSILONS:
            privacy = None if target == float("inf") else calibrate(target, name, rounds, len(clients), sizes)
            local = settings.local.model_copy(update={"privacy": privacy})
            tx, ty = load_domain_test(data / "shards", held_out)
            ev = EvalSets(torch.cat([c.val_x for c in clients]), torch.cat([c.val_y for c in clients]),
                          ClientData.from_numpy("t", held_out, tx, ty, tx[:0], ty[:0], "cpu").train_x,
                          torch.from_numpy(np.asarray(ty, dtype=np.int64)), 256)
            alg = build_algorithm(name, local, getattr(cfg.train, name).model_dump())
            backbone, pretrained = settings.backbone, settings.pretrained
            torch.manual_seed(0)
            model = alg.build_model(backbone, len(manifest["classes"]), pretrained, alg.hp)
            res = InProcessEngine(alg, model, clients, ev, rounds=rounds, seed=0, log=lambda m: None,
                                  client_fraction=cfg.train.client_fraction).run()
            last = res.history[-1]
            ps = PrivacySettings.from_mapping(privacy)
            tpr = "-"  # FedAvg releases no statistics
            if name == "fedccrl":
                rows = audit([c for c in load_audit_clients(data / "shards", data / "pools")
                              if c.domain in sources], r, rounds, 0, ps)["rounds"][-1]
                tpr = f"{rows['tpr_at_fpr_0.01']:.3f}"
            spent = last.get(contract.DP_EPSILON, float("inf"))
            print(f"| {name} | {target:g} | {ps.stats_noise_multiplier if privacy and ps.on_statistics else 0:.2f} | "
                  f"{ps.weights_noise_multiplier if privacy else 0:.2f} | {last[contract.TARGET_ACC]:.3f} | {tpr} | "
                  f"{spent:.2f} |", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "data", sys.argv[2] if len(sys.argv) > 2 else "sketch")
