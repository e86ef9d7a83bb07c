"""Canary-guarded device buffers for the kernels' table-check tests (tests/test_comm_cute.py,
tests/test_weights_cute.py): a write outside a buffer shows as a changed guard byte."""

import torch

CANARY_BYTES = 4096  # guard zone before and after every buffer (a row or slot written just past a buffer starts in it)


class Canaries:
    """Device buffers allocated as views into larger allocations whose guard zones before and after hold a
    fixed byte pattern: a write outside a buffer (within CANARY_BYTES) changes them."""

    def __init__(self):
        self.backings = []

    @staticmethod
    def pattern(n, device):
        return (torch.arange(n, device=device, dtype=torch.int32) * 37 + 11).remainder(251).to(torch.uint8)

    def empty(self, shape, dtype, device):
        n = torch.Size(shape).numel() * dtype.itemsize
        back = self.pattern(n + 2 * CANARY_BYTES, device)
        self.backings.append(back)
        return back[CANARY_BYTES:CANARY_BYTES + n].view(dtype).view(shape)

    def check(self):
        for i, back in enumerate(self.backings):
            want = self.pattern(back.numel(), back.device)
            n = back.numel() - 2 * CANARY_BYTES
            for zone, sl in (("before", slice(0, CANARY_BYTES)), ("after", slice(CANARY_BYTES + n, None))):
                bad = torch.nonzero(back[sl] != want[sl]).flatten()
                assert bad.numel() == 0, f"buffer {i}: {bad.numel()} canary bytes {zone} it changed"
