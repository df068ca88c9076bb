# The set-up commands of the README. All work on a fresh machine (Python 3.11 + pip).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# One stamp per install flavour, named after setup.py's content: `run` installs the package
# alone (jax, flax, ...), `test` adds the test extras (pytest, torch, transformers, nbclient).
SETUP_HASH := $(shell cat setup.py | md5sum | cut -c1-8)
RUN_STAMP := $(VENV)/.installed-run-$(SETUP_HASH)
TEST_STAMP := $(VENV)/.installed-test-$(SETUP_HASH)
RUN_DIR ?= runs/main
# Two workers, one per core: most of a test's time is XLA compiling (one thread), so two
# processes use the two cores. Whole files go to one worker (loadfile), so a module's shared
# fixture (a trained run, the claims' smallest runs) is built once.
PYTEST := $(PY) -m pytest tests -q -x --durations=15 -n 2 --dist loadfile

.PHONY: run test test-fast install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): $(VENV)/bin/python setup.py
	$(PY) -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(VENV)/bin/python setup.py
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

install: $(RUN_STAMP)
install-test: $(TEST_STAMP)

# The main job: GeoNorm (harmonic) against Pre-LN on the built-in corpus (CPython's docs).
run: install
	$(PY) -m geonorm_jax main --workdir=$(RUN_DIR)

# Everything, the slow tests included (subprocesses, two processes, notebooks, HF parity).
test: install-test
	$(PYTEST)

# The inner loop: every test not marked `slow` (pytest.ini registers the marker). XLA's
# compiler dominates these tests, so compiled programs are kept in a persistent cache inside
# the venv: a rerun recompiles only what changed. (Not for `make test`, whose subprocesses
# and multi-process runs should start from nothing.)
JAX_CACHE := JAX_COMPILATION_CACHE_DIR=$(abspath $(VENV))/jax-cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
test-fast: install-test
	$(JAX_CACHE) $(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) runs
