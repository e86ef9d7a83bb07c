"""Host side of the grouped GEMM: validation, compilation (once per static key) and launch.

``group_gemm_fwd`` / ``group_gemm_dgrad`` / ``group_gemm_dgrad2`` / ``group_gemm_wgrad`` /
``group_gemm_row_scale`` / ``group_gemm_swiglu`` / ``group_gemm_swiglu_bwd`` (and, in ``host_gather``, the
four that read an operand's rows by index) validate, compile through ``_compile_cached`` (fake tensors,
symbolic ``N``/``epn``/``B``/``G``, ``--enable-tvm-ffi``, environment stream) and launch on torch's current
stream. ``compile_op`` names every kernel variant by op; ``compile_group_gemm_for_sm90`` compiles one on a
CPU-only machine for CI (see ``compile_check``). The DSL (cutlass) is imported only inside the compile path,
so importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

import torch

from moonep_ops.fake import group_gemm as contracts  # the ops' contracts: the checks their fake kernels run

from ..jit import KernelFamily, compiler, dry_running
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
    tiles_hbm_gbs,
)
# ---------------------------------------------------------------------------------------------------
# Compilation (once per static key)
# ---------------------------------------------------------------------------------------------------

# One TMA descriptor (CUtensorMap): its size and the alignment its global-memory copy needs.
_DESC_BYTES = 128
# every GEMM kernel compiles through the one JIT layer (memory + disk cache, keyed with the target arch;
# the disk entries are invalidated by the package's sources)
_JIT = KernelFamily("group_gemm", ("csrc_cute.group_gemm",))


def _compile_cached(key: tuple, build, config: GroupGemmConfig):
    """``build()`` once per ``key`` and target arch (csrc_cute/jit.py), launched with the tile counter of its
    ``config``'s walk (``_with_tile_counter``)."""
    return _with_tile_counter(_JIT.compiled(key, build), config.dynamic)


# per device: the tile_counter argument of the kernels that walk their tiles statically (never read)
_UNUSED_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _with_tile_counter(fn, dynamic: bool):
    """``fn`` (a compiled kernel) called with its last argument, the tile counter (int32 [1]), added: a
    fresh zero for a kernel of the dynamic walk (csrc_cute/group_gemm/walk.py; the caching allocator keeps a
    launch's counter its own until the launch is done), else one unused tensor per device."""

    def launch(*args):
        device = args[0].device
        if dynamic:
            counter = torch.zeros(1, dtype=torch.int32, device=device)
        else:
            counter = _UNUSED_COUNTERS.get(device)
            if counter is None:
                counter = _UNUSED_COUNTERS[device] = torch.empty(1, dtype=torch.int32, device=device)
        fn(*args, counter)

    return launch


def _fake_sizes():
    """Symbolic (N, epn, B, G): the sizes a compiled kernel takes at run time."""
    import cutlass.cute as cute

    return cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()


def _fake(dtype, shape, align: int = 16, stride_order=None):
    """Fake compact tensor of ``shape`` for ``cute.compile``: contiguous (row-major), or with the dimensions'
    ``stride_order`` (0 the fastest; e.g. (2, 0, 1): the transpose of a contiguous [E, N, M] as (E, M, N))."""
    import cutlass.cute as cute

    if stride_order is None:
        stride_order = tuple(reversed(range(len(shape))))
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=stride_order, assumed_align=align)


def _compile_for_torch(kernel, *fakes):
    """Compile ``kernel`` for the fake arguments; the result takes torch tensors and runs on torch's
    current stream (tvm-ffi environment stream)."""
    import cutlass
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    counter = _fake(cutlass.Int32, (1,), 4)  # every kernel's last tensor: its walk's tile counter
    return cute.compile(kernel, *fakes, counter, stream, options="--enable-tvm-ffi")


