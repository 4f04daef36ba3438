# qspec: `make demo` sets up and summarizes a bundled document; `make test` sets up and tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qspec-installed

.PHONY: setup test lint demo bench-ar clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	# torch is pinned to the CPU wheel in pyproject.toml; see docs/DESIGN.md
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,ray]'  # (ray: the --ray tests)
	touch $@

lint: setup
	$(VENV)/bin/ruff check qspec_core qspec_cli kernels tests benchmarks
	$(VENV)/bin/ruff format --check qspec_core qspec_cli kernels tests benchmarks
	$(VENV)/bin/lint-imports  # the layer contracts in pyproject.toml

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q

demo: setup
	$(VENV)/bin/qspec summarize qspec_core/data/apache-2.0.txt

bench-ar: setup
	$(PY) benchmarks/ar_vs_transformers.py --json docs/bench-ar.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
