"""Fake (meta) kernels of the moonep ops: output shapes from static arguments only.

Each `fake/<op>.py` holds the fake kernel of `moonep::<op>`; `moonep_ops.ops` registers them. A fake
runs the op's contract check (`moonep_ops.checks`, the grouped GEMMs' in `group_gemm.py`), the same
one the CPU and CUDA implementations run, so bad input fails the same way when traced by
torch.compile / torch.export and when run eagerly, before any kernel launches. The fakes depend on
the checks alone (and, through them, on the static EPConfig a backward op's `ep_key` names), never on
the EP group or the ops.
"""

from . import backward, combine, dispatch, gather_row_weights, group_gemm, plan, prefetch_weights, reduce_grad

__all__ = ["backward", "combine", "dispatch", "gather_row_weights", "group_gemm", "plan", "prefetch_weights",
           "reduce_grad"]
