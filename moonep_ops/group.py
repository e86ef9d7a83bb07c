"""An EP group: the process group, the static config, and the persistent buffers the ops write.

Buffers are allocated once and shared by every MoE layer of the process; their shapes come from the
config alone, so memory is the same whatever the routing. On the CPU they are ordinary tensors and
the reference ops move data with gloo. On CUDA every buffer a peer reads or writes is allocated in
symmetric memory (`torch.distributed._symmetric_memory`), and the kernels get each buffer's R peer
addresses as an int64 tensor (`peers(buffer)`). One rank on CUDA has no peer: its buffers are ordinary
tensors (a buffer's peer table is its own address) and it allocates none that no kernel reads there
(`send_rows`, `presum`, the slot pools and reduce buffers are absent; moonep_ops/buffers.py). The
control block (`ctrl`, layout in csrc_cute/status.py) holds the status word, the barrier epoch, the
signal slots and the count matrix.
"""

from __future__ import annotations

import itertools
import os
import warnings

import torch
import torch.distributed as dist

from csrc_cute.status import DEFAULT_COMM_SMS, DEFAULT_TIMEOUT_S, STATUS_WORD

from . import agreement, registry
from .buffers import buffer_layout, group_buffer_shapes, weight_buffer_shapes
from .config import EPConfig
from .status import MoEStatusError, check_status


_SERIAL = itertools.count()


def _static_shape(t: torch.Tensor) -> torch.Tensor:
    """The group's buffers have the static capacity's shape: under torch.compile(dynamic=True) their
    sizes stay constants instead of becoming symbols (a symbolic buffer size saved for a backward is
    what torch 2.11's autograd.Function tracing cannot wire: "overwrite_tensor_vt_proxy" assertion)."""
    torch._dynamo.mark_static(t)
    return t


