"""Grouped GEMM for Hopper (sm_90a) in the CuTe DSL: forward, dgrad, dgrad of two operand pairs into one
output (dgrad2), varlen-K wgrad, the fused SwiGLU
gate/up kernel, the row-scaled forward and the SwiGLU-backward dgrad (remote-group variants of the
inference kernels included).

Modules: ``config`` (tile configurations), ``host`` (validation, compile cache, launch; imports no
DSL until a kernel is compiled), ``base`` (the shared mainloop, epilogue helpers and the one
warp-specialized producer/consumer skeleton), ``scheduler`` (tile schedulers), ``walk`` (which tiles a
persistent CTA takes, the static walk or in order from a global counter, and the scheduler warp that computes
their coordinates ahead), ``remote`` (remote-weight
descriptors), ``pairs`` (dgrad2's two operand pairs), and one module per kernel family: ``rows`` (forward,
dgrad, dgrad2, row scale), ``swiglu``
(with ``gather``: the gathered A operand, rows of x by index),
``swiglu_bwd`` (with ``swiglu_bwd_smem``, its shared-memory epilogue, and ``gather``: g_y's rows by index),
``wgrad`` (also with ``gather``: k rows of x, or of dy, by index); ``host_gather`` holds the host wrappers of
the kernels that gather an operand's rows by index. This package exports the host API.
"""

from .config import (
    H100_H200_NUM_SMS,
    GroupGemmConfig,
    select_config,
    select_dgrad_config,
    select_hbm_rows_config,
    select_swiglu_bwd_config,
    select_swiglu_config,
    select_wgrad_config,
    select_wide_rows_config,
)
from .host import (
    compile_group_gemm,
    compile_group_gemm_dgrad,
    compile_group_gemm_dgrad2,
    compile_group_gemm_for_sm90,
    compile_group_gemm_row_scale,
    compile_group_gemm_swiglu,
    compile_group_gemm_swiglu_bwd,
    compile_group_gemm_swiglu_bwd_gather,
    compile_group_gemm_swiglu_gather,
    compile_group_gemm_wgrad,
    compile_group_gemm_wgrad_gather,
    compile_op,
    group_gemm_dgrad,
    group_gemm_dgrad2,
    group_gemm_fwd,
    group_gemm_row_scale,
    group_gemm_swiglu,
    group_gemm_swiglu_bwd,
    group_gemm_wgrad,
)
from .host_gather import (
    group_gemm_swiglu_bwd_gather,
    group_gemm_swiglu_gather,
    group_gemm_wgrad_gather,
    group_gemm_wgrad_gather_b,
)

__all__ = [
    "H100_H200_NUM_SMS",
    "GroupGemmConfig",
    "select_config",
    "select_dgrad_config",
    "select_hbm_rows_config",
    "select_swiglu_bwd_config",
    "select_swiglu_config",
    "select_wgrad_config",
    "select_wide_rows_config",
    "compile_group_gemm",
    "compile_group_gemm_dgrad",
    "compile_group_gemm_dgrad2",
    "compile_group_gemm_for_sm90",
    "compile_group_gemm_row_scale",
    "compile_group_gemm_swiglu",
    "compile_group_gemm_swiglu_bwd",
    "compile_group_gemm_swiglu_bwd_gather",
    "compile_group_gemm_swiglu_gather",
    "compile_group_gemm_wgrad",
    "compile_group_gemm_wgrad_gather",
    "compile_op",
    "group_gemm_dgrad",
    "group_gemm_dgrad2",
    "group_gemm_fwd",
    "group_gemm_row_scale",
    "group_gemm_swiglu",
    "group_gemm_swiglu_bwd",
    "group_gemm_swiglu_bwd_gather",
    "group_gemm_swiglu_gather",
    "group_gemm_wgrad",
    "group_gemm_wgrad_gather",
    "group_gemm_wgrad_gather_b",
]
