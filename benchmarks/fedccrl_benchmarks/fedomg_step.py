"""FedOMG's server step (Eq. 15-17, fedccrl_core/algorithms/fedomg.py) per round beside the clients' local steps
of that round, at several client counts, measured in one run and printed as a ratio. A measurement, not a test.

Local steps: one client-round (train.local_epochs over the client's train split, the default schedule) of each
source client of the current shards, timed; a round of U clients is U such client-rounds, as the in-process engine
trains them one after another on the CPU. Server step: U replies with the model's state shapes (random updates),
folded into the aggregation one at a time and read once (stack, Gram matrix, the search, the combination), beside
FedAvg's streamed Eq. 2 on the same replies.

    python -m fedccrl_benchmarks.fedomg_step --clients 6,120            # after `fedccrl partition` (the embedded default)
    python -m fedccrl_benchmarks.fedomg_step --clients 6,120 --backbone mobilenet_v3_large
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def server_seconds(alg, global_w: dict, u: int, repeats: int) -> float:
    """Median wall time of one aggregation of u replies (the replies are made outside the clock)."""
    import torch

    from fedccrl_core.algorithms.base import Reply

    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(repeats):
        agg = alg.aggregation(global_w, float(u * 100))
        spent = 0.0
        for i in range(u):
            weights = {
                k: (v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype))
                if v.is_floating_point()
                else v.clone()
                for k, v in global_w.items()
            }
            t0 = time.perf_counter()
            agg.add(Reply(f"c{i}", weights, 100))
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        agg.result()
        times.append(spent + time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=Path, default=Path("data/shards"))
    ap.add_argument("--pools", type=Path, default=Path("data/pools"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--clients", default="6,120")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--backbone",
        default="",
        help="instead of params.yaml's (resolved) model.backbone, e.g. mobilenet_v3_large (random weights)",
    )
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.federation.driver import load_clients
    from fedccrl_core.learning.clients import ClientState
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.training import run_settings

    torch.set_num_threads(1)  # as every training run on the CPU (federation/jobs.py)
    cfg = load_config(args.params)
    s = run_settings(cfg)
    backbone, pretrained = (args.backbone, "none") if args.backbone else (s.backbone, s.pretrained)
    manifest = load_manifest(args.shards)
    clients = load_clients(args.shards, args.pools, list(manifest.domains), "cpu")
    fedomg = build_algorithm("fedomg", s.local, cfg.train.fedomg.model_dump())
    fedavg = build_algorithm("fedavg", s.local)
    torch.manual_seed(0)
    model = fedomg.build_model(backbone, len(manifest.classes), pretrained, fedomg.hp)
    global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    per_client = []
    for c in clients:  # one client-round each, from the same global weights (the shard read outside the clock)
        data = c.resident()
        t0 = time.perf_counter()
        fedavg.local_train(
            model, data, ClientState(), global_w, None, torch.Generator().manual_seed(0), np.random.default_rng(0)
        )
        per_client.append(time.perf_counter() - t0)
    client_round = statistics.fmean(per_client)
    params = sum(v.numel() for v in global_w.values() if v.is_floating_point())
    print(
        f"{backbone}, {params} floating-point values in the state; one client-round "
        f"({s.local.local_epochs} local epochs, ~{int(statistics.fmean(c.n_train for c in clients))} images): "
        f"{client_round:.3f} s (mean of {len(clients)} clients); server steps median of {args.repeats}"
    )
    print("| clients U | local steps per round (s) | FedOMG server step (s) | FedAvg Eq. 2 (s) | FedOMG / local |")
    print("|---|---|---|---|---|")
    for u in [int(x) for x in args.clients.split(",")]:
        local = u * client_round
        omg = server_seconds(fedomg, global_w, u, args.repeats)
        avg = server_seconds(fedavg, global_w, u, args.repeats)
        print(f"| {u} | {local:.2f} | {omg:.4f} | {avg:.4f} | {omg / local:.4f} |", flush=True)


if __name__ == "__main__":
    main()
