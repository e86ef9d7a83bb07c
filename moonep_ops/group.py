"""An EP group: the process group, the static config, and the persistent buffers the ops write.

Buffers are allocated once and shared by every MoE layer of the process; their shapes come from the
config alone, so memory is the same whatever the routing. On the CPU they are ordinary tensors and
the reference ops move data with gloo. On CUDA every buffer a peer reads or writes is allocated in
symmetric memory (`torch.distributed._symmetric_memory`), and the kernels get each buffer's R peer
addresses as an int64 tensor (`peers(buffer)`). The control block (`ctrl`, layout in
csrc_cute/status.py) holds the status word, the barrier epoch, the signal slots and the count matrix.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref

import torch
import torch.distributed as dist

from csrc_cute.status import DEFAULT_COMM_SMS, DEFAULT_TIMEOUT_S, STATUS_WORD, control_words

from .config import EPConfig
from .status import check_status


# data_ptr of a symmetric buffer -> (its owning EPGroup, int64 [R] peer addresses); data_ptr of a
# control block -> its EPGroup. Weak values: a destroyed group leaves no entry behind.
_PEERS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_GROUP_OF_CTRL: dict[int, weakref.ref] = {}
# EPGroup.key -> the group: how the backward ops (which take no buffer, see docs/design-notes.md) find it
_GROUP_OF_KEY: dict[str, weakref.ref] = {}
_SERIAL = itertools.count()


class EPGroup:
    """Process group + EPConfig + persistent buffers.

    timeout_s: how long a cross-rank wait spins before it sets STATUS_TIMEOUT (CUDA).
    comm_sms: CTAs (one per SM) the dispatch/combine kernels use, leaving the rest for compute (CUDA).
    debug: check the status word after every CUDA op (a host sync per op; also MOONEP_DEBUG=1).
    """

    def __init__(self, cfg: EPConfig, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S, comm_sms: int = DEFAULT_COMM_SMS,
                 debug: bool | None = None):
        if not dist.is_initialized():
            raise RuntimeError("EPGroup: initialise torch.distributed first (gloo on CPU, nccl on CUDA)")
        self.group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(self.group)
        if world != cfg.R:
            raise ValueError(f"EPGroup: EPConfig.R={cfg.R} but the process group has {world} ranks")
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"EPGroup: device must be cpu or cuda, got {device}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not timeout_s > 0:
            raise ValueError(f"EPGroup: timeout_s must be > 0, got {timeout_s}")
        if not isinstance(comm_sms, int) or comm_sms < 1:
            raise ValueError(f"EPGroup: comm_sms must be an int >= 1, got {comm_sms!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.timeout_s = float(timeout_s)
        self.comm_sms = comm_sms
        self.debug = os.environ.get("MOONEP_DEBUG", "0") not in ("", "0") if debug is None else bool(debug)
        self.rank = dist.get_rank(self.group)
        self.group_name = self.group.group_name
        self.key = f"{self.group_name}/{next(_SERIAL)}"  # names this EPGroup in the backward ops' schemas
        _GROUP_OF_KEY[self.key] = weakref.ref(self)
        self._symmetric = device.type == "cuda"
        self._handles = []  # symmetric-memory handles, kept alive with the buffers
        c = cfg

        self.ctrl = self._buffer(control_words(c.R, c.E), dtype=torch.int32)
        # dispatch: this rank's tokens staged for the peers to read, and per receive row its route
        # weight, the row that carried its token over the link (-1 = padding), the token's next row on
        # this rank (k order) and the token's source (rank * S + token)
        self.send_rows = self._buffer(c.S, c.H)
        self.recv_w = self._buffer(c.NvS, dtype=torch.float32)
        self.recv_primary = self._buffer(c.NvS, dtype=torch.int32, fill=-1)
        self.recv_next = self._buffer(c.NvS, dtype=torch.int32, fill=-1)
        self.recv_src = self._buffer(c.NvS, dtype=torch.int32, fill=-1)
        # combine: each token's rows on this rank pre-summed, read back by the token's rank
        self.presum = self._buffer(c.NvS, c.H)
        # per-row values (route-weight gradients) read back by the tokens' ranks
        self.row_scratch = self._buffer(c.NvS, dtype=torch.float32)
        self._pools = self._reduce = None
        self._home_weights = []  # symmetric home-expert weights (inference with B < epn reads them remotely)
        if self._symmetric:
            _GROUP_OF_CTRL[self.ctrl.data_ptr()] = weakref.ref(self)
            torch.cuda.synchronize(device)
            dist.barrier(group=self.group)  # every peer's buffers are initialised before anyone writes

    def _buffer(self, *shape, dtype=None, fill=0):
        dtype = dtype or self.dtype
        if not self._symmetric:
            return torch.full(shape, fill, dtype=dtype, device=self.device)
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        t.fill_(fill)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
                symm_mem.enable_symm_mem_for_group(self.group_name)
        handle = symm_mem.rendezvous(t, self.group)
        self._handles.append(handle)
        # a fixed address for the compiler: CUDA graphs (mode="reduce-overhead") then use the buffer
        # itself instead of copying it into a graph-owned input (a copy would not be symmetric memory)
        torch._dynamo.mark_static_address(t)
        addrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        _PEERS[t.data_ptr()] = (weakref.ref(self), addrs)
        return t

    @property
    def status(self) -> torch.Tensor:
        """This rank's status word (int32 [1], a view of the control block)."""
        return self.ctrl[STATUS_WORD:STATUS_WORD + 1]

    def check(self, where: str = "") -> None:
        """Raise MoEStatusError if a kernel of this group reported a problem (syncs the host)."""
        check_status(self.status, where)

    @property
    def dispatch_buffers(self) -> tuple[torch.Tensor, ...]:
        """send_rows, recv_w, recv_primary, recv_next, recv_src (the persistent buffers of dispatch)."""
        return self.send_rows, self.recv_w, self.recv_primary, self.recv_next, self.recv_src

    def alloc_weight_buffers(self) -> None:
        """Allocate the copy slots (bf16 [B, H, F] x2, [B, F, H]) shared by every layer and, when the
        group can train (B = epn), the fp32 gradients of the copies; symmetric on CUDA (collective: every
        rank calls it, as MoEExperts does). A user of the communication ops alone never pays for them,
        and an inference group (B < epn) never pays for gradient buffers."""
        if self._pools is not None:
            return
        c = self.cfg
        if self._symmetric and c.B == 0:
            raise ValueError("EPGroup: EPConfig.B=0 (every copy read remotely) runs on the CPU reference only; "
                             "on CUDA use B >= 1 (the slot pools are symmetric buffers, which cannot be empty)")
        shapes = ((c.B, c.H, c.F), (c.B, c.H, c.F), (c.B, c.F, c.H))
        self._pools = tuple(self._buffer(*shape) for shape in shapes)
        if c.B == c.epn:
            self._reduce = tuple(self._buffer(*shape, dtype=torch.float32) for shape in shapes)
        if self._symmetric:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)

    def home_weight(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A home-expert weight tensor that peers can read (collective on CUDA): with B < epn the grouped
        GEMM reads the copies that got no slot straight from their home rank's weights (DESIGN.md,
        "Memory contract"). On CUDA it is symmetric memory; on the CPU an ordinary tensor."""
        t = self._buffer(*shape, dtype=dtype)
        self._home_weights.append(t)
        if self._symmetric:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        return t

    def _weight_buffers(self):
        if self._pools is None:
            raise RuntimeError("EPGroup: call alloc_weight_buffers() first (MoEExperts does it)")
        return self._pools, self._reduce

    @property
    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._weight_buffers()[0]

    @property
    def reduce_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reduce = self._weight_buffers()[1]
        if reduce is None:
            raise RuntimeError(f"EPGroup: B={self.cfg.B} < epn={self.cfg.epn} is inference only: it has no "
                               f"gradient buffers (train with B = epn)")
        return reduce

    def destroy(self) -> None:
        """Release the buffers (before the process group is destroyed)."""
        if self._symmetric and self.ctrl is not None:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)  # no peer still reads or writes our buffers
            _GROUP_OF_CTRL.pop(self.ctrl.data_ptr(), None)
        for name in ("ctrl", "send_rows", "recv_w", "recv_primary", "recv_next", "recv_src", "presum", "row_scratch"):
            t = getattr(self, name)
            if t is not None:
                _PEERS.pop(t.data_ptr(), None)
            setattr(self, name, None)
        for t in (self._pools or ()) + (self._reduce or ()) + tuple(self._home_weights):
            _PEERS.pop(t.data_ptr(), None)
        self._pools = self._reduce = None
        self._home_weights = []
        self._handles.clear()
        _GROUP_OF_KEY.pop(self.key, None)


def peers(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """int64 [R] addresses of symmetric buffer `t` on every rank (CUDA ops only)."""
    entry = _PEERS.get(t.data_ptr())
    if entry is None or entry[0]() is None:
        raise ValueError(f"moonep.{op}: {name} must be the symmetric buffer of a live CUDA EPGroup "
                         f"(pass the EPGroup's own buffer, not a copy)")
    return entry[1]


def group_of(op: str, ctrl: torch.Tensor) -> EPGroup:
    """The CUDA EPGroup whose control block is `ctrl`."""
    ref = _GROUP_OF_CTRL.get(ctrl.data_ptr())
    ep = ref() if ref is not None else None
    if ep is None:
        raise ValueError(f"moonep.{op}: ctrl must be the control block of a live CUDA EPGroup (EPGroup.ctrl)")
    return ep


def group_by_key(op: str, key: str) -> EPGroup:
    """The live EPGroup whose `key` is `key`."""
    ref = _GROUP_OF_KEY.get(key)
    ep = ref() if ref is not None else None
    if ep is None or ep.ctrl is None:
        raise ValueError(f"moonep.{op}: ep_key={key!r} names no live EPGroup (pass EPGroup.key)")
    return ep


MOONEP_OPS = ("plan", "dispatch", "combine", "gather_row_weights", "group_gemm", "group_gemm_dgrad",
              "group_gemm_dgrad2", "group_gemm_wgrad", "group_gemm_swiglu", "group_gemm_row_scale", "group_gemm_swiglu_bwd",
              "prefetch_weights", "reduce_grad")


def cuda_kernels_available() -> bool:
    """True once every moonep op has a CUDA implementation registered (the GPU path of the demo)."""
    from . import ops  # noqa: F401  (defines the ops)
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"moonep::{op}", "CUDA") for op in MOONEP_OPS)