class EPGroup:
    """Process group + EPConfig + persistent buffers.

    timeout_s: how long a cross-rank wait lasts before it fails: on CUDA a barrier sets STATUS_TIMEOUT;
      on the CPU an op raises MoEStatusError (the ops' agreement exchange and their collectives).
    Building it is collective: the ranks' EPConfig, dtype and device type must agree (moonep_ops/agreement.py).
    comm_sms: CTAs the dispatch/combine/weight kernels launch (CUDA). Default: 32 with R > 1 (one per
      SM), leaving the other SMs to compute a framework may overlap with the link traffic; two per SM
      with R = 1, where those kernels are local HBM passes with nothing beside them: dispatch's pull keeps
      one CTA per SM resident (its shared-memory slots), and a second wave evens out the rows' uneven
      work (an H200 at the DESIGN shape: 432 -> 416 us from 132 to 264 CTAs; the earlier vector pull
      464 -> 428 us, no better with 396 or 528; combine the same with each).
    debug: check the status word after every CUDA op (a host sync per op; also MOONEP_DEBUG=1).
    recompute_rows: the experts' backward rebuilds the dispatched rows [NvS, H] by dispatching the layer's
      tokens again (one more dispatch per layer and step: 0.1-0.5 ms at the DESIGN shape on an H200, a
      collective at R > 1) instead of the forward keeping them: each layer holds its tokens [S, H]
      (1/K of the rows) from forward to backward, and the backward's peak is one [NvS, H] lower
      (the rows are rebuilt into the row gradients' memory once those are read). Same kernels on the
      same inputs: outputs and gradients bitwise those without it, eager and compiled, CUDA-graph
      replays included. Default (None): True at R = 1, where the second dispatch is a local HBM gather
      (one H200 at the DESIGN shape: peak 15.05 -> 14.37 GB for 29.98 -> 30.08 ms a step;
      results/bench_peers_0584d8e.json), False at R > 1, where it would cross the links again. With
      gather_rows no rows are written to rebuild: it applies to the materialised path only.
    gather_rows: R = 1 only: the layer dispatches no rows. Every row is one of this rank's own tokens, so
      the dispatch writes only the row tables (`row_src`: each row's token) and the grouped GEMMs read
      the tokens [S, H], and in backward the tokens' gradient [S, H], by `row_src` in place
      (moonep_ops/ops_gathered.py): neither the rows nor their gradient [NvS, H] is written, and the
      layer keeps its tokens for backward as with recompute_rows. Outputs and gradients bitwise those
      of the materialised path. Default (None): True at R = 1; True with R > 1 is refused (the rows
      of other ranks' tokens are pulled over the links by moonep::dispatch).
    device: default from the process group's backend: nccl -> the current CUDA device, gloo -> cpu.
    dtype: the dtype the experts and the communication buffers compute in; default bf16 on CUDA (the
        only dtype of the CUDA kernels: anything else is refused) and torch.get_default_dtype() (fp32)
        on the CPU reference, which runs any float dtype.
    R = 1 needs no process group: without an initialised torch.distributed, EPGroup initialises a
    1-rank default group itself (in-process HashStore; gloo for cpu, nccl for cuda;
    `owns_process_group` is then True). It stays the process's default group (later EPGroups and
    other code share it); `dist.destroy_process_group()` ends it.
    """

    def __init__(self, cfg: EPConfig, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, comm_sms: int | None = None,
                 debug: bool | None = None, recompute_rows: bool | None = None, gather_rows: bool | None = None):
        self.owns_process_group = _init_single_rank_world(cfg, group, device)
        self.group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(self.group)
        if world != cfg.R:
            raise ValueError(f"EPGroup: EPConfig.R={cfg.R} but the process group has {world} ranks")
        device, dtype = _default_device_dtype(self.group, device, dtype)
        if not timeout_s > 0:
            raise ValueError(f"EPGroup: timeout_s must be > 0, got {timeout_s}")
        if comm_sms is None:
            one_rank_gpu = device.type == "cuda" and cfg.R == 1
            comm_sms = 2 * torch.cuda.get_device_properties(device).multi_processor_count if one_rank_gpu \
                else DEFAULT_COMM_SMS
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 1:
            raise ValueError(f"EPGroup: comm_sms must be an int >= 1, got {comm_sms!r}")
        if recompute_rows is None:
            recompute_rows = cfg.R == 1
        if not isinstance(recompute_rows, bool):
            raise ValueError(f"EPGroup: recompute_rows must be a bool or None, got {recompute_rows!r}")
        if gather_rows is None:
            gather_rows = cfg.R == 1
        if not isinstance(gather_rows, bool):
            raise ValueError(f"EPGroup: gather_rows must be a bool or None, got {gather_rows!r}")
        if gather_rows and cfg.R > 1:
            raise ValueError(f"EPGroup: gather_rows=True needs R = 1 (the GEMMs read this rank's own tokens), got "
                             f"R={cfg.R}: with more ranks the rows are pulled over the links (gather_rows=False)")
        agreement.check_fingerprint(cfg, dtype, device, self.group, float(timeout_s), recompute_rows)
        self.recompute_rows = recompute_rows
        self.gather_rows = gather_rows
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.timeout_s = float(timeout_s)
        self.comm_sms = comm_sms
        self.debug = os.environ.get("MOONEP_DEBUG", "0") not in ("", "0") if debug is None else bool(debug)
        self.rank = dist.get_rank(self.group)
        self.group_name = self.group.group_name
        self.key = f"{self.group_name}/{next(_SERIAL)}"  # names this EPGroup in the backward ops' schemas
        registry.add_group(self)
        self.layout = buffer_layout(cfg, device.type)  # R = 1 on CUDA: only what the kernels read (buffers.py)
        self._cuda = device.type == "cuda"
        self._handles = []  # symmetric-memory handles, kept alive with the buffers
        self._allocated: list[torch.Tensor] = []  # every buffer of the group (buffer_bytes), home weights aside

        shapes = group_buffer_shapes(cfg, self.layout)
        self.ctrl = self._buffer(*shapes["ctrl"])
        agreement.init_ctrl(self.ctrl, self.timeout_s)
        # dispatch: this rank's tokens staged for the peers to read (absent at R = 1 on CUDA), and per
        # receive row its route weight, the row that carried its token over the link (-1 = padding), the
        # token's next row on this rank (k order) and the token's source (rank * S + token)
        self.send_rows = self._buffer(*shapes["send_rows"])
        self.recv_w = self._buffer(*shapes["recv_w"])
        self.recv_primary = self._buffer(*shapes["recv_primary"], fill=-1)
        self.recv_next = self._buffer(*shapes["recv_next"], fill=-1)
        self.recv_src = self._buffer(*shapes["recv_src"], fill=-1)
        # combine: each token's rows on this rank pre-summed, read back by the token's rank (absent at
        # R = 1 on CUDA)
        self.presum = self._buffer(*shapes["presum"])
        # per-row values (route-weight gradients) read back by the tokens' ranks
        self.row_scratch = self._buffer(*shapes["row_scratch"])
        self._pools = self._reduce = None
        self._home_weights = []  # symmetric home-expert weights (inference with B < epn reads them remotely)
        if self._cuda:
            registry.add_ctrl(self, self.ctrl)
            self._sync_peers()  # every peer's buffers are initialised before anyone writes

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype | None, fill: int = 0,
                record: bool = True) -> torch.Tensor:
        """One persistent buffer: symmetric memory (CUDA, R > 1) with its peers' addresses registered, an
        ordinary CUDA tensor (R = 1: its own address is its one-entry peer table; no peer table for an
        absent buffer, which nobody reads), or an ordinary CPU tensor."""
        dtype = dtype or self.dtype
        if not self._cuda:
            t = _static_shape(torch.full(shape, fill, dtype=dtype, device=self.device))
        elif self.layout.symmetric:
            t = self._symmetric_buffer(shape, dtype, fill)
        else:
            t = torch.full(shape, fill, dtype=dtype, device=self.device)
            if t.numel():
                registry.add_peers(self, t, torch.tensor([t.data_ptr()], dtype=torch.int64, device=self.device))
        if self._cuda:
            # a fixed address for the compiler: CUDA graphs (mode="reduce-overhead") then use the buffer
            # itself instead of copying it into a graph-owned input (a copy would not be symmetric memory)
            torch._dynamo.mark_static_address(_static_shape(t))
        if record:
            self._allocated.append(t)
        return t

    def _symmetric_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        t.fill_(fill)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
                symm_mem.enable_symm_mem_for_group(self.group_name)
        handle = symm_mem.rendezvous(t, self.group)
        self._handles.append(handle)
        addrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        registry.add_peers(self, t, addrs)
        return t

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the group's persistent buffers (control block, dispatch/combine buffers and, once
        allocated, the slot pools and reduce buffers; not the home weights, which are the layers')."""
        return sum(t.numel() * t.element_size() for t in self._allocated)

    @property
    def status(self) -> torch.Tensor:
        """This rank's status word (int32 [1], a view of the control block)."""
        return self.ctrl[STATUS_WORD:STATUS_WORD + 1]

    def check(self, where: str = "") -> None:
        """Raise MoEStatusError if a kernel of this group reported a problem (syncs the host); an op
        mismatch at a barrier names the two ops."""
        try:
            check_status(self.status, where)
        except MoEStatusError as e:
            raise MoEStatusError(e.code, where, agreement.barrier_mismatch(self.ctrl, e.code)) from None

    @property
    def dispatch_buffers(self) -> tuple[torch.Tensor, ...]:
        """send_rows, recv_w, recv_primary, recv_next, recv_src (the persistent buffers of dispatch)."""
        return self.send_rows, self.recv_w, self.recv_primary, self.recv_next, self.recv_src

    def alloc_weight_buffers(self) -> None:
        """Allocate the copy slots (bf16 [B, H, F] x2, [B, F, H]) shared by every layer and, when the
        group can train (B = epn), the fp32 gradients of the copies; symmetric on CUDA (collective: every
        rank calls it, as MoEExperts does). A user of the communication ops alone never pays for them,
        and an inference group (B < epn) never pays for gradient buffers. One rank on CUDA makes no
        copies: its pools and reduce buffers are absent ([0, ...]; `layout.copies` is False)."""
        if self._pools is not None:
            return
        c = self.cfg
        if self.layout.symmetric and c.B == 0:
            raise ValueError("EPGroup: EPConfig.B=0 (every copy read remotely) runs on the CPU reference and on "
                             "one rank only; on CUDA with R > 1 use B >= 1 (the slot pools are symmetric buffers, "
                             "which cannot be empty)")
        shapes = weight_buffer_shapes(c, self.layout)
        self._pools = tuple(self._buffer(*shapes[name]) for name in ("pool_gate", "pool_up", "pool_down"))
        if "reduce_gate" in shapes:
            self._reduce = tuple(self._buffer(*shapes[name]) for name in ("reduce_gate", "reduce_up", "reduce_down"))
        if self._cuda:
            self._sync_peers()

    def home_weight(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A home-expert weight tensor that peers can read (collective on CUDA): with B < epn the grouped
        GEMM reads the copies that got no slot straight from their home rank's weights (DESIGN.md,
        "Memory contract"). On CUDA with R > 1 it is symmetric memory; otherwise an ordinary tensor."""
        t = self._buffer(shape, dtype, record=False)
        self._home_weights.append(t)
        if self._cuda:
            self._sync_peers()
        return t

    def _sync_peers(self) -> None:
        """CUDA: this rank's buffer writes are done and every peer got this far. With R = 1 there is no
        peer: no barrier, so a 1-rank group never creates an NCCL communicator for barriers alone
        (the only NCCL work a 1-rank EPGroup had; its ops synchronise through the control block)."""
        torch.cuda.synchronize(self.device)
        if self.cfg.R > 1:
            dist.barrier(group=self.group)

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
        if self._cuda and self.ctrl is not None:
            self._sync_peers()  # no peer still reads or writes our buffers
        for name in ("ctrl", "send_rows", "recv_w", "recv_primary", "recv_next", "recv_src", "presum", "row_scratch"):
            t = getattr(self, name)
            if t is not None:
                registry.remove_buffer(t)
            setattr(self, name, None)
        for t in (self._pools or ()) + (self._reduce or ()) + tuple(self._home_weights):
            registry.remove_buffer(t)
        self._pools = self._reduce = None
        self._home_weights = []
        self._allocated.clear()
        self._handles.clear()
        registry.remove_group(self.key)


def _init_single_rank_world(cfg: EPConfig, group: dist.ProcessGroup | None,
                            device: torch.device | str | None) -> bool:
    """R = 1 without torch.distributed: initialise a 1-rank default group in-process (True if it did).
    The ops then run unchanged (their collectives are over one rank); a larger R needs the caller's group."""
    if dist.is_initialized():
        return False
    if cfg.R != 1 or group is not None:
        raise RuntimeError(f"EPGroup: EPConfig.R={cfg.R} needs torch.distributed initialised first "
                           f"(gloo on CPU, nccl on CUDA); only R=1 initialises its own 1-rank group")
    cuda = device is not None and torch.device(device).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _default_device_dtype(group: dist.ProcessGroup, device: torch.device | str | None,
                          dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """The group's device and compute dtype: given ones checked, missing ones from the backend."""
    if device is None:
        device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"EPGroup: device must be cpu or cuda, got {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"EPGroup: dtype must be a floating torch.dtype, got {dtype!r}")
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"EPGroup: the CUDA kernels compute in torch.bfloat16 only, got dtype={dtype} "
                         f"(fp32 runs on the CPU reference: device='cpu' with a gloo group)")
    return device, dtype


MOONEP_OPS = ("plan", "dispatch", "combine", "gather_row_weights", "group_gemm", "group_gemm_dgrad",
              "group_gemm_dgrad2", "group_gemm_wgrad", "group_gemm_swiglu", "group_gemm_row_scale", "group_gemm_swiglu_bwd",
              "prefetch_weights", "reduce_grad", "dispatch_index", "group_gemm_swiglu_gather", "group_gemm_wgrad_gather",
              "group_gemm_wgrad_gather_b", "group_gemm_swiglu_bwd_gather")


def cuda_kernels_available() -> bool:
    """True once every moonep op has a CUDA implementation registered (the GPU path of the demo)."""
    from . import ops, ops_gathered  # noqa: F401  (define the ops)
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"moonep::{op}", "CUDA") for op in MOONEP_OPS)
