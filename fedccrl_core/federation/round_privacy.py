"""train.privacy's accounting, as hooks around a round of the loop (federation/loop.py), not branches inside it: `Paper`
is the paper's protocol (no DP: the run seed's client sample, the algorithm's aggregation, Eq. 2); `Private` charges
each release to the run's ledger when it happens (privacy/accountant.py RunPrivacy: the statistics of Eq. 8 and
DP-FedAvg's weights), samples the clients from the OS, aggregates with DP-FedAvg (privacy/dp.py), records epsilon in
every round record and, when a run stops after a release that no round record covers, the epsilon spent
(SpentRecord). `accounting_of` picks one, refusing before any work a setting under which something would leave a
client neither noised nor counted.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedccrl_core.algorithms.base import Aggregation, Algorithm, ListAggregation
from fedccrl_core.algorithms.fedccrl import StatisticsExchange
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.federation.sampling import sample_clients, sampled_count
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.runkey import params_hash
from fedccrl_core.privacy.charged import ChargedRelease
from fedccrl_core.privacy.dp import DPFedAvgAggregation
from fedccrl_core.privacy.noise import private_rng


def uncovered_release(alg: Algorithm) -> str:
    """What `alg` releases that train.privacy's mechanisms (privacy/dp.py) do not cover, read from which hooks it
    overrides ("" when none): an upload other than FedCCRL's statistics rows, an aggregation other than Eq. 2."""
    if type(alg).client_upload is not Algorithm.client_upload and not getattr(alg.Params, "uploads_statistics", False):
        return "uploads something other than FedCCRL's statistics rows (only those are clipped and noised)"
    if type(alg).aggregate is not Algorithm.aggregate or type(alg).after_aggregate is not Algorithm.after_aggregate:
        return "aggregates with a rule of its own, not Eq. 2 (DP-FedAvg replaces Eq. 2 only)"
    return ""


def privacy_of(alg: Algorithm):
    """train.privacy of this run (LocalConfig.privacy): a RunPrivacy, or None when off. Refuses, before any
    work, a setting under which something leaves the client that is neither noised nor counted: an upload the
    mechanisms of privacy/dp.py do not cover, a channel the algorithm releases with its mechanism switched off,
    an aggregation other than Eq. 2."""
    s = alg.local.privacy
    if s is None or not s.enabled:
        return None
    uploads = getattr(alg.Params, "uploads_statistics", False)
    if alg.Params.dp_refusal:  # params.yaml's validation refuses it first (pipeline cross_checks)
        raise ValueError(f"train.privacy.enabled: {alg.name}: {alg.Params.dp_refusal}")
    if uncovered_release(alg):
        raise ValueError(
            f"train.privacy.enabled: {alg.name} {uncovered_release(alg)}, and its Params declare no dp_refusal "
            "(fedccrl_core/foundation/hparams.py): declare why, so that params.yaml's validation refuses it"
        )
    for key, why in s.unprotected(alg.name, uploads):
        raise ValueError(f"{key}: {why}")
    from fedccrl_core.privacy.accountant import RunPrivacy  # dp_accounting, imported only when on

    return RunPrivacy(s, uploads)


def released_rows(uploads: dict) -> dict[str, int]:
    """{client: k_i}: the rows each statistics upload in `uploads` released."""
    rows = {cid: StatisticsExchange.upload_rows(u) for cid, u in uploads.items()}
    return {cid: k for cid, k in rows.items() if k is not None}


def released_sizes(uploads: dict, n_of: dict) -> dict[str, tuple[int, int]]:
    """{client: (n_i, k_i)}: the rows each statistics upload released out of the client's n_i (`n_of`: announced)."""
    return {cid: (int(n_of[cid]), k) for cid, k in released_rows(uploads).items()}


def upload_sizes(uploads: dict, transport) -> dict[str, tuple[int, int]]:
    """released_sizes with the n_i the transport announced."""
    rows = released_rows(uploads)
    return released_sizes(uploads, transport.announced_n(sorted(rows)) if rows else {})


