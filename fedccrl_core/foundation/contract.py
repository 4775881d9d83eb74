"""The names several layers spell, each defined once (floor 0: imports nothing of the project).

- the run layout written by the train stage and read by evaluate, export, report and figures;
- the fields of a round record (RoundLoop's history: history.json, history.csv, MLflow metrics);
- the loss-term names an algorithm's train step reports (history keys "l_*");
- the fields of an evaluated run (results/runs/... .json, read by report and figures);
- the record keys of the messages between the Flower ServerApp and its ClientApps.
"""

from __future__ import annotations

from pathlib import Path

# ---- run layout: <root>/<algorithm>/s<seed>/d<held-out entry> -----------------------------------------
MODEL_FILE = "model.pt"  # the global model after the last round
BEST_FILE = "best.pt"  # the global model of the round with the best source-validation accuracy
HISTORY_FILE = "history.json"  # {"meta", "best_round", "rounds": [round record, ...]} (+ HISTORY_PRIVACY under DP)
HISTORY_CSV = "history.csv"  # the same rounds, HISTORY_CSV_FIELDS plus the loss terms
RESULT_SUFFIX = ".json"  # results/runs/<algorithm>/s<seed>/d<entry>.json (evaluate stage)


def seed_dir_name(seed) -> str:
    return f"s{seed}"


def domain_dir_name(entry) -> str:
    """A held-out entry of train.held_out (a domain name or an index) as its folder name."""
    return f"d{entry}"


def seed_dir(root, algorithm: str, seed) -> Path:
    """<root>/<algorithm>/s<seed>: the train stage's output of one (algorithm, seed) process."""
    return Path(root) / algorithm / seed_dir_name(seed)


def run_dir(root, algorithm: str, seed, entry) -> Path:
    """<root>/<algorithm>/s<seed>/d<entry>: one trained run (MODEL_FILE, BEST_FILE, HISTORY_FILE, HISTORY_CSV)."""
    return seed_dir(root, algorithm, seed) / domain_dir_name(entry)


def result_file(results_root, models_root, run: Path) -> Path:
    """The evaluate stage's result of the run folder `run` under models_root: the same relative path + .json."""
    rel = Path(run).relative_to(models_root)
    return Path(results_root) / rel.parent / f"{rel.name}{RESULT_SUFFIX}"


def run_of_result(models_root, results_root, result: Path) -> Path:
    """The run folder whose evaluation is `result` (the inverse of result_file)."""
    return Path(models_root) / Path(result).relative_to(results_root).with_suffix("")


def checkpoint_dir_name(algorithm: str, seed, entry) -> str:
    """The folder of a run's round checkpoints (under the train stage's checkpoint root)."""
    return f"{algorithm}-{seed_dir_name(seed)}-{domain_dir_name(entry)}"


# ---- round record (one per round of RoundLoop's history) ---------------------------------------------
ROUND = "round"
VAL_ACC = "val_acc"  # source validation (union of the clients' val splits)
TARGET_ACC = "target_acc"  # the held-out domain
VAL_PRED_CLASSES = "val_pred_classes"  # distinct classes predicted on validation (1 = collapsed)
SECONDS = "seconds"
BYTES_UP = "bytes_up"
BYTES_DOWN = "bytes_down"
LOSS = "loss"  # the local objective, weighted mean over the clients (Eq. 2's n_i)
TRAIN_ACC = "train_acc"
# a federated evaluation's (fedccrl_flower/evalsets.py; the in-process engine's records do not have them): the val
# and held-out images the sites' counts cover, and how many sites answered
VAL_N, TARGET_N, EVAL_SITES = "val_n", "target_n", "eval_sites"
EVAL_MISSING = "eval_missing"  # the sites of the run that did not evaluate this round (a partial evaluation)
LR = "lr"
DP_EPSILON = "dp_epsilon"  # train.privacy: epsilon at its delta so far, both channels composed
DP_EPSILON_STATISTICS = "dp_epsilon/statistics"  # the statistics channel alone
DP_EPSILON_WEIGHTS = "dp_epsilon/weights"  # the weights channel alone
DP_SEEDED_NOISE = "dp_seeded_noise"  # 1 when train.privacy.noise_seed seeds the noise: NOT private
DP_STOPPED = "dp_stopped"  # 1 on the record of a round stopped after a release: its epsilon fields alone
DP_EPSILON_KEYS = (DP_EPSILON, DP_EPSILON_STATISTICS, DP_EPSILON_WEIGHTS)  # what a seeded run does not report
DP_RELEASES = "dp_releases"  # a record of a run that found no study pointer: its releases, for the operator's study
HISTORY_PRIVACY = "dp"  # history.json of a DP run: noise, mark, trained_domains, releases (federation/jobs.py)
DP_EPSILON_SWEEP = "dp_epsilon_sweep_per_image"  # a sweep's MLflow parent: the worst domain's; /<domain> each one's
DP_SWEEP_RUNS = "dp_sweep_runs"  # a sweep's MLflow parent: how many finished runs DP_EPSILON_SWEEP composes
PRIVACY_RELEASES = "privacy_releases"  # RunResult.extra: the ledger's releases (privacy/sweep_epsilon.py Release)
HISTORY_CSV_FIELDS = (ROUND, TARGET_ACC, VAL_ACC, LOSS, TRAIN_ACC, LR, SECONDS, BYTES_UP, BYTES_DOWN)


