# qspec: `make demo` sets up and summarizes a bundled document; `make test` sets up and tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qspec-installed
# qspec alone: what `make demo` needs (the test tools and Ray come with `setup`)
RUN_STAMP := $(VENV)/.qspec-run-installed

.PHONY: setup test lint demo bench-ar clean sanitize

setup: $(STAMP)

$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	# torch is pinned to the CPU wheel in pyproject.toml; see docs/DESIGN.md
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $@

# the test tools and Ray on top (ray: the --ray tests)
$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,ray]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check qspec_core qspec_cli kernels tests benchmarks
	$(VENV)/bin/ruff format --check qspec_core qspec_cli kernels tests benchmarks
	$(VENV)/bin/lint-imports  # the layer contracts in pyproject.toml

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q

demo: $(RUN_STAMP)  # (not the test tools: a first summary sooner)
	$(VENV)/bin/qspec summarize qspec_core/data/apache-2.0.txt

bench-ar: setup
	$(PY) benchmarks/ar_vs_transformers.py --json docs/bench-ar.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The C++ kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (any finding stops
# the run), then the kernel, batch-invariance and reproducibility tests against that build.
SANITIZED_TESTS ?= tests/test_cpu_attention.py tests/test_cpu_linear.py tests/test_cpu_decode.py \
	tests/test_cpu_step.py tests/test_batch_invariance.py tests/test_reproducible.py \
	tests/test_prefill_attention.py
SANITIZE_ENV = QSPEC_CPU_SANITIZE=address,undefined QSPEC_CPU_BUILD_WAIT=3600 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 TRITON_INTERPRET=1
sanitize: setup
	$(SANITIZE_ENV) $(PY) -c "from kernels.cpu import build; import sys; \
		sys.exit(0 if build.available() else 'sanitized kernels: ' + str(build.failure()))"
	$(SANITIZE_ENV) $(PY) -m pytest -q -x -p no:cacheprovider $(SANITIZED_TESTS)
