"""Which persistent buffers an EPGroup allocates, and their shapes: from the config and the device alone.

A leaf module (no torch.distributed, no kernels), so a test on the CPU can see what a CUDA group of any
shape would allocate. The EPGroup (`group.py`) allocates exactly `group_buffer_shapes` at construction
and `weight_buffer_shapes` in `alloc_weight_buffers`.

One rank on CUDA (R = 1) allocates only what its kernels read: no op there reads a peer's buffer, so
- `send_rows` is absent: dispatch's pull reads the token rows x directly (csrc_cute/dispatch.py);
- `presum` is absent: combine sums each token's rows straight from the expert rows (`combine_local`);
- the slot pools and their fp32 reduce buffers are absent: a 1-rank plan copies nothing (every entry of
  experts_to_copy is -1, every slot group and remote group is empty), so the GEMMs get the home groups
  alone and `prefetch_weights` / `reduce_grad` have nothing to do (`BufferLayout.copies`).
An absent buffer is a tensor with no rows ([0, ...]: the ops' contracts accept that form where R = 1
allows it), and no buffer is symmetric memory: with no peer, each is an ordinary CUDA tensor whose
one-entry peer table is its own address. At the DESIGN shape (S=8192 H=7168 F=2048 E=48 K=8, B = epn)
that is 1.6 MB instead of 13.9 GB (12.7 GB of it the pools and reduce buffers, 1.0 GB presum). The CPU
reference allocates every buffer whatever R is (it is the reference of the full protocol).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from csrc_cute.status import control_words

from .config import EPConfig

# buffer name -> (shape, dtype); dtype None: the group's row dtype
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


@dataclass(frozen=True)
class BufferLayout:
    """What kind of buffers a group holds.

    symmetric: the buffers peers read live in symmetric memory (CUDA with R > 1); otherwise ordinary
        tensors (the CPU reference; CUDA with R = 1, where the peer table of a buffer is its own address).
    staged: `send_rows [S, H]` exists (else absent, [0, H]: dispatch reads x).
    presum: `presum [NvS, H]` exists (else absent, [0, H]: combine reads the rows).
    copies: the slot pools `[B, ...]` and the reduce buffers exist (else absent, [0, ...]: the plan
        copies nothing, the GEMMs see the home groups alone, prefetch and reduce_grad are skipped).
    """

    symmetric: bool
    staged: bool
    presum: bool
    copies: bool


def buffer_layout(cfg: EPConfig, device_type: str) -> BufferLayout:
    """The layout of a group of `cfg` on `device_type` ("cpu" or "cuda"): see the module docstring."""
    if device_type == "cuda" and cfg.R == 1:
        return BufferLayout(symmetric=False, staged=False, presum=False, copies=False)
    return BufferLayout(symmetric=device_type == "cuda", staged=True, presum=True, copies=True)


def group_buffer_shapes(cfg: EPConfig, layout: BufferLayout) -> Shapes:
    """The buffers of the communication ops, allocated with the group."""
    c = cfg
    return {
        "ctrl": ((control_words(c.R, c.E),), torch.int32),
        "send_rows": ((c.S if layout.staged else 0, c.H), None),
        "recv_w": ((c.NvS,), torch.float32),
        "recv_primary": ((c.NvS,), torch.int32),
        "recv_next": ((c.NvS,), torch.int32),
        "recv_src": ((c.NvS,), torch.int32),
        "presum": ((c.NvS if layout.presum else 0, c.H), None),
        "row_scratch": ((c.NvS,), torch.float32),
    }


def weight_buffer_shapes(cfg: EPConfig, layout: BufferLayout) -> Shapes:
    """The slot pools (row dtype) and, when the group can train (B = epn), their fp32 reduce buffers."""
    c = cfg
    slots = c.B if layout.copies else 0
    shapes = {"pool_gate": (slots, c.H, c.F), "pool_up": (slots, c.H, c.F), "pool_down": (slots, c.F, c.H)}
    out: Shapes = {name: (shape, None) for name, shape in shapes.items()}
    if c.B == c.epn:
        out.update({name.replace("pool", "reduce"): (shape, torch.float32) for name, shape in shapes.items()})
    return out


def shapes_bytes(shapes: Shapes, dtype: torch.dtype) -> int:
    """Bytes of the buffers `shapes`, with `dtype` as the row dtype."""
    total = 0
    for shape, dt in shapes.values():
        n = 1
        for w in shape:
            n *= w
        total += n * (dt or dtype).itemsize
    return total
