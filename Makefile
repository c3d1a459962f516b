# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Each stamp records one install; it is redone when the package metadata or the pins change.
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[plot]'
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test]'
	touch $@

# Train residual, mhc and s2hc (n = 4) on the embedded corpus and write runs/demo/report.md (a new demo each time).
# CI runs a short one in a fresh environment: make demo VENV=/tmp/v DEMO_STEPS=3 DEMO_OUT=/tmp/demo
DEMO_OUT ?= runs/demo
DEMO_STEPS ?=
demo: $(DEMO_STAMP)
	$(VENV)/bin/s2hc compare --config configs/demo-tiny.yaml --families residual,mhc,s2hc --streams 4 \
		--out $(DEMO_OUT) --overwrite $(if $(DEMO_STEPS),--max-steps $(DEMO_STEPS) --eval-every $(DEMO_STEPS))

# Lint (ruff, configured in pyproject.toml), then the whole suite.
test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
