# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstall when the package metadata or the pins change.
STAMP := $(VENV)/.installed-test

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/wrap_a_branch.py
	$(VENV)/bin/s2hc params --layers 28 --dim 1024 --streams 4

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