def client_train_acc(client_id: str) -> str:
    """The record field of one client's training accuracy."""
    return f"{TRAIN_ACC}/{client_id}"


def reply_summary(metrics: dict) -> str:
    """A client's reply metrics in the one-line form every engine logs."""
    if TRAIN_ACC not in metrics:  # train.privacy on: the client sends no metrics
        return "metrics withheld (train.privacy)"
    return f"loss {metrics.get(LOSS, float('nan')):.4f} acc {metrics[TRAIN_ACC]:.3f}"


# ---- loss terms (an algorithm's train step reports these; names follow the papers' L_*) ----------------
LOSS_TERM_PREFIX = "l_"
L_CLS = "l_cls"  # classification (cross-entropy; FedCCRL Eq. 16 over three views)
L_CE = "l_ce"  # FedFD's L_CE (Eq. 5)
L_RA = "l_ra"  # FedCCRL Eq. 12
L_JS = "l_js"  # FedCCRL Eq. 14, FedAlign Eq. 15
L_PROX = "l_prox"  # FedProx's proximal term
L_ADVF, L_ADVD, L_ADVG = "l_advf", "l_advd", "l_advg"  # FedADG
L_L2R, L_CMI = "l_l2r", "l_cmi"  # FedSR
L_IIR = "l_iir"  # FedIIR
L_CACL, L_CAFL = "l_cacl", "l_cafl"  # FedFD Eq. 5
L_ADAPTER = "l_adapter"  # FedFD-A
L_SC, L_RC, L_ADV = "l_sc", "l_rc", "l_adv"  # FedAlign Eq. 12, 13, 16


def is_loss_term(field: str) -> bool:
    return field.startswith(LOSS_TERM_PREFIX)


# ---- an evaluated run (evaluate stage -> report, figures) -----------------------------------------------
FINAL_TARGET_ACC = "final_target_acc"
BEST_VAL_TARGET_ACC = "best_val_target_acc"
BEST_ROUND = "best_round"

# ---- Flower message record keys (fedccrl_flower/messages.py documents the messages) ------------------
MSG_CONFIG = "fedccrl.config"
MSG_INFO = "fedccrl.info"
MSG_UPLOAD = "fedccrl.upload"
MSG_PAYLOAD = "fedccrl.payload"
MSG_WEIGHTS = "fedccrl.weights"
MSG_METRICS = "fedccrl.metrics"
MSG_EVAL = "fedccrl.eval"

# ---- a Flower run's report folder <work_dir>/run-<run id>/ (written by the ServerApp, read by the launcher) --
FLOWER_ROUNDS_FILE = "rounds.jsonl"  # one round record per line, as each round finishes
FLOWER_STATUS_FILE = "status.json"  # running | completed | failed | stopped
FLOWER_RESULT_FILE = "result.pt"  # the RunResult's fields
FLOWER_LOG_FILE = "server.log"


def flower_report_dir(work_dir, run_id: int) -> Path:
    return Path(work_dir) / f"run-{run_id}"
