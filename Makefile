# The two set-up commands of the README. Both work on a fresh machine (Python 3.11 + pip).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py | md5sum | cut -c1-8)
RUN_DIR ?= runs/main

.PHONY: run test install clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(VENV)/bin/python setup.py
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job: GeoNorm (harmonic) against Pre-LN on the built-in corpus (CPython's docs).
run: install
	$(PY) -m geonorm_jax main --workdir=$(RUN_DIR)

test: install
	$(PY) -m pytest tests -q -x --durations=15

clean:
	rm -rf $(VENV) runs
