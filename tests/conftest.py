import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # benchmarks/ (the routing generator) is not an installed package


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
