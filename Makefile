# Two commands a fresh machine needs: `make demo` and `make test`. Both create .venv and install
# the pinned dependencies (constraints.txt) the first time, then reuse it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tritondnn demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples

# pytest exits 5 when it collects no tests; make treats any non-zero exit as failure.
test: lint
	$(PY) -m pytest -q -n $${PYTEST_WORKERS:-2} tests

bench: $(STAMP)
	$(PY) -m tritondnn bench --json bench/results/latest.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
