import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # benchmarks/ (the routing generator) is not an installed package

from csrc_cute.jit import CACHE_DIR_ENV, COMPILE_WORKERS_ENV  # noqa: E402  (needs ROOT on the path)

_SESSION_CACHE: list[str] = []


def _share_the_cores() -> None:
    """Each pytest-xdist worker computes with its share of the cores (CI: 2 workers on 2 cores, one
    thread each), and so do the processes it starts (rank processes, benchmark scripts, Inductor's
    compiles), unless the caller set OMP_NUM_THREADS. Two workers of two intra-op threads each on 2 cores
    made small CPU ops wait milliseconds for a descheduled OpenMP thread (torch.searchsorted on a few
    hundred ints: 7 ms instead of 7 us); Inductor's compile pool (a fresh interpreter importing torch in
    every compiling process) costs more CPU than the tests' small graphs take to compile in process.
    The kernels a GPU test's first MoE step compiles ahead (csrc_cute/jit.py) take that share too."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
    os.environ.setdefault(COMPILE_WORKERS_ENV, threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    """One kernel disk cache per test session (unless the caller chose one): every test process and the
    rank processes they spawn (which inherit the environment) load what another one compiled. Each
    xdist worker's threads: _share_the_cores."""
    _share_the_cores()
    if not os.environ.get(CACHE_DIR_ENV):
        _SESSION_CACHE.append(tempfile.mkdtemp(prefix="moonep_cute_cache_"))
        os.environ[CACHE_DIR_ENV] = _SESSION_CACHE[0]


def pytest_unconfigure(config):
    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(CACHE_DIR_ENV) == path:
            del os.environ[CACHE_DIR_ENV]


@pytest.fixture(scope="session")
def gloo1(tmp_path_factory):
    """A world-size-1 gloo process group in the test process itself (for single-rank op tests)."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo1") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
