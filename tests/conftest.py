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

from csrc_cute.jit import CACHE_DIR_ENV  # noqa: E402  (needs ROOT on the path)

_SESSION_CACHE: list[str] = []


def pytest_configure(config):
    """One kernel disk cache per test session (unless the caller chose one): every test process and the
    rank processes they spawn (which inherit the environment) load what another one compiled."""
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
