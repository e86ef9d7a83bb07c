"""Shared experts: a dense SwiGLU every token goes through, added to the routed experts' output.

Qwen2-MoE scales it per token by sigmoid(x . w) (`gated=True`, the `shared_expert_gate` of HF);
DeepSeek-V2/V3 adds it ungated (`n_shared_experts` experts fused into one intermediate size).
Its parameters are ordinary dense parameters: under expert parallelism every rank holds all of them
and their gradients must be all-reduced over the data-parallel group (moonep_ops/hf.py,
`allreduce_dense_grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SharedExperts(nn.Module):
    """y = down(silu(gate_proj(x)) * up_proj(x)), times sigmoid(gate(x)) when `gated`."""

    def __init__(self, H: int, F_shared: int, gated: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        for name, v in (("H", H), ("F_shared", F_shared)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SharedExperts: {name} must be an int >= 1, got {v!r}")
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(H, F_shared, **kw)
        self.up_proj = nn.Linear(H, F_shared, **kw)
        self.down_proj = nn.Linear(F_shared, H, **kw)
        self.gate = nn.Linear(H, 1, **kw) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y
