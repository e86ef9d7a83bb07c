# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if it is missing.
# The venv sees the system's packages, so a machine that already has torch (the GPU machine's CUDA
# build) keeps it; a machine without torch gets the CPU wheel pinned below, never a CUDA build.
PYTHON ?= python3
VENV ?= .venv
CPU_TORCH ?= torch==2.13.0

# Set-up time on a fresh clone: where the system has pip, the venv uses it (no copy of pip bootstrapped
# into the venv, ~7 s); the editable install first builds with the setuptools already there (pyproject's
# build requirement) instead of installing it into an isolated build env (~4 s), and only where that
# fails (no setuptools >= 64 there) builds isolated.
$(VENV)/.installed: pyproject.toml
	if $(PYTHON) -m pip --version >/dev/null 2>&1; then $(PYTHON) -m venv --system-site-packages --without-pip $(VENV); \
	else $(PYTHON) -m venv --system-site-packages $(VENV); fi
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q $(CPU_TORCH)
	$(VENV)/bin/python -m pip install -q --no-build-isolation -e '.[test]' 2>/dev/null || \
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test gpu-test
demo: $(VENV)/.installed
	$(VENV)/bin/python -m moonep_ops.demo

# Two pytest workers (pytest-xdist): the multi-process gloo tests rendezvous through their own temp dirs,
# so they run side by side. --dist loadgroup hands the tests out one at a time, except that the tests
# sharing a module fixture (xdist_group marks: a compile, a benchmark's smoke run) go to one worker
# together, so that fixture runs once.
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup

# On a GPU machine (its own python3 and CUDA torch, CuTe DSL importable): the whole suite, the GPU tests
# included, with the 25 slowest tests listed. All test processes share one kernel disk cache (see
# tests/conftest.py and csrc_cute/jit.py), so each kernel is compiled once per session. Kernel compiles
# are single-threaded CPU work: GPU_TEST_WORKERS pytest-xdist workers (work-stealing, so one slow file
# does not hold a worker) run them side by side on one GPU; 8 fit the H200 machine's 16 cores. -v names
# each test as it ends, so a run cut short by a time limit still says which test failed.
# GPU_TESTS / GPU_TEST_ARGS pick part of the suite for a device call that cannot fit all of it, e.g.
#   make gpu-test GPU_TESTS=tests/test_group_gemm_wgrad.py GPU_TEST_ARGS="-k gather"
GPU_TEST_WORKERS ?= 8
GPU_TESTS ?= tests/
GPU_TEST_ARGS ?=
gpu-test:
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-test: no CUDA device (make test runs the CPU suite)')"
	$(PYTHON) -m pytest -v -p no:cacheprovider -n $(GPU_TEST_WORKERS) --dist worksteal --timeout=300 --durations=25 \
		$(GPU_TEST_ARGS) $(GPU_TESTS)
