# packline — every target bootstraps .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Exact versions of everything the suite passed on (pyproject.toml keeps the supported ranges).
LOCK := requirements.lock
CONFIG ?=
ARGS ?=
WHAT ?= packing
# A machine without nvidia-smi gets a CPU venv (docs/install.md); CPU_ONLY=0 or 1 forces either.
CPU_ONLY ?= $(if $(shell command -v nvidia-smi),0,1)
# pytest-xdist workers for the test targets (each test file stays on one worker, so a module's
# fixtures, e.g. the local SLURM cluster, start once). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: run test test-fast bench lint format lock clean

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch (direct or transitive) pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -c $(LOCK) -e '.[dev]'
# No GPU: triton (it compiles GPU kernels) and the CUDA Python bindings go, 0.9 GB. The nvidia-*
# libraries stay: torch's CUDA build links them and does not import without them.
ifeq ($(CPU_ONLY),1)
	$(PY) -m pip uninstall --quiet --yes triton cuda-bindings cuda-pathfinder
endif
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/packline run $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# The inner loop: everything but the tests marked slow (whole pipelines, real subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(ARGS)

# WHAT=cluster-memory runs Megatron-Bridge's data path: Bridge main's module files from the
# vendored archive (../shared/vendor), unchanged, the way the tests load them.
bench: $(STAMP)
	$(VENV)/bin/packline bench $(WHAT) $(ARGS) $(if $(filter cluster-memory,$(WHAT)),--bridge-path $$($(PY) -c "from tests.bridge_data import bridge_main_tree; print(bridge_main_tree())"))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Upgrade the venv to the newest versions pyproject.toml allows and write them to the lock.
# A new release can change what packline measures (transformers 5.25 dropped two tokens per
# video): run make test on the result before committing it.
# On a CPU machine it also puts back triton and cuda-bindings (torch asks for them), so the
# lock stays whole.
lock: $(STAMP)
	$(PY) -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[dev]'
	( grep '^#' $(LOCK); $(PY) -m pip freeze --exclude-editable ) > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	touch $(STAMP)

clean:
	rm -rf runs .pytest_cache
