# Two commands: `make serve` (set up, then run the gateway on the embedded default)
# and `make test` (set up, then run every check). Everything installs into .venv.
# The interpreter: the distribution's CPython (/usr/bin/python3) when it is 3.11+ and can create a venv, else
# `python3` from PATH; `make PYTHON=...` picks another. Distributions build CPython with profile-guided
# optimization and LTO and link libpython statically; pyenv's default build does neither, and the gateway then
# spends ~20% more CPU per request (docs/decisions.md, "The interpreter").
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell /usr/bin/python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
endif
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: serve test lint bench clean

serve: $(VENV)/.core
	$(BIN)/lockgate serve $(ARGS)

test: $(VENV)/.dev
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest $(ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

bench: $(VENV)/.core
	$(BIN)/lockgate bench overhead $(ARGS)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[dev,llamacpp,semantic]'
	touch $(VENV)/.core $@

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