class ReleasedThenRefused(RuntimeError):
    """A transport refuses a round after uploads already left the clients (Flower: one client id answering from two
    SuperNodes, each upload noised on its own). `released`: the statistics releases that happened, each
    {client: (n_i, k_i)} as upload_sizes gives them; the round loop charges every one (train.privacy) and stops."""

    def __init__(self, message: str, released: list[dict[str, tuple[int, int]]]):
        super().__init__(message)
        self.released = released


class Paper:
    """No train.privacy: the paper's protocol. Every hook of `Private`, doing what the paper does (or nothing)."""

    def __init__(self, alg: Algorithm, transport, seed: int, client_fraction: float, log: Callable[[str], None]):
        self.alg, self.transport, self.seed, self.client_fraction, self.log = alg, transport, seed, client_fraction, log

    def resume(self, ck: RoundCheckpoint | None, checkpoints: RoundCheckpoints | None, run_info: dict) -> None:
        """The run resumes after the round of `ck` (None: a fresh run)."""

    def before_round(self, rnd: int) -> ChargedRelease | None:
        """Round `rnd` is about to start (before its first release): what the pre-round check charged for the round's
        statistics release, which no client's may exceed (privacy/charged.py), or None when it charged nothing."""
        return None

    def sample(self, rnd: int, uploads: dict[str, Any]) -> list[str]:
        """The clients sampled out of those that uploaded (the run seed's draw)."""
        return sample_clients(list(uploads), self.client_fraction, self.seed, rnd)

    def uploads_released(self, rnd: int, uploads: dict[str, Any], sampled: list[str]) -> None:
        """The round's uploads left the clients; `sampled` will train."""

    def refused(self, rnd: int, released: list[dict[str, tuple[int, int]]]) -> None:
        """The transport refused the round after these statistics releases (ReleasedThenRefused)."""

    def aggregation(
        self, rnd: int, global_w: dict, sampled: list[str]
    ) -> Aggregation | ListAggregation | DPFedAvgAggregation:
        """Line 23's aggregation of the sampled clients' replies (Eq. 2 by default), streamed."""
        return self.alg.aggregation(global_w, float(sum(self.transport.announced_n(sampled).values())))

    def weights_released(self, rnd: int, uploads: dict[str, Any], sampled: list[str]) -> None:
        """The round's aggregate of the weights was released."""

    def record(self) -> dict[str, Any]:
        """The fields the round record gets (epsilon spent so far; the releases a run without a study reports)."""
        return {}

    def state(self) -> dict[str, Any]:
        """What the round checkpoint keeps to resume the accounting (RoundState's fields)."""
        return {}

    def spent(self, rnd: int, history: list[RoundRecord]) -> SpentRecord | None:
        """The run stops in round `rnd`: the record of what that round released, where no round record covers it."""
        return None

    def finish(self, checkpoints: RoundCheckpoints | None) -> dict[str, Any]:
        """The run ended: RunResult.extra's fields."""
        return {}


