# Every target sets up what it needs, from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The editable install is a tree of links to the role folders (setuptools' strict mode, needed
# because operator/ is a namespace folder). Adding or removing a module re-links it.
SOURCES := $(sort $(wildcard pagefleet/*.py engine/*.py engine/*/*.py router/*.py router/*/*.py \
             operator/*.py operator/*/*.py proto/*.py))
SOURCE_LIST := build/.sources

.PHONY: up demo test lint bench clean helm mutate FORCE

$(SOURCE_LIST): FORCE
	@mkdir -p build
	@echo '$(SOURCES)' | cmp -s - $@ || echo '$(SOURCES)' > $@

$(STAMP): pyproject.toml $(SOURCE_LIST)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

venv: $(STAMP)

## The main job on the embedded default: a local fleet (router + colocated, prefill and decode
## engines) of the tiny demo model on 127.0.0.1; Ctrl-C stops every process.
up: $(STAMP)
	$(BIN)/pagefleet up

## One engine alone: serve the tiny local demo checkpoint on 127.0.0.1.
demo: $(STAMP)
	$(BIN)/pagefleet demo

## The real helm binary for the chart tests (idempotent; no network once installed).
helm: $(STAMP)
	$(BIN)/python scripts/install_helm.py

## The whole test suite (lint included).
test: $(STAMP) helm
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Mutation testing of the cores with mutmut, one module at a time on its fast tests
## (scripts/mutate.py; scores in docs/testing.md). Not part of `make test`: it takes a while.
## MODULES=engine/sampler.py limits it to some modules.
MUTATE_STAMP := $(VENV)/.mutate-installed
$(MUTATE_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,mutate]' --config-settings editable_mode=strict
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python scripts/mutate.py $(MODULES)

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_step.py
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/serve_vs_offline.py

clean:
	rm -rf $(VENV) build dist *.egg-info
