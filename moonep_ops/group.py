"""An EP group: the process group, the static config, and the persistent buffers the ops write.

Buffers are allocated once and shared by every MoE layer of the process; their shapes come from the
config alone, so memory is the same whatever the routing. On the CPU they are ordinary tensors and
the reference ops move data with gloo; the CUDA implementation allocates them in symmetric memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import EPConfig


class EPGroup:
    def __init__(self, cfg: EPConfig, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("EPGroup: initialise torch.distributed first (gloo on CPU)")
        self.group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(self.group)
        if world != cfg.R:
            raise ValueError(f"EPGroup: EPConfig.R={cfg.R} but the process group has {world} ranks")
        device = torch.device(device)
        if device.type != "cpu":
            raise ValueError(f"EPGroup: device {device} has no moonep kernels yet; only the CPU "
                             f"reference path exists in this version")
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.rank = dist.get_rank(self.group)
        self.group_name = self.group.group_name
        c = cfg

        def buf(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        # receive side of dispatch: expert-grouped rows, their route weights, and per row the row
        # that carried its token over the link (-1 = padding)
        self.recv_rows = buf(c.NvS, c.H)
        self.recv_w = buf(c.NvS, dtype=torch.float32)
        self.recv_primary = buf(c.NvS, dtype=torch.int32)
        # combine: each token's rows on this rank pre-summed, read back by the token's rank
        self.presum = buf(c.NvS, c.H)
        # copy slots, shared by every layer, and the fp32 gradients of the copies
        self.pool_gate, self.pool_up, self.pool_down = buf(c.B, c.H, c.F), buf(c.B, c.H, c.F), buf(c.B, c.F, c.H)
        self.reduce_gate = buf(c.B, c.H, c.F, dtype=torch.float32)
        self.reduce_up = buf(c.B, c.H, c.F, dtype=torch.float32)
        self.reduce_down = buf(c.B, c.F, c.H, dtype=torch.float32)

    @property
    def recv_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.recv_rows, self.recv_w, self.recv_primary

    @property
    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pool_gate, self.pool_up, self.pool_down

    @property
    def reduce_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.reduce_gate, self.reduce_up, self.reduce_down

    def destroy(self) -> None:
        """Release the buffers (before the process group is destroyed)."""
        for name in ("recv_rows", "recv_w", "recv_primary", "presum", "pool_gate", "pool_up", "pool_down",
                     "reduce_gate", "reduce_up", "reduce_down"):
            setattr(self, name, None)


MOONEP_OPS = ("plan", "dispatch", "combine", "gather_row_weights", "group_gemm", "group_gemm_dgrad",
              "group_gemm_wgrad", "prefetch_weights", "reduce_grad")


def cuda_kernels_available() -> bool:
    """True once every moonep op has a CUDA implementation registered (the GPU path of the demo)."""
    from . import ops  # noqa: F401  (defines the ops)
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"moonep::{op}", "CUDA") for op in MOONEP_OPS)
