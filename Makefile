# The README's two set-up commands are `make repro` and `make test`; both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# FedCCRL's Table 1 (CCST needs downloaded AdaIN weights, see docs/algorithms/baselines.md) and the other seed papers' methods
TABLE_ALGORITHMS := fedavg,fedprox,fedadg,ga,fedsr,fediir,fedccrl,fedbn,silobn,fedfd,fedfd_a,fedalign

.PHONY: lock repro lint typecheck test test-all chaos mutation mutation-summary bench bench-accuracy bench-table1 pacs-cpu figures-docs docs docs-serve clean-venv \
        tracking-server tracking-server-stop tracking-server-status

# constraints.txt pins every package to the exact version it was tested with (make lock writes it)
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -c constraints.txt -e '.[full,dev]'
	touch $(STAMP)

lock: $(STAMP)  ## regenerate constraints.txt from .venv: pip freeze, without fedccrl itself, + the serve extra's onnxruntime
	{ echo "# Exact versions of every package in .venv except fedccrl itself; make installs with -c constraints.txt."; \
	  echo "# Regenerate after changing dependencies: make lock. onnxruntime (the serve extra's CPU build) is pinned"; \
	  echo "# at the version of .venv's onnxruntime-gpu (the full install's build of the same release)."; \
	  { $(BIN)/pip freeze --exclude-editable | grep -v '^#' | grep -iv '^fedccrl=='; \
	    $(BIN)/pip freeze | sed -n 's/^onnxruntime-gpu==/onnxruntime==/p'; } | sort -f; } > constraints.txt
	touch $(STAMP)  # the venv is what the file now says

repro: $(STAMP)   ## the main job: dvc repro on the embedded default dataset
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc repro

lint: $(STAMP)    ## ruff's lint and format check over every Python file (pyproject.toml [tool.ruff]), then mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

typecheck: $(STAMP)  ## mypy alone, over the packages pyproject.toml [tool.mypy] names: 0 errors
	$(BIN)/mypy

test: lint    ## the fast tier (minutes): the checks above, then every test not marked `full`; it lists what it leaves to test-all
	PATH="$(CURDIR)/$(BIN):$$PATH" pytest

test-all: lint  ## the full tier (what CI runs): also the README blocks, DVC pipelines and queues, Flower, benches
	PATH="$(CURDIR)/$(BIN):$$PATH" pytest -m "" $(TEST_ALL_ARGS)

chaos: $(STAMP)  ## the fault suite: one row per fault (orphans, temp files left, data lost, metrics identical)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/chaos.py

# mutmut over the modules of the papers' equations (pyproject.toml [tool.mutmut], scope in scripts/mutation.py), one
# module at a time on one worker with the fast tests that call each mutated function; not in CI (too slow: see
# docs/contributing.md, "Mutation testing"). mutmut keeps its copy and its results in mutants/ (git-ignored).
mutation: $(STAMP)  ## mutation testing of Eq. 2, 6-17, Alg. 1-3, DP and the accountant; prints the per-module table
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/mutation.py run
	$(BIN)/python scripts/mutation.py summary

mutation-summary: $(STAMP)  ## the per-module table of the last `make mutation` (mutants/), and the unexplained survivors
	$(BIN)/python scripts/mutation.py summary --survivors

bench: $(STAMP)  ## fast engine path vs the plain baseline on generated data (CPU sizes; GPU: see README)
	PATH="$(CURDIR)/$(BIN):$$PATH" fedccrl-bench speed --size 32 --threads 1

bench-accuracy: $(STAMP)  ## the Table 1 form in one process: every weight-free algorithm, 3 seeds, every held-out domain
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc repro pools && PATH="$(CURDIR)/$(BIN):$$PATH" fedccrl-bench accuracy --algorithms $(TABLE_ALGORITHMS)

bench-table1: $(STAMP)  ## Table 1 form: every algorithm that runs without downloaded weights, 3 seeds
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc exp run -S 'train.algorithms=[$(TABLE_ALGORITHMS)]' -S 'train.seeds=[0,1,2]'
	cat results/table.md

# PACS on 2 CPU cores, no GPU, no downloaded weights (docs/experiments.md "PACS on a CPU"): the local 128 px zip
# resized to 64 px, the small CNN from scratch, 10 rounds x 2 local epochs, FedAvg and FedCCRL, seed 0, all four
# held-out domains. An interrupted run resumes from its round checkpoints: run the same command again.
PACS_ZIP ?= ../shared/datasets/pacs/pacs_128.zip
PACS_CPU := -S dataset.name=pacs -S dataset.source=$(abspath $(PACS_ZIP)) -S preprocess.image_size=64 \
            -S model.backbone=small_cnn -S model.pretrained=none -S train.rounds=10 -S train.local_epochs=2 \
            -S 'train.algorithms=[fedavg,fedccrl]' -S 'train.seeds=[0]' -S 'train.held_out=[0,1,2,3]'
pacs-cpu: $(STAMP)  ## PACS leave-one-domain-out on the CPU (about 1 h on 2 cores): FedCCRL against FedAvg
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc exp run $(PACS_CPU) $(PACS_CPU_EXTRA)
	cat results/table.md

figures-docs: $(STAMP)  ## regenerate docs/*.png: FedCCRL and FedAvg on the embedded default
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc exp run -S 'train.algorithms=[fedccrl,fedavg]'
	mkdir -p docs && cp plots/augmentation_preview.png plots/curves_sketch.png plots/tsne_sketch.png \
	  plots/gradcam_sketch.png plots/confusion_fedccrl_sketch.png docs/

# A team's MLflow tracking server on loopback (docs/team.md): PostgreSQL (Debian's postgresql package) and
# `mlflow server --serve-artifacts`, their files in $(TRACKING_DIR); `start` prints the MLFLOW_TRACKING_URI to export
TRACKING_DIR ?= .tracking
tracking-server: $(STAMP)  ## start PostgreSQL and the MLflow server on 127.0.0.1 (ports: FEDCCRL_PG_PORT, FEDCCRL_MLFLOW_PORT)
	@$(BIN)/python scripts/tracking_server.py start --dir $(TRACKING_DIR)

tracking-server-stop: $(STAMP)  ## stop both
	@$(BIN)/python scripts/tracking_server.py stop --dir $(TRACKING_DIR)

tracking-server-status: $(STAMP)  ## whether each runs (exit code 3 when one does not)
	@$(BIN)/python scripts/tracking_server.py status --dir $(TRACKING_DIR)

docs: $(STAMP)  ## the documentation site into site/ (strict: a broken link or anchor fails); hyperparameters page generated
	NO_MKDOCS_2_WARNING=1 PATH="$(CURDIR)/$(BIN):$$PATH" mkdocs build --strict -d site

docs-serve: $(STAMP)  ## the documentation site on http://127.0.0.1:8000, rebuilt as you edit
	NO_MKDOCS_2_WARNING=1 PATH="$(CURDIR)/$(BIN):$$PATH" mkdocs serve -a 127.0.0.1:8000

clean-venv:
	rm -rf $(VENV)
