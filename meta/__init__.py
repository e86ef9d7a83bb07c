"""Fake (meta) kernels of the moonep ops: input checks and output shapes from static arguments only.

Each `meta/<op>.py` holds the fake kernel of `moonep::<op>`; `moonep_ops.ops` registers them. The
CUDA and CPU implementations run the same checks, so bad input fails the same way when traced by
torch.compile / torch.export and when run eagerly, before any kernel launches.
"""