class Private(Paper):
    """train.privacy on (module docstring)."""

    def __init__(self, alg: Algorithm, transport, seed: int, client_fraction: float, log: Callable[[str], None], run):
        super().__init__(alg, transport, seed, client_fraction, log)
        self.run = run  # privacy/accountant.py RunPrivacy
        self.log(f"train.privacy: noise from {run.s.noise_source()}")
        # a run that found no study pointer reports its releases in its records (for the operator to count): from
        # index `reported` of its ledger on, none yet in this process (its first record carries them all)
        self.reports_releases, self.reported = False, 0

    def resume(self, ck: RoundCheckpoint | None, checkpoints: RoundCheckpoints | None, run_info: dict) -> None:
        """The ledger goes on from the checkpoint's releases, or from the ledger file's when it holds more (a round
        interrupted after a release): those are charged, and the round, run again, is charged again."""
        from fedccrl_core.privacy.ledger_file import resume  # dp_accounting, imported only when on

        path = checkpoints.ledger if checkpoints is not None else None
        ahead = resume(self.run, ck.privacy if ck is not None else None, path, run_info)
        if ahead:
            self.log(
                f"train.privacy: the ledger {path} holds {ahead} release(s) that no round checkpoint covers (a round "
                f"interrupted after them): charged; epsilon spent {self.run.ledger.epsilon():.3f}"
            )
        if checkpoints is not None:
            self.join_study(checkpoints, run_info)

    def join_study(self, checkpoints: RoundCheckpoints, run_info: dict) -> None:
        """With a study pointer beside the checkpoint (the pipeline's runs, privacy/study_ledger.py): each release
        from now on is appended to the study's ledger too (keyed by this ledger's id and its index), and the client
        states that an earlier attempt of this run left under another key (a code change, a crash) are removed: its
        releases stay in the study. Without one, the run's records carry its releases (record()): one writer a run."""
        from fedccrl_core.privacy import study_ledger as sl

        pointer = sl.read_pointer(checkpoints.path)
        if pointer is None:  # a run outside the pipeline, or a ServerApp that does not share the operator's disk
            self.reports_releases = True
            self.log(
                f"train.privacy: no study pointer beside {checkpoints.path}: this run appends to no study ledger; its "
                f"round records carry its releases ({contract.DP_RELEASES}), from which `fedccrl federate` counts them "
                "in the operator's study (docs/privacy.md, 'One ledger per study')"
            )
            return
        key = str(run_info.get("run_key") or params_hash(run_info))
        self.run.on_release = sl.recorder(pointer, key, lambda: sl.release_key(self.run.ledger_id, self.released() - 1))
        self.log(f"train.privacy: study {pointer.study}: every release appended to {pointer.ledger}")
        for ck_path in sl.earlier_attempts(checkpoints.path):
            orphan = RoundCheckpoints(ck_path, checkpoints.device, self.log)
            try:
                if not orphan.has_client_states():
                    continue
                orphan.drop_client_states()
            except Exception as e:  # an unreadable checkpoint of another run does not stop this one: said, not hidden
                self.log(
                    f"train.privacy: WARNING: {ck_path} (an earlier attempt of {pointer.run}) cannot be read "
                    f"({type(e).__name__}: {e}); its client states may remain in {orphan.client_dir}: remove it"
                )
                continue
            self.log(
                f"train.privacy: removed the client states of {ck_path} (an earlier attempt of {pointer.run} "
                f"under another run key); its releases stay in study {pointer.study}"
            )

    def before_round(self, rnd: int) -> ChargedRelease | None:
        """Both of the round's events checked against the budget, before its first release. Under max_epsilon, the
        statistics release it charged: the (n_i, k_i) of the largest ratio planned (accountant.py worst_client); None
        without max_epsilon, without statistics uploads, or with no size known (charged unsampled: any release fits)."""
        sizes, clients, sampled = self.planned_round()
        self.run.before_round(rnd, sizes, clients, sampled)
        if not self.run.s.max_epsilon or not sizes:
            return None
        from fedccrl_core.privacy.accountant import worst_client  # dp_accounting, imported only when on

        return ChargedRelease(*worst_client(sizes))

    def planned_round(self) -> tuple[dict[str, tuple[int, int]], int, int]:
        """RunPrivacy.before_round's (sizes, N, m) for the coming round, its worst case over who may answer
        (Transport.known_n, least_clients). sizes: {client: (n_i, k_i)} of the statistics uploads from the sizes the
        clients announced; a client whose size is not known yet (it joins late) as (1, 1), every row released (the
        largest sampling ratio: Gaussian(z_s) unsampled); {} when the algorithm uploads no statistics. (N, m): the
        number of answering clients between least_clients and all of them whose sample m = sampled_count(N) has
        the largest ratio m / N (a sampled Gaussian's RDP grows with it)."""
        known = self.transport.known_n()
        sizes: dict[str, tuple[int, int]] = {}
        if self.run.uploads:
            assert isinstance(self.alg, StatisticsExchange)  # the algorithms whose uploads are statistics
            sizes = {cid: (1, 1) if n is None else (n, self.alg.released_rows(n)) for cid, n in known.items()}
        if not known:
            return sizes, 0, 0
        least = max(1, min(self.transport.least_clients(), len(known)))
        pairs = [(c, sampled_count(c, self.client_fraction)) for c in range(least, len(known) + 1)]
        clients, sampled = max(pairs, key=lambda cm: (cm[1] / cm[0], cm[0]))
        return sizes, clients, sampled

    def sample(self, rnd: int, uploads: dict[str, Any]) -> list[str]:
        """The clients sampled from the OS's entropy (privacy/noise.py): the sample stays secret."""
        rng = private_rng(self.run.s, "sample", rnd)
        return sample_clients(list(uploads), self.client_fraction, self.seed, rnd, rng)

    def uploads_released(self, rnd: int, uploads: dict[str, Any], sampled: list[str]) -> None:
        self.run.statistics(rnd, upload_sizes(uploads, self.transport))
        self.run.before_weights(rnd, len(uploads), len(sampled))

    def refused(self, rnd: int, released: list[dict[str, tuple[int, int]]]) -> None:
        for sizes in released:  # each release its own event
            self.run.statistics(rnd, sizes)

    def aggregation(self, rnd: int, global_w: dict, sampled: list[str]) -> DPFedAvgAggregation:
        """DP-FedAvg (privacy/dp.py) in place of Eq. 2, its noise from the OS."""
        return DPFedAvgAggregation(global_w, len(sampled), self.run.s, private_rng(self.run.s, "weights", rnd))

    def weights_released(self, rnd: int, uploads: dict[str, Any], sampled: list[str]) -> None:
        self.run.weights(rnd, len(uploads), len(sampled))

    def released(self) -> int:
        """How many releases the run's ledger holds."""
        return len(self.run.state())

    def record(self) -> dict[str, Any]:
        """epsilon so far and, when this run reports its releases (join_study), those since its previous record."""
        out: dict[str, Any] = dict(self.run.record())
        if self.reports_releases and self.released() > self.reported:
            new = self.run.state()[self.reported :]
            out[contract.DP_RELEASES] = {"ledger": self.run.ledger_id, "start": self.reported, "releases": new}
            self.reported += len(new)
        return out

    def state(self) -> dict[str, Any]:
        return {"privacy": self.run.state()}

    def spent(self, rnd: int, history: list[RoundRecord]) -> SpentRecord | None:
        """A record of the epsilon spent alone ({round, dp_epsilon..., dp_stopped: 1}) when round `rnd` released
        something that no round record covers: logged as that round's, the last dp_epsilon logged is what was spent.
        It is not a round of the history (no model, no accuracy)."""
        if not self.run.released_in(rnd) or (history and history[-1].round == rnd):
            return None
        return SpentRecord.model_validate({contract.ROUND: rnd, **self.record(), contract.DP_STOPPED: 1.0})

    def finish(self, checkpoints: RoundCheckpoints | None) -> dict[str, Any]:
        """Nothing unreleased stays where the operator keeps the run's files (the clients' states); what the ledger
        charged, for the sweep's per-image epsilon."""
        from fedccrl_core.privacy.sweep_epsilon import ledger_releases  # dp_accounting: only when on

        if checkpoints is not None:
            checkpoints.drop_client_states()
        return {contract.PRIVACY_RELEASES: ledger_releases(self.run.state())}


def accounting_of(alg: Algorithm, transport, seed: int, client_fraction: float, log: Callable[[str], None]) -> Paper:
    """The run's accounting: Private under train.privacy (privacy_of refuses what it cannot cover), Paper else."""
    run = privacy_of(alg)
    if run is None:
        return Paper(alg, transport, seed, client_fraction, log)
    return Private(alg, transport, seed, client_fraction, log, run)
