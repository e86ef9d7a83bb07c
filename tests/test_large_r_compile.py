"""EP4 and EP8 at the DESIGN.md shape (S=8192, H=7168, K=8, F=2048, epn=48, E=48*R, B=epn, P=128), on a
machine without a GPU: every communication and weight kernel an MoE layer launches at that R compiles for
sm_90a without spills (the planner and the barrier are compiled at R=8 and R=64 in test_plan_cute.py).
What CPU and simulation allow of issue 7 while no 4- or 8-GPU machine is lent; the runs themselves are
in the GPU suites (tests/test_ep_cuda.py runs every R that has GPUs)."""

import pytest

from kernel_compile import check_module_compiles
from moonep_ops.config import EPConfig

RANKS = (4, 8)


def design(R: int) -> EPConfig:
    return EPConfig(S=8192, H=7168, K=8, E=48 * R, F=2048, R=R)


@pytest.mark.parametrize("module,kernels", [
    ("dispatch", ("_meta_kernel", "_pull_kernel")),
    ("combine", ("_pull_kernel", "_gather_kernel")),  # its presum kernel does not depend on R
])
def test_comm_kernels_compile_at_ep4_and_ep8(module, kernels):
    configs = [dict(S=c.S, H=c.H, K=c.K, R=c.R, G=c.G, NVS=c.NvS, dtype="bfloat16") for c in map(design, RANKS)]
    check_module_compiles(f"csrc_cute.{module}:compile_all_for_check", kernels, len(configs),
                          kwargs={"configs": configs})


def test_weight_kernels_compile_at_ep4_and_ep8():
    configs = [[c.R, c.B, c.epn, c.H, c.F] for c in map(design, RANKS)]
    check_module_compiles("csrc_cute.weights:compile_all_for_check",
                          ("_prefetch_kernel", "_reduce_pull_kernel", "_reduce_zero_kernel"), len(configs),
                          kwargs={"configs": configs})
