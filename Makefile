# The README's commands. Each creates .venv if missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
BENCH_STAMP := $(VENV)/.installed-bench
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Python caches compiled bytecode next to the modules it imports (.venv, src, tests), even
# where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on these machines): the
# suite starts many Python processes (training runs, Ray workers and daemons), and without
# the cache each one compiles what it imports of jax, torch or ray from source again: a tiny
# `loomax train` takes 6.2 CPU-seconds instead of 3.8. Clean clones, back to back: make test
# 345 s -> 284 s.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast lint format bench bench-cpu bench-gpu gpu-wheels bench-levanter bench-checkpoint docs install clean

# Installs go through uv (from PyPI into the venv): it fetches and unpacks wheels in
# parallel: well under a minute for what pip takes about three. uv reads no pip.conf, so it is
# handed pip's local wheel folders (PIP_FIND_LINKS, comma-separated for uv), where a
# machine may keep e.g. a CPU torch build. If uv cannot be installed or fails, pip installs.
ifneq ($(strip $(PIP_FIND_LINKS)),)
empty :=
comma := ,
export UV_FIND_LINKS ?= $(subst $(empty) $(empty),$(comma),$(strip $(PIP_FIND_LINKS)))
endif
UV_INSTALL = $(BIN)/uv pip install -q --python $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv || true

# The demo installs what it runs: the package and its dependencies, no extra (about 1.2 GB;
# README.md). The test extra adds torch, transformers, libtpu, JAX's CUDA plugin and tools,
# lm-eval and the rest the suite checks against (about 3.6 GB in all): `make test` installs it.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(UV_INSTALL) -e . || $(BIN)/python -m pip install -q -e .
	$(BIN)/python -c "import loomax, jax, haliax, equinox, optax, draccus"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(BIN)/python
	$(UV_INSTALL) -e ".[test,docs]" || $(BIN)/python -m pip install -q -e ".[test,docs]"
	$(BIN)/python -c "import loomax, jax, haliax, equinox, optax, draccus"
	touch $(STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/loomax tokenizer train --config_path config/quickstart.yaml --out cache/tokenizers/quickstart
	$(BIN)/loomax train --config_path config/quickstart.yaml --data.tokenizer cache/tokenizers/quickstart/tokenizer.json

# Both cores (pytest-xdist): whole files to each worker, in the order conftest sorts them
# (the machine-wide Ray files as one unit). A third worker was measured slower: back to
# back, the suite took 844 s and 1,375 CPU-s on 3 workers, 723 s and 1,112 CPU-s on 2
# (each worker compiles, collects and builds its session fixtures on its own).
# `make test` (and so CI) runs every test: no marker, -k or --deselect leaves one out
# (tests/test_ci.py checks this recipe).
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(PYTEST)

# The inner loop: leaves out the tests marked `slow` (processes, Ray clusters, pod compiles).
# CI never runs this; `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(PYTEST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

bench: $(STAMP)
	$(BIN)/loomax bench --config_path config/bench/gpt2_tiny.yaml

# CPU speed (bench/README.md, issue 39): the XLA flag sets side by side, then Loomax against
# the torch.compile peer (../shared/peers/torch_gpt2_bench.py; torch from .venv), alternating
bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu_flags.py
	$(BIN)/python bench/torch_compare.py

# The GPU checks and benchmarks (bench/gpu.sh) on an offline CUDA host: `make gpu-wheels` here
# (where the package index is) writes .whl/, the packages Loomax needs beyond a JAX GPU image;
# copy the checkout with .whl/ to the host and run `bench/gpu.sh` there (no venv needed).
gpu-wheels:
	bench/gpu_wheels.sh .whl

bench-gpu:
	bench/gpu.sh

bench-levanter: $(STAMP)
	$(PYTHON) bench/compare_levanter.py

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(UV_INSTALL) -e ".[bench]" || $(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -c "import orbax.checkpoint"
	touch $(BENCH_STAMP)

bench-checkpoint: $(BENCH_STAMP)
	$(BIN)/python bench/checkpoint.py

docs: $(STAMP)
	$(BIN)/python -m loomax.config_reference docs/reference/config.md
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .cache site
