# packline — every target bootstraps .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?=
ARGS ?=
WHAT ?= packing
# pytest-xdist workers for the test targets (each test file stays on one worker, so a module's
# fixtures, e.g. the local SLURM cluster, start once). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: run test test-fast bench lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch (direct or transitive) pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/packline run $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# The inner loop: everything but the tests marked slow (whole pipelines, real subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/packline bench $(WHAT) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf runs .pytest_cache
