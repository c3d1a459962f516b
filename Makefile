# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Each stamp records one install; it is redone when the package metadata or the pins change.
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
# torchtitan's extra cannot share the test environment (pyproject.toml says why): its tests run in one of their own.
TITAN_VENV := $(VENV)-torchtitan
TITAN_STAMP := $(TITAN_VENV)/.installed-torchtitan

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[plot]'
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test]'
	touch $@

$(TITAN_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[torchtitan]' \
		pytest hypothesis
	touch $@

# Train residual, mhc and s2hc (n = 4) on the embedded corpus and write runs/demo/report.md (a new demo each time;
# DEMO_RESUME=1 goes on with the one in DEMO_OUT, after Ctrl-C). A short one (DEMO_STEPS) evaluates five times, at
# every ceil(DEMO_STEPS / 5) steps, so its curves and speedups have points to read.
# CI runs a short one in a fresh environment: make demo VENV=/tmp/v DEMO_STEPS=3 DEMO_OUT=/tmp/demo
DEMO_OUT ?= runs/demo
DEMO_STEPS ?=
DEMO_RESUME ?=
DEMO_EVAL_EVERY = $(shell expr \( $(DEMO_STEPS) + 4 \) / 5)
demo: $(DEMO_STAMP)
	$(VENV)/bin/s2hc compare --config configs/demo-tiny.yaml --families residual,mhc,s2hc --streams 4 \
		--out $(DEMO_OUT) $(if $(DEMO_RESUME),--resume,--overwrite) \
		$(if $(DEMO_STEPS),--max-steps $(DEMO_STEPS) --eval-every $(DEMO_EVAL_EVERY))

# Lint (ruff, configured in pyproject.toml), then the whole suite; then the torchtitan integration's tests in its own
# environment (in the test environment they skip, saying so).
test: $(TEST_STAMP) $(TITAN_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(TITAN_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_torchtitan.py

clean:
	rm -rf $(VENV) $(TITAN_VENV) .pytest_cache .hypothesis