@compiler
def _compile_rows_kernel(name: str, red: int, out: int, kd: int, nd: int, b_k_major: bool,
                         config: GroupGemmConfig):
    """Row-grouped kernel ``C [N, out] = A [N, red] @ op(W_g)`` with ``W`` ``[E, kd, nd]``."""
    import cutlass

    def build():
        from .rows import GroupGemmSm90

        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        return _compile_for_torch(
            GroupGemmSm90(config, b_k_major=b_k_major),
            _fake(bf, (n, red)), _fake(bf, (epn, kd, nd)), _fake(bf, (nb, kd, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(bf, (n, out)),
        )

    return _compile_cached((name, int(kd), int(nd), tuple(config)), build, config)


def compile_group_gemm(kd: int, nd: int, config: GroupGemmConfig):
    """Compile (or fetch from the cache) the forward kernel for static (Kd, Nd, tile config, arch).

    Dynamic: N (rows), epn, B, G. The result takes torch tensors (x, w_home, w_slot, cu_seqlens, y)
    and runs on torch's current stream (tvm-ffi environment stream).
    """
    return _compile_rows_kernel("group_gemm_fwd", kd, nd, kd, nd, False, config)


def compile_group_gemm_dgrad(kd: int, nd: int, config: GroupGemmConfig):
    """The dgrad kernel (same class, B K-major): takes (dy [N, Nd], w_home, w_slot, cu_seqlens,
    dx [N, Kd]). ``config.tile_n`` tiles the output columns, Kd."""
    return _compile_rows_kernel("group_gemm_dgrad", nd, kd, kd, nd, True, config)


@compiler
def compile_group_gemm_dgrad2(kd: int, nd: int, config: GroupGemmConfig):
    """The dgrad of two operand pairs into one output: takes (dy_a [N, Nd], wa_home, wa_slot, dy_b [N, Nd],
    wb_home, wb_slot [*, Kd, Nd], cu_seqlens, dx [N, Kd]) and writes ``dy_a @ Wa_g^T + dy_b @ Wb_g^T`` per
    group (one fp32 accumulator). ``config.tile_n`` tiles the output columns, Kd."""
    import cutlass

    def build():
        from .rows import GroupGemmDgrad2Sm90

        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        pair = lambda: (_fake(bf, (n, nd)), _fake(bf, (epn, kd, nd)), _fake(bf, (nb, kd, nd)))  # noqa: E731
        return _compile_for_torch(
            GroupGemmDgrad2Sm90(config), *pair(), *pair(), _fake(cutlass.Int32, (ng,), 4), _fake(bf, (n, kd)),
        )

    return _compile_cached(("group_gemm_dgrad2", int(kd), int(nd), tuple(config)), build, config)


@compiler
def compile_group_gemm_wgrad(kd: int, nd: int, config: GroupGemmConfig):
    """The varlen-K wgrad kernel: takes (x [N, Kd], dy [N, Nd], cu_seqlens, dw_home bf16, dw_slot fp32),
    writes ``x_g^T dy_g`` into the home groups' ``dw_home[g]`` (bf16) and adds it into the slot groups'
    ``dw_slot[g - epn]`` (fp32). ``config.tile_m`` tiles Kd, ``config.tile_n`` tiles Nd."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        from .wgrad import GroupGemmWgradSm90

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        return _compile_for_torch(
            GroupGemmWgradSm90(config),
            _fake(bf, (n, kd)), _fake(bf, (n, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(bf, (epn, kd, nd)), _fake(f32, (nb, kd, nd)),
        )

    return _compile_cached(("group_gemm_wgrad", int(kd), int(nd), tuple(config)), build, config)


@compiler
def compile_group_gemm_wgrad_gather(kd: int, nd: int, config: GroupGemmConfig, dw_m_major: bool = False):
    """The varlen-K wgrad kernel with a gathered A operand: takes (x [S, Kd], row_src [N] int32, dy [N, Nd],
    cu_seqlens, dw_home bf16, dw_slot fp32) and computes what ``compile_group_gemm_wgrad``'s kernel does
    for ``rows = where(row_src >= 0, x[row_src], 0)``; S and N are independent sizes. ``dw_m_major``: dw_home
    and dw_slot are [*, Kd, Nd] views with Kd contiguous (the transposes of [*, Nd, Kd] tensors)."""
    import cutlass
    import cutlass.cute as cute

    def build():
        n, epn, nb, ng = _fake_sizes()
        s = cute.sym_int()
        from .wgrad import GroupGemmWgradGatherSm90

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        dw_order = (2, 0, 1) if dw_m_major else None  # Kd contiguous, then Nd, then the groups
        return _compile_for_torch(
            GroupGemmWgradGatherSm90(config, dw_m_major),
            _fake(bf, (s, kd)), _fake(cutlass.Int32, (n,), 4), _fake(bf, (n, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(bf, (epn, kd, nd), stride_order=dw_order), _fake(f32, (nb, kd, nd), stride_order=dw_order),
        )

    key = ("group_gemm_wgrad_gather", int(kd), int(nd), tuple(config)) + (("dw_m_major",) if dw_m_major else ())
    return _compile_cached(key, build, config)


def _fake_remote(num_peer_arrays: int):
    """Fakes of the remote arguments: remote_experts (n_remote,) int32, ``num_peer_arrays`` x peers (R,)
    int64 and the descriptor workspace (int64, 128-byte aligned), all of symbolic length."""
    import cutlass
    import cutlass.cute as cute

    n_remote, num_ranks, ws = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return (_fake(cutlass.Int32, (n_remote,), 4), *(_fake(cutlass.Int64, (num_ranks,), 8)
                                                      for _ in range(num_peer_arrays)),
            _fake(cutlass.Int64, (ws,), _DESC_BYTES))


@compiler
def compile_group_gemm_swiglu(hd: int, f: int, config: GroupGemmConfig, store_preact: bool = True,
                              remote: bool = False):
    """The fused gate/up + SwiGLU kernel: takes (x [N, H], w_gate_home, w_gate_slot, w_up_home, w_up_slot
    [*, H, F], cu_seqlens, h [N, F], gate [N, F], up [N, F]); gate/up are written only with
    ``store_preact`` (otherwise pass any bf16 [N, F] tensor, e.g. h: it is never written). ``remote``:
    the variant with remote groups, which also takes (remote_experts [n_remote] int32, gate_peers [R]
    int64, up_peers [R] int64, descriptor workspace int64 [2 * 16 * num_sms]) after ``up``."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        from .swiglu import GroupGemmSwigluRemoteSm90, GroupGemmSwigluSm90

        cls = GroupGemmSwigluRemoteSm90 if remote else GroupGemmSwigluSm90
        return _compile_for_torch(
            cls(config, store_preact=store_preact),
            _fake(bf, (n, hd)), _fake(bf, (epn, hd, f)), _fake(bf, (nb, hd, f)), _fake(bf, (epn, hd, f)),
            _fake(bf, (nb, hd, f)), _fake(cutlass.Int32, (ng,), 4), _fake(bf, (n, f)), _fake(bf, (n, f)),
            _fake(bf, (n, f)), *(_fake_remote(2) if remote else ()),
        )

    name = "group_gemm_swiglu_remote" if remote else "group_gemm_swiglu"
    return _compile_cached((name, bool(store_preact), int(hd), int(f), tuple(config)), build, config)


@compiler
def compile_group_gemm_swiglu_gather(hd: int, f: int, config: GroupGemmConfig, store_preact: bool = True):
    """The fused gate/up + SwiGLU kernel with a gathered A operand: takes (x [S, H], row_src [N] int32,
    w_gate_home, w_gate_slot, w_up_home, w_up_slot [*, H, F], cu_seqlens, h [N, F], gate [N, F], up [N, F])
    and computes what ``compile_group_gemm_swiglu``'s kernel does for ``rows = where(row_src >= 0,
    x[row_src], 0)``; S and N are independent sizes."""
    import cutlass
    import cutlass.cute as cute

    def build():
        n, epn, nb, ng = _fake_sizes()
        s = cute.sym_int()
        bf = cutlass.BFloat16
        from .swiglu import GroupGemmSwigluGatherSm90

        return _compile_for_torch(
            GroupGemmSwigluGatherSm90(config, store_preact=store_preact),
            _fake(bf, (s, hd)), _fake(cutlass.Int32, (n,), 4), _fake(bf, (epn, hd, f)), _fake(bf, (nb, hd, f)),
            _fake(bf, (epn, hd, f)), _fake(bf, (nb, hd, f)), _fake(cutlass.Int32, (ng,), 4), _fake(bf, (n, f)),
            _fake(bf, (n, f)), _fake(bf, (n, f)),
        )

    key = ("group_gemm_swiglu_gather", bool(store_preact), int(hd), int(f), tuple(config))
    return _compile_cached(key, build, config)


@compiler
def compile_group_gemm_row_scale(kd: int, nd: int, config: GroupGemmConfig, remote: bool = False):
    """Forward with the per-row scale epilogue: takes (x [N, Kd], w_home, w_slot, cu_seqlens,
    row_w [N] fp32, y [N, Nd]). ``remote``: the variant with remote groups, which also takes
    (remote_experts [n_remote] int32, peers [R] int64, descriptor workspace int64 [16 * num_sms]) after
    ``y``."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        from .rows import GroupGemmRowScaleRemoteSm90, GroupGemmRowScaleSm90

        bf = cutlass.BFloat16
        cls = GroupGemmRowScaleRemoteSm90 if remote else GroupGemmRowScaleSm90
        return _compile_for_torch(
            cls(config),
            _fake(bf, (n, kd)), _fake(bf, (epn, kd, nd)), _fake(bf, (nb, kd, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(cutlass.Float32, (n,), 4), _fake(bf, (n, nd)), *(_fake_remote(1) if remote else ()),
        )

    name = "group_gemm_row_scale_remote" if remote else "group_gemm_row_scale"
    return _compile_cached((name, int(kd), int(nd), tuple(config)), build, config)


@compiler
def compile_group_gemm_swiglu_bwd(hd: int, f: int, config: GroupGemmConfig, epilogue: str = "registers"):
    """The down-projection dgrad with the SwiGLU backward epilogue: takes (g_y [N, H], w_down_home
    [epn, F, H], w_down_slot [B, F, H], cu_seqlens, row_w [N] fp32, gate [N, F], up [N, F], g_gate [N, F],
    g_up [N, F], h_w [N, F], part [N, ceil(F / tile_n)] fp32). ``epilogue``: "registers" (gate/up and the
    outputs between global memory and the accumulator fragment) or "smem" (through shared memory by TMA;
    bitwise the same results)."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf, f32 = cutlass.BFloat16, cutlass.Float32
        n_tiles = (f + config.tile_n - 1) // config.tile_n
        from .swiglu_bwd import GroupGemmSwigluBwdSm90

        return _compile_for_torch(
            GroupGemmSwigluBwdSm90(config, epilogue),
            _fake(bf, (n, hd)), _fake(bf, (epn, f, hd)), _fake(bf, (nb, f, hd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(f32, (n,), 4), *(_fake(bf, (n, f)) for _ in range(5)), _fake(f32, (n, n_tiles), 4),
        )

    return _compile_cached(("group_gemm_swiglu_bwd", int(hd), int(f), tuple(config), epilogue), build, config)


@compiler
def compile_group_gemm_swiglu_bwd_gather(hd: int, f: int, config: GroupGemmConfig):
    """The SwiGLU-backward dgrad (shared-memory epilogue) with a gathered A operand: takes (g_out [S, H],
    row_src [N] int32, then ``compile_group_gemm_swiglu_bwd``'s arguments after g_y) and computes what that
    kernel does for ``g_y = where(row_src >= 0, g_out[row_src], 0)``; S and N are independent sizes."""
    import cutlass
    import cutlass.cute as cute

    def build():
        n, epn, nb, ng = _fake_sizes()
        s = cute.sym_int()
        bf, f32 = cutlass.BFloat16, cutlass.Float32
        n_tiles = (f + config.tile_n - 1) // config.tile_n
        from .swiglu_bwd import GroupGemmSwigluBwdGatherSm90

        return _compile_for_torch(
            GroupGemmSwigluBwdGatherSm90(config),
            _fake(bf, (s, hd)), _fake(cutlass.Int32, (n,), 4), _fake(bf, (epn, f, hd)), _fake(bf, (nb, f, hd)),
            _fake(cutlass.Int32, (ng,), 4), _fake(f32, (n,), 4), *(_fake(bf, (n, f)) for _ in range(5)),
            _fake(f32, (n, n_tiles), 4),
        )

    return _compile_cached(("group_gemm_swiglu_bwd_gather", int(hd), int(f), tuple(config)), build, config)


# ---------------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------------


def _check_kernel_args(op: str, contract, pad: int, bf16, home: str, aligned=(), remote=None,
                       peer_names=("peers",)) -> dict[str, int]:
    """The CUDA-only validation of a kernel launch, wrapped around the op's contract; errors name the op
    (``moonep.<op>``), the argument and the rule.

    ``bf16``: (name, tensor) of the row and weight operands, which the kernels read as bfloat16 (checked
    first, so that a float32 input is named itself rather than as a dtype mismatch of the others; the first
    names the device). ``contract(experts_remote)``: the op's contract (moonep_ops/fake/group_gemm.py, the check its
    fake kernel runs: dtypes, shapes, devices, contiguity, P a power of two), returning (the kernel's static
    sizes by name, epn). Then what only the kernels need: P >= 64 (the smallest M tile lies inside one
    group), sizes that are positive multiples of 8 (16-byte TMA strides), at least one home expert
    (``home`` names its weights: the home map stands in for an empty slot map), a CUDA device, 16-byte
    aligned TMA operands (``bf16`` and ``aligned``) and, with ``remote`` = (experts_remote, *peers) naming
    at least one remote group, the remote groups' peer tables (``peer_names``; with an empty experts_remote
    there are no remote groups and the peers are not read). Returns the sizes."""
    for name, t in bf16:
        if isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16:
            raise ValueError(f"moonep.{op}: {name} must be bfloat16 for the CuTe kernel, got {t.dtype}")
    names = ("experts_remote",) + tuple(peer_names)
    if remote is not None and (not isinstance(remote, tuple) or len(remote) != len(names)):
        raise ValueError(f"moonep.{op}: remote must be None or a tuple ({', '.join(names)}), got "
                         f"{type(remote).__name__}" + (f" of length {len(remote)}" if isinstance(remote, tuple) else ""))
    sizes, epn = contract(None if remote is None else remote[0])
    if pad < 64:
        raise ValueError(f"moonep.{op}: P must be >= 64 for the CuTe kernel (its smallest M tile, 64 rows, must "
                         f"lie inside one group), got P={pad}")
    for name, v in sizes.items():
        if v < 8 or v % 8:
            raise ValueError(f"moonep.{op}: {name} must be a positive multiple of 8 for the CuTe kernel (16-byte "
                             f"TMA strides), got {name}={v}")
    if epn < 1:
        raise ValueError(f"moonep.{op}: {home} must hold at least one expert (epn >= 1) for the CuTe kernel, "
                         f"got epn={epn}")
    x_name, x = bf16[0]
    if _has_remote(remote):
        _check_peers(op, remote, peer_names, x.device)
    if x.device.type != "cuda":
        raise ValueError(f"moonep.{op}: {x_name} must be a CUDA tensor for the CuTe kernel, got device {x.device}")
    for name, t in tuple(bf16) + tuple(aligned):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"moonep.{op}: {name} must be 16-byte aligned for the CuTe kernel (TMA)")
    return sizes


def _has_remote(remote) -> bool:
    """Whether a (checked) ``remote`` names remote groups: not None, with a non-empty experts_remote."""
    return remote is not None and remote[0].shape[0] > 0


def _check_peers(op: str, remote, peer_names, device: torch.device) -> None:
    """The kernels' remote operands beyond the contract's experts_remote: per B ring an int64 [R >= 1]
    table of the home weights' device addresses (one length for all), on ``device``. The values live on
    the device and are not checked (no host sync): see the preconditions in ``group_gemm_row_scale``."""
    for name, t in zip(peer_names, remote[1:]):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moonep.{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise ValueError(f"moonep.{op}: {name} must be int64 (device addresses), got {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"moonep.{op}: {name} must be 1-D holding at least one rank's address (R >= 1), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"moonep.{op}: {name} must be contiguous")
        if t.device != device:
            raise ValueError(f"moonep.{op}: {name} must be on {device} like the other inputs, got {t.device}")
    if any(t.shape != remote[1].shape for t in remote[2:]):
        raise ValueError(f"moonep.{op}: {', '.join(peer_names)} must have the same length (one address per rank), "
                         f"got {', '.join(str(tuple(t.shape)) for t in remote[1:])}")


def _weights_contract(check, op_args, w_home, names=("Kd", "Nd")):
    """A row kernel's contract: ``check(*op_args[, experts_remote])`` (moonep_ops/fake/group_gemm.py), then the two inner
    sizes of the (checked) weights [epn, *, *] under ``names``, and epn."""

    def contract(experts_remote):
        check(*op_args, *(() if experts_remote is None else (experts_remote,)))
        epn, rows, cols = w_home.shape
        return dict(zip(names, (rows, cols))), epn

    return contract


def _desc_workspace(device: torch.device, num_rings: int) -> torch.Tensor:
    """Per launch of a kernel with remote groups: one 128-byte descriptor slot per CTA (at most #SMs)
    and B ring, 128-byte aligned (the caching allocator's blocks are 512-byte aligned)."""
    ws = torch.empty(num_rings * _device_info(device)[1] * (_DESC_BYTES // 8), dtype=torch.int64, device=device)
    assert ws.data_ptr() % _DESC_BYTES == 0
    return ws


_DEVICE_INFO: dict[int, tuple[tuple[int, int], int, float | None]] = {}
# (op, Kd, Nd, P, device index) -> compiled kernel: skips the config/key work on the hot path.
_LAUNCH_CACHE: dict[tuple, Any] = {}


def hbm_gbs_of(props) -> float | None:
    """Peak HBM bandwidth (GB/s) of a device from its properties (memory clock in kHz, double data rate, bus
    width in bits), or None where torch does not report them."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def _device_info(device: torch.device) -> tuple[tuple[int, int], int, float | None]:
    """(compute capability, SMs, peak HBM GB/s or None: the tiles are chosen for ``$MOONEP_HBM_GBS`` where set,
    ``config.tiles_hbm_gbs``) of ``device``, read once a process."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(idx)
    if info is None:
        props = torch.cuda.get_device_properties(idx)
        info = _DEVICE_INFO[idx] = ((props.major, props.minor), props.multi_processor_count,
                                     tiles_hbm_gbs(hbm_gbs_of(props)))
    return info


def compile_op(op: str, kd: int, nd: int, pad: int, num_sms: int, config: GroupGemmConfig | None = None,
               hbm_gbs: float | None = None):
    """The kernel of ``op`` ("fwd", "dgrad", "dgrad2", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd", "swiglu_bwd_smem" (its shared-memory epilogue); "row_scale_remote", "swiglu_remote",
    "swiglu_h_only_remote": with remote groups; "swiglu_gather", "swiglu_gather_h_only", "wgrad_gather",
    "swiglu_bwd_gather": A rows gathered by index; "wgrad_gather_t": "wgrad_gather" into Kd-contiguous
    gradients, the transposes of [*, Nd, Kd], the down projection's wgrad) for static
    (Kd, Nd) (H, F for the SwiGLU ops), padding P and ``num_sms``. ``config`` (forward, dgrad, dgrad2,
    wgrad and its gathered variants, row scale, fused SwiGLU and its gathered variant, SwiGLU backward):
    this tile configuration instead of the op's own choice (config.py), e.g. another tile, raster or
    cluster shape (benchmarks/bench_tiles.py, their tests). ``hbm_gbs``: the device's peak HBM bandwidth (GB/s,
    None: unknown), which picks the tiles of the wgrads, the dgrad, the dgrad2, the row scale and the SwiGLU
    backward's shared-memory and gathered kernels (``select_wgrad_config``, ``select_dgrad_config``,
    ``select_hbm_rows_config``, ``select_swiglu_bwd_config``)."""
    if config is not None:
        return _compile_with_config(op, kd, nd, config)
    if op == "fwd":
        return compile_group_gemm(kd, nd, select_config(pad, nd, num_sms))
    if op == "dgrad":
        return compile_group_gemm_dgrad(kd, nd, select_dgrad_config(pad, kd, num_sms, hbm_gbs))
    if op == "dgrad2":
        return compile_group_gemm_dgrad2(kd, nd, select_hbm_rows_config(pad, kd, num_sms, hbm_gbs))
    if op == "wgrad":
        return compile_group_gemm_wgrad(kd, nd, select_wgrad_config(pad, kd, nd, num_sms, hbm_gbs))
    if op == "wgrad_gather":
        return compile_group_gemm_wgrad_gather(kd, nd, select_wgrad_config(pad, kd, nd, num_sms, hbm_gbs))
    if op == "wgrad_gather_t":
        return compile_group_gemm_wgrad_gather(kd, nd, select_wgrad_config(pad, kd, nd, num_sms, hbm_gbs),
                                               dw_m_major=True)
    if op in ("row_scale", "row_scale_remote"):
        remote = op == "row_scale_remote"  # the remote variant keeps the cooperative tile (pingpong untested)
        config = select_config(pad, nd, num_sms) if remote else select_hbm_rows_config(pad, nd, num_sms, hbm_gbs)
        return compile_group_gemm_row_scale(kd, nd, config, remote)
    if op in ("swiglu", "swiglu_h_only", "swiglu_remote", "swiglu_h_only_remote"):
        return compile_group_gemm_swiglu(kd, nd, select_swiglu_config(pad, nd, num_sms),
                                         op in ("swiglu", "swiglu_remote"), op.endswith("_remote"))
    if op in ("swiglu_gather", "swiglu_gather_h_only"):
        return compile_group_gemm_swiglu_gather(kd, nd, select_swiglu_config(pad, nd, num_sms), op == "swiglu_gather")
    if op in ("swiglu_bwd", "swiglu_bwd_smem"):
        return compile_group_gemm_swiglu_bwd(kd, nd, swiglu_bwd_op_config(op, pad, nd, num_sms, hbm_gbs),
                                             "smem" if op == "swiglu_bwd_smem" else "registers")
    if op == "swiglu_bwd_gather":
        return compile_group_gemm_swiglu_bwd_gather(kd, nd, swiglu_bwd_op_config(op, pad, nd, num_sms, hbm_gbs))
    raise ValueError(f"unknown op {op!r}")


def swiglu_bwd_op_config(op: str, pad: int, f: int, num_sms: int, hbm_gbs: float | None) -> GroupGemmConfig:
    """The tile of a SwiGLU-backward op: ``select_swiglu_bwd_config``'s; the register epilogue ("swiglu_bwd") keeps
    the tile it has on every device (its batches were not sized for 192 columns)."""
    return select_swiglu_bwd_config(pad, f, num_sms, None if op == "swiglu_bwd" else hbm_gbs)


_CONFIGURABLE = dict(fwd=compile_group_gemm, dgrad=compile_group_gemm_dgrad, dgrad2=compile_group_gemm_dgrad2,
                     wgrad=compile_group_gemm_wgrad, swiglu=compile_group_gemm_swiglu,
                     swiglu_gather=compile_group_gemm_swiglu_gather,
                     row_scale=lambda kd, nd, config: compile_group_gemm_row_scale(kd, nd, config),
                     wgrad_gather=compile_group_gemm_wgrad_gather,
                     wgrad_gather_t=lambda kd, nd, config: compile_group_gemm_wgrad_gather(kd, nd, config, True),
                     swiglu_bwd_smem=lambda kd, nd, config: compile_group_gemm_swiglu_bwd(kd, nd, config, "smem"),
                     swiglu_bwd_gather=compile_group_gemm_swiglu_bwd_gather)


def _compile_with_config(op: str, kd: int, nd: int, config: GroupGemmConfig):
    if op not in _CONFIGURABLE:
        raise ValueError(f"compile_op: a config is taken by {sorted(_CONFIGURABLE)}, not {op!r}")
    return _CONFIGURABLE[op](kd, nd, GroupGemmConfig(*config))


def _launcher(op: str, kd: int, nd: int, pad: int, device: torch.device):
    fast_key = (op, kd, nd, pad, device.index)
    fn = _LAUNCH_CACHE.get(fast_key)
    if fn is None or dry_running():
        cc, num_sms, hbm_gbs = _device_info(device)
        if cc != (9, 0):
            raise ValueError(
                f"tensors must be on a Hopper (sm_90) GPU, got compute capability {cc[0]}.{cc[1]}"
            )
        fn = compile_op(op, kd, nd, pad, num_sms, hbm_gbs=hbm_gbs)
        if not dry_running():  # a dry run's stand-in launches nothing: it must not outlive the dry run
            _LAUNCH_CACHE[fast_key] = fn
    return fn


def _out_tensor(op: str, name: str, out, n, cols, device):
    """A fresh bf16 [n, cols] output, or the caller's ``out`` after checking it can take the TMA stores."""
    if out is None:
        return torch.empty(n, cols, dtype=torch.bfloat16, device=device)
    if (not isinstance(out, torch.Tensor) or out.shape != (n, cols) or out.dtype != torch.bfloat16
            or not out.is_contiguous() or out.device != device or (out.numel() and out.data_ptr() % 16)):
        raise ValueError(f"moonep.{op}: {name} must be a contiguous, 16-byte aligned bf16 [{n}, {cols}] tensor "
                         f"on {device}")
    return out


def _slot_map(w_slot: torch.Tensor, w_home: torch.Tensor) -> torch.Tensor:
    """``w_slot``, or ``w_home`` in its place when B == 0: a zero-sized tensor map cannot be encoded,
    and with no slot groups no tile ever reads (or writes) the slot map."""
    return w_home if w_slot.shape[0] == 0 else w_slot


def _rows_gemm(kernel: str, a, w_home, w_slot, cu_seqlens, pad: int, out):
    """Forward (``kernel`` "fwd": ``y = x @ W_g``) or dgrad ("dgrad": ``dx = dy @ W_g^T``) per group."""
    op, a_name, check = (("group_gemm", "x", contracts.check_group_gemm_args) if kernel == "fwd"
                         else ("group_gemm_dgrad", "dy", contracts.check_dgrad_args))
    sizes = _check_kernel_args(op, _weights_contract(check, (a, w_home, w_slot, cu_seqlens, pad), w_home), pad,
                               ((a_name, a), ("w_home", w_home), ("w_slot", w_slot)), "w_home")
    kd, nd = sizes["Kd"], sizes["Nd"]
    fn = _launcher(kernel, kd, nd, pad, a.device)
    c = _out_tensor(op, "out", out, a.shape[0], nd if kernel == "fwd" else kd, a.device)
    if a.shape[0]:
        fn(a, w_home, _slot_map(w_slot, w_home), cu_seqlens, c)
    return c


def group_gemm_fwd(
    x: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[N, Nd] = group_gemm(x, w_home, w_slot, cu_seqlens)`` on the GPU (no host sync).

    ``pad`` is P, the multiple every group length has (a power of two >= 64 for this kernel).
    """
    return _rows_gemm("fwd", x, w_home, w_slot, cu_seqlens, pad, out)


def group_gemm_dgrad(
    dy: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx[N, Kd]``: ``dx[rows of g] = dy[rows of g] @ W_g^T``, rows past the last group zero (no host
    sync). ``pad`` is P (a power of two >= 64)."""
    return _rows_gemm("dgrad", dy, w_home, w_slot, cu_seqlens, pad, out)


def group_gemm_dgrad2(
    dy_a: torch.Tensor,
    w_a_home: torch.Tensor,
    w_a_slot: torch.Tensor,
    dy_b: torch.Tensor,
    w_b_home: torch.Tensor,
    w_b_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx[N, Kd]``: ``dx[rows of g] = dy_a[rows of g] @ Wa_g^T + dy_b[rows of g] @ Wb_g^T`` in one kernel
    (one fp32 accumulator over both products, one bf16 rounding, one store), rows past the last group
    zero; both weight pairs ``[epn, Kd, Nd]`` / ``[B, Kd, Nd]``, e.g. the input gradient of the gate and up
    projections. No host sync. ``pad`` is P (a power of two >= 64)."""
    op = "group_gemm_dgrad2"
    args = (dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, pad)
    sizes = _check_kernel_args(
        op, _weights_contract(contracts.check_dgrad2_args, args, w_a_home), pad,
        (("dy_a", dy_a), ("w_a_home", w_a_home), ("w_a_slot", w_a_slot), ("dy_b", dy_b), ("w_b_home", w_b_home),
         ("w_b_slot", w_b_slot)), "w_a_home",
    )
    kd, nd = sizes["Kd"], sizes["Nd"]
    fn = _launcher("dgrad2", kd, nd, pad, dy_a.device)
    dx = _out_tensor(op, "out", out, dy_a.shape[0], kd, dy_a.device)
    if dy_a.shape[0]:
        fn(dy_a, w_a_home, _slot_map(w_a_slot, w_a_home), dy_b, w_b_home, _slot_map(w_b_slot, w_b_home), cu_seqlens,
           dx)
    return dx


def group_gemm_row_scale(
    x: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_w: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
    remote: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y[r] = (x[r] @ W_g) * row_w[r]``: the forward with a per-row fp32 scale applied to the fp32
    accumulators before the bf16 convert (the route weights of the down projection). Rows past the last
    group are zero. ``row_w`` is fp32 ``[N]``. No host sync.

    ``remote`` (inference): None, or ``(experts_remote, peers)``: then the last ``n_remote`` groups are
    remote groups, whose weights are read straight from their home rank (peer-mapped), and
    ``cu_seqlens`` has ``G = epn + B + n_remote`` entries (``n_remote = 0``: no remote groups, ``peers``
    not read: the op's empty experts_remote). ``experts_remote`` int32 ``[n_remote]``
    (CUDA) holds the remote groups' global expert ids (ascending, -1 = an unused group); ``peers`` int64
    ``[R]`` (CUDA) holds ``peers[r]`` = the device address (valid on this GPU, e.g. torch symmetric memory)
    of rank r's home weights, a contiguous bf16 ``[epn, Kd, Nd]`` tensor like ``w_home``. Remote group j
    multiplies by ``W = (rank e // epn's home weights)[e % epn]``, ``e = experts_remote[j]``.
    Preconditions (on the device values, not checked: no host sync): every remote expert of a launch
    comes from one donor rank (each CTA builds its remote descriptor once, at its first remote tile: a
    different donor would need a new descriptor while loads that use the old one are in flight, i.e. the
    ring drained first; the kernel would read the first donor's weights instead), ``0 <= e < R * epn``
    for every used group, an unused group (-1) is empty, and every peer
    address is 16-byte aligned."""
    op = "group_gemm_row_scale"
    sizes = _check_kernel_args(
        op, _weights_contract(contracts.check_row_scale_args, (x, w_home, w_slot, cu_seqlens, row_w, pad), w_home),
        pad, (("x", x), ("w_home", w_home), ("w_slot", w_slot)), "w_home", remote=remote,
    )
    kd, nd = sizes["Kd"], sizes["Nd"]
    remote = remote if _has_remote(remote) else None
    fn = _launcher("row_scale" if remote is None else "row_scale_remote", kd, nd, pad, x.device)
    y = _out_tensor(op, "out", out, x.shape[0], nd, x.device)
    if x.shape[0]:
        if remote is None:
            fn(x, w_home, _slot_map(w_slot, w_home), cu_seqlens, row_w, y)
        else:
            fn(x, w_home, _slot_map(w_slot, w_home), cu_seqlens, row_w, y, *remote, _desc_workspace(x.device, 1))
    return y


def group_gemm_swiglu(
    x: torch.Tensor,
    w_gate_home: torch.Tensor,
    w_gate_slot: torch.Tensor,
    w_up_home: torch.Tensor,
    w_up_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    store_preact: bool = True,
    out: torch.Tensor | None = None,
    gate_out: torch.Tensor | None = None,
    up_out: torch.Tensor | None = None,
    remote: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused gate/up projection with a SwiGLU epilogue, one kernel: per group g,
    ``gate = x_g @ Wgate_g``, ``up = x_g @ Wup_g`` (fp32 accumulators, never rounded before the
    activation) and ``h = silu(gate) * up`` in fp32, stored bf16. Returns ``(h, gate, up)``: gate and up
    are the bf16 pre-activations (what backward needs) when ``store_preact``, else None (inference).
    Weights ``[epn, H, F]`` home and ``[B, H, F]`` slot, as in ``group_gemm_fwd``. No host sync.

    ``remote`` (inference): None, or ``(experts_remote, gate_peers, up_peers)``: the last ``n_remote``
    groups are remote groups, read from their home rank's gate and up weights (``gate_peers[r]``,
    ``up_peers[r]``: addresses of rank r's ``[epn, H, F]`` home weights, like ``w_gate_home`` /
    ``w_up_home``), with ``G = epn + B + n_remote``; as in ``group_gemm_row_scale``, preconditions
    included (one donor rank per launch)."""
    op = "group_gemm_swiglu"
    weights = (w_gate_home, w_gate_slot, w_up_home, w_up_slot)
    sizes = _check_kernel_args(
        op, _weights_contract(contracts.check_swiglu_args, (x, *weights, cu_seqlens, pad), w_gate_home, ("H", "F")),
        pad,
        (("x", x), ("w_gate_home", w_gate_home), ("w_gate_slot", w_gate_slot), ("w_up_home", w_up_home),
         ("w_up_slot", w_up_slot)), "w_gate_home", remote=remote, peer_names=("gate_peers", "up_peers"),
    )
    hd, f, n = sizes["H"], sizes["F"], x.shape[0]
    remote = remote if _has_remote(remote) else None
    kernel = "swiglu" if store_preact else "swiglu_h_only"
    fn = _launcher(kernel if remote is None else kernel + "_remote", hd, f, pad, x.device)
    h = _out_tensor(op, "out", out, n, f, x.device)
    gate = _out_tensor(op, "gate_out", gate_out, n, f, x.device) if store_preact else None
    up = _out_tensor(op, "up_out", up_out, n, f, x.device) if store_preact else None
    if n:
        args = (x, w_gate_home, _slot_map(w_gate_slot, w_gate_home), w_up_home, _slot_map(w_up_slot, w_up_home),
                cu_seqlens, h, gate if store_preact else h, up if store_preact else h)
        if remote is None:
            fn(*args)
        else:
            fn(*args, *remote, _desc_workspace(x.device, 2))
    return h, gate, up


def group_gemm_swiglu_bwd(
    g_y: torch.Tensor,
    w_down_home: torch.Tensor,
    w_down_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_w: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    pad: int = 128,
    epilogue: str = "smem",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``y = group_gemm_row_scale(swiglu(gate, up), W_down, row_w)`` up to the gate/up
    pre-activations, one kernel: ``d = g_y @ W_down_g^T`` (fp32) and, in its epilogue, from the saved bf16
    ``gate``/``up`` and ``row_w``: ``g_gate``, ``g_up`` (bf16, the gate/up projections' output gradients),
    ``h_w = row_w * silu(gate) * up`` (bf16, the down projection's wgrad operand: ``dW_down_g += h_w_g^T
    g_y_g``) and ``g_row_w[r] = sum_f d[r, f] * h[r, f]`` (fp32 [N], the route weights' gradient; per
    128-column tile partial sums, added here in a fixed order). Weights ``[epn, F, H]`` / ``[B, F, H]``.
    ``epilogue``: "smem" (the default: gate/up and the outputs through shared memory by TMA, 14% faster
    on the H200) or "registers" (between global memory and the accumulator fragment; bitwise the same
    results, kept as the check of the first). No host sync."""
    op = "group_gemm_swiglu_bwd"
    if epilogue not in ("registers", "smem"):
        raise ValueError(f"moonep.{op}: epilogue must be 'registers' or 'smem', got {epilogue!r}")
    sizes = _check_kernel_args(
        op, _weights_contract(contracts.check_swiglu_bwd_args,
                              (g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, pad), w_down_home,
                              ("F", "H")), pad,
        (("g_y", g_y), ("w_down_home", w_down_home), ("w_down_slot", w_down_slot), ("gate", gate), ("up", up)),
        "w_down_home", aligned=(("row_w", row_w),),
    )
    return _launch_swiglu_bwd("swiglu_bwd" if epilogue == "registers" else "swiglu_bwd_smem", sizes, pad, (g_y,),
                              w_down_home, w_down_slot, cu_seqlens, row_w, gate, up)


def _launch_swiglu_bwd(op: str, sizes: dict[str, int], pad: int, a_operands, w_down_home, w_down_slot, cu_seqlens,
                       row_w, gate, up) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the (checked) SwiGLU-backward kernel of ``op`` ("swiglu_bwd", "swiglu_bwd_smem",
    "swiglu_bwd_gather") on its A operand(s) and the rest: (g_gate, g_up, h_w, g_row_w) of gate's N rows."""
    f, hd, n = sizes["F"], sizes["H"], gate.shape[0]
    dev = gate.device
    fn = _launcher(op, hd, f, pad, dev)
    _, num_sms, hbm_gbs = _device_info(dev)
    tile_n = swiglu_bwd_op_config(op, pad, f, num_sms, hbm_gbs).tile_n  # the kernel's: part has a column per n tile
    g_gate, g_up, h_w = (torch.empty(n, f, dtype=torch.bfloat16, device=dev) for _ in range(3))
    part = torch.empty(n, (f + tile_n - 1) // tile_n, dtype=torch.float32, device=dev)
    if n:
        fn(*a_operands, w_down_home, _slot_map(w_down_slot, w_down_home), cu_seqlens, row_w, gate, up, g_gate, g_up,
           h_w, part)
    return g_gate, g_up, h_w, part.sum(1)


def group_gemm_wgrad(
    x: torch.Tensor,
    dy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dw_home: torch.Tensor,
    dw_slot: torch.Tensor,
    pad: int = 128,
) -> None:
    """Home groups: ``dw_home[g] = x[rows of g]^T @ dy[rows of g]``, *written* in bf16 (fp32
    accumulation, one rounding; a home group with no rows gets zeros: every element of ``dw_home``
    ``[epn, Kd, Nd]`` is written). Slot groups: ``dw_slot[j] += x[rows of g]^T @ dy[rows of g]`` in fp32,
    in place (``dw_slot`` ``[B, Kd, Nd]``, the copies' reduce buffers); empty slot groups are not
    touched. No host sync. ``pad`` is P (a power of two >= 64)."""
    def contract(_):
        contracts.check_wgrad_args(x, dy, cu_seqlens, dw_home, dw_slot, pad)
        return {"Kd": x.shape[1], "Nd": dy.shape[1]}, dw_home.shape[0]

    sizes = _check_kernel_args("group_gemm_wgrad", contract, pad, (("x", x), ("dy", dy), ("dw_home", dw_home)),
                               "dw_home", aligned=(("dw_slot", dw_slot),))
    _launch_wgrad("wgrad", sizes, pad, (x, dy), x.shape[0], cu_seqlens, dw_home, dw_slot)


def _launch_wgrad(op: str, sizes: dict[str, int], pad: int, operands, n: int, cu_seqlens, dw_home, dw_slot) -> None:
    """Launch the (checked) wgrad kernel of ``op`` ("wgrad", "wgrad_gather";
    "wgrad_gather_t": into the transposes of ``dw_home`` and ``dw_slot``, ``sizes`` its (Kd, Nd)) on its
    ``operands`` (its arguments before cu_seqlens) and the rest; with no rows (N = ``n`` = 0) every group is
    empty: the home gradients are zeroed, nothing is launched."""
    fn = _launcher(op, sizes["Kd"], sizes["Nd"], pad, dw_home.device)
    if n == 0:
        dw_home.zero_()
        return
    dw_slot = dw_slot if dw_slot.shape[0] else _no_slots_f32(dw_home)
    if op == "wgrad_gather_t":
        dw_home, dw_slot = dw_home.transpose(1, 2), dw_slot.transpose(1, 2)
    fn(*operands, cu_seqlens, dw_home, dw_slot)


def _no_slots_f32(dw_home: torch.Tensor) -> torch.Tensor:
    """The wgrad kernel's fp32 slot argument when B == 0: an empty ``[0, Kd, Nd]`` fp32 view at
    ``dw_home``'s (valid, 16-byte aligned) address. No work item touches it: there are no slot groups."""
    _, kd, nd = dw_home.shape
    return dw_home.view(torch.float32).as_strided((0, kd, nd), (kd * nd, nd, 1))


# ---------------------------------------------------------------------------------------------------
# CI: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------------


def _compile_only(kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
                  op: str = "fwd", config: list | None = None) -> None:
    """Child-process entry of ``compile_group_gemm_for_sm90`` (environment already set)."""
    from csrc_cute.compile_check import expect_no_driver

    with expect_no_driver():
        compile_op(op, kd, nd, pad, num_sms, None if config is None else GroupGemmConfig(*config))


def compile_group_gemm_for_sm90(
    dump_dir: str, kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
    op: str = "fwd", config: GroupGemmConfig | None = None,
):
    """Compile one kernel (``op`` = "fwd", "dgrad", "dgrad2", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd", "swiglu_bwd_smem", "swiglu_gather", "swiglu_gather_h_only", "wgrad_gather",
    "swiglu_bwd_gather", "wgrad_gather_t", or with remote groups "row_scale_remote", "swiglu_remote",
    "swiglu_h_only_remote"; for
    the SwiGLU ops ``kd`` is H and ``nd`` is F) for sm_90a (works on a CPU-only machine) and return a
    ``CompileCheckResult`` with the PTX/cubin paths and ptxas statistics (registers, shared memory,
    spills). ``config``: as ``compile_op``'s."""
    from csrc_cute.compile_check import run_compile_check

    return run_compile_check(
        "csrc_cute.group_gemm.host:_compile_only",
        dump_dir,
        dict(kd=kd, nd=nd, pad=pad, num_sms=num_sms, op=op, config=None if config is None else list(config)),
        arch="sm_90a",
    )
