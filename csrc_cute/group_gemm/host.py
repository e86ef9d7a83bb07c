"""Host side of the grouped GEMM: validation, compilation (once per static key) and launch.

``group_gemm_fwd`` / ``group_gemm_dgrad`` / ``group_gemm_wgrad`` / ``group_gemm_row_scale`` /
``group_gemm_swiglu`` / ``group_gemm_swiglu_bwd`` validate, compile through ``_compile_cached`` (fake
tensors, symbolic ``N``/``epn``/``B``/``G``, ``--enable-tvm-ffi``, environment stream) and launch on
torch's current stream. ``compile_op`` names every kernel variant by op; ``compile_group_gemm_for_sm90``
compiles one on a CPU-only machine for CI (see ``compile_check``). The DSL (cutlass) is imported only
inside the compile path, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

import torch

from ..jit import KernelFamily
from .config import (
    H100_H200_NUM_SMS,
    GroupGemmConfig,
    select_config,
    select_swiglu_bwd_config,
    select_swiglu_config,
    select_wgrad_config,
)
# ---------------------------------------------------------------------------------------------------
# Compilation (once per static key)
# ---------------------------------------------------------------------------------------------------

# One TMA descriptor (CUtensorMap): its size and the alignment its global-memory copy needs.
_DESC_BYTES = 128
# every GEMM kernel compiles through the one JIT layer (memory + disk cache, keyed with the target arch;
# the disk entries are invalidated by the package's sources)
_JIT = KernelFamily("group_gemm", ("csrc_cute.group_gemm",))


def _compile_cached(key: tuple, build):
    """``build()`` once per ``key`` and target arch (csrc_cute/jit.py)."""
    return _JIT.compiled(key, build)


def _fake_sizes():
    """Symbolic (N, epn, B, G): the sizes a compiled kernel takes at run time."""
    import cutlass.cute as cute

    return cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()


def _fake(dtype, shape, align: int = 16):
    """Fake contiguous (row-major) tensor of ``shape`` for ``cute.compile``."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align
    )


def _compile_for_torch(kernel, *fakes):
    """Compile ``kernel`` for the fake arguments; the result takes torch tensors and runs on torch's
    current stream (tvm-ffi environment stream)."""
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fakes, stream, options="--enable-tvm-ffi")


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

    return _compile_cached((name, int(kd), int(nd), tuple(config)), build)


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

    return _compile_cached(("group_gemm_dgrad2", int(kd), int(nd), tuple(config)), build)


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

    return _compile_cached(("group_gemm_wgrad", int(kd), int(nd), tuple(config)), build)


def _fake_remote(num_peer_arrays: int):
    """Fakes of the remote arguments: remote_experts (n_remote,) int32, ``num_peer_arrays`` x peers (R,)
    int64 and the descriptor workspace (int64, 128-byte aligned), all of symbolic length."""
    import cutlass
    import cutlass.cute as cute

    n_remote, num_ranks, ws = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return (_fake(cutlass.Int32, (n_remote,), 4), *(_fake(cutlass.Int64, (num_ranks,), 8)
                                                      for _ in range(num_peer_arrays)),
            _fake(cutlass.Int64, (ws,), _DESC_BYTES))


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
    return _compile_cached((name, bool(store_preact), int(hd), int(f), tuple(config)), build)


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
    return _compile_cached((name, int(kd), int(nd), tuple(config)), build)


def compile_group_gemm_swiglu_bwd(hd: int, f: int, config: GroupGemmConfig):
    """The down-projection dgrad with the SwiGLU backward epilogue: takes (g_y [N, H], w_down_home
    [epn, F, H], w_down_slot [B, F, H], cu_seqlens, row_w [N] fp32, gate [N, F], up [N, F], g_gate [N, F],
    g_up [N, F], h_w [N, F], part [N, ceil(F / tile_n)] fp32)."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf, f32 = cutlass.BFloat16, cutlass.Float32
        n_tiles = (f + config.tile_n - 1) // config.tile_n
        from .swiglu_bwd import GroupGemmSwigluBwdSm90

        return _compile_for_torch(
            GroupGemmSwigluBwdSm90(config),
            _fake(bf, (n, hd)), _fake(bf, (epn, f, hd)), _fake(bf, (nb, f, hd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(f32, (n,), 4), *(_fake(bf, (n, f)) for _ in range(5)), _fake(f32, (n, n_tiles), 4),
        )

    return _compile_cached(("group_gemm_swiglu_bwd", int(hd), int(f), tuple(config)), build)


# ---------------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------------


def _check_inputs(x, w_home, w_slot, cu_seqlens, pad, x_name="x", red_dim=1, w_names=("w_home", "w_slot"),
                  check_device=True, remote=None, peer_names=("peers",)):
    """Checks of the row-grouped kernels; ``red_dim`` is the weight dim that x's columns match
    (1 = Kd: forward, 2 = Nd: dgrad, with x = dy); ``w_names`` name the weights in the errors;
    ``check_device=False`` leaves out the device and alignment checks. ``remote``: None, or the tuple
    (remote_experts, *peers) of the kernels with remote groups (``peer_names`` name the peers); then
    cu_seqlens has epn + B + n_remote entries (see ``_check_remote``)."""
    if w_names != ("w_home", "w_slot"):
        try:
            return _check_inputs(x, w_home, w_slot, cu_seqlens, pad, x_name, red_dim, check_device=check_device,
                                 remote=remote, peer_names=peer_names)
        except ValueError as exc:  # name the caller's weights
            msg = str(exc)
            msg = msg.replace("w_home", "\0").replace("w_slot", w_names[1]).replace("\0", w_names[0])
            raise ValueError(msg) from None
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    red_name = "Kd" if red_dim == 1 else "Nd"
    if x.dim() != 2:
        raise ValueError(f"{x_name} must be 2-D [N, {red_name}], got shape {tuple(x.shape)}")
    if w_home.dim() != 3:
        raise ValueError(f"w_home must be 3-D [epn, Kd, Nd], got shape {tuple(w_home.shape)}")
    if w_slot.dim() != 3:
        raise ValueError(f"w_slot must be 3-D [B, Kd, Nd], got shape {tuple(w_slot.shape)}")
    n, red = x.shape
    epn, kd, nd = w_home.shape
    nb, kd_s, nd_s = w_slot.shape
    if epn < 1:
        raise ValueError(f"w_home must hold at least one expert (epn >= 1), got epn={epn}")
    if w_home.shape[red_dim] != red:
        raise ValueError(
            f"w_home.shape[{red_dim}] ({red_name}={w_home.shape[red_dim]}) must equal "
            f"{x_name}.shape[1] ({red_name}={red})"
        )
    if (kd_s, nd_s) != (kd, nd):
        raise ValueError(
            f"w_slot must be [B, Kd={kd}, Nd={nd}] like w_home, got shape {tuple(w_slot.shape)}"
        )
    if kd < 8 or kd % 8:
        raise ValueError(f"Kd (w_home.shape[1]) must be a positive multiple of 8, got {kd}")
    if nd < 8 or nd % 8:
        raise ValueError(f"Nd (w_home.shape[2]) must be a positive multiple of 8, got {nd}")
    remote_tensors = ()
    if remote is not None:
        remote_tensors = _check_remote(remote, peer_names)
    _check_cu(cu_seqlens, epn + nb, remote_tensors[0][1].shape[0] if remote_tensors else 0)
    if not check_device:
        return n, kd, nd, epn, nb
    dev = x.device
    for name, t in (("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)) + remote_tensors:
        if t.device != dev:
            raise ValueError(f"{name} must be on the same device as {x_name} ({dev}), got {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"{x_name} must be a CUDA tensor for the CuTe kernel, got device {dev}")
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    return n, kd, nd, epn, nb


def _check_cu(cu_seqlens, num_groups, n_remote=0):
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != num_groups + n_remote:
        what = f"epn + B + n_remote = {num_groups} + {n_remote}" if n_remote else f"epn + B = {num_groups}"
        raise ValueError(f"cu_seqlens must be 1-D of length {what}, got shape {tuple(cu_seqlens.shape)}")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous")


def _check_remote(remote, peer_names):
    """Checks of ``remote`` = (remote_experts, *peers) (dtype, 1-D, non-empty, contiguous; the caller
    checks the devices); returns ((name, tensor), ...) of its tensors. The values live on the device and
    are not checked (no host sync): see the preconditions in ``group_gemm_row_scale``."""
    names = ("remote_experts",) + tuple(peer_names)
    if not isinstance(remote, tuple) or len(remote) != len(names):
        raise ValueError(f"remote must be None or a tuple ({', '.join(names)}), got {type(remote).__name__}"
                         + (f" of length {len(remote)}" if isinstance(remote, tuple) else ""))
    for (name, what, dtype), t in zip(
        [("remote_experts", "at least one remote group (n_remote >= 1)", torch.int32)]
        + [(pn, "at least one rank's address (R >= 1)", torch.int64) for pn in peer_names],
        remote,
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {str(dtype).replace('torch.', '')}, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.shape[0] < 1:
            raise ValueError(f"{name} must hold {what}, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if len(peer_names) > 1 and any(t.shape != remote[1].shape for t in remote[2:]):
        raise ValueError(f"{', '.join(peer_names)} must have the same length (one address per rank), got "
                         f"{', '.join(str(tuple(t.shape)) for t in remote[1:])}")
    return tuple(zip(names, remote))


def _desc_workspace(device: torch.device, num_rings: int) -> torch.Tensor:
    """Per launch of a kernel with remote groups: one 128-byte descriptor slot per CTA (at most #SMs)
    and B ring, 128-byte aligned (the caching allocator's blocks are 512-byte aligned)."""
    ws = torch.empty(num_rings * _device_info(device)[1] * (_DESC_BYTES // 8), dtype=torch.int64, device=device)
    assert ws.data_ptr() % _DESC_BYTES == 0
    return ws


_DEVICE_INFO: dict[int, tuple[tuple[int, int], int]] = {}
# (op, Kd, Nd, P, device index) -> compiled kernel: skips the config/key work on the hot path.
_LAUNCH_CACHE: dict[tuple, Any] = {}


def _device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(idx)
    if info is None:
        props = torch.cuda.get_device_properties(idx)
        info = _DEVICE_INFO[idx] = ((props.major, props.minor), props.multi_processor_count)
    return info


def compile_op(op: str, kd: int, nd: int, pad: int, num_sms: int):
    """The kernel of ``op`` ("fwd", "dgrad", "dgrad2", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd"; "row_scale_remote", "swiglu_remote", "swiglu_h_only_remote": with remote groups) for
    static (Kd, Nd) (H, F for the SwiGLU ops), padding P and ``num_sms``."""
    if op == "fwd":
        return compile_group_gemm(kd, nd, select_config(pad, nd, num_sms))
    if op == "dgrad":
        return compile_group_gemm_dgrad(kd, nd, select_config(pad, kd, num_sms))
    if op == "dgrad2":
        return compile_group_gemm_dgrad2(kd, nd, select_config(pad, kd, num_sms))
    if op == "wgrad":
        return compile_group_gemm_wgrad(kd, nd, select_wgrad_config(pad, kd, nd, num_sms))
    if op in ("row_scale", "row_scale_remote"):
        return compile_group_gemm_row_scale(kd, nd, select_config(pad, nd, num_sms), op == "row_scale_remote")
    if op in ("swiglu", "swiglu_h_only", "swiglu_remote", "swiglu_h_only_remote"):
        return compile_group_gemm_swiglu(kd, nd, select_swiglu_config(pad, nd, num_sms),
                                         op in ("swiglu", "swiglu_remote"), op.endswith("_remote"))
    if op == "swiglu_bwd":
        return compile_group_gemm_swiglu_bwd(kd, nd, select_swiglu_bwd_config(pad, num_sms))
    raise ValueError(f"unknown op {op!r}")


def _launcher(op: str, kd: int, nd: int, pad: int, device: torch.device):
    fast_key = (op, kd, nd, pad, device.index)
    fn = _LAUNCH_CACHE.get(fast_key)
    if fn is None:
        cc, num_sms = _device_info(device)
        if cc != (9, 0):
            raise ValueError(
                f"tensors must be on a Hopper (sm_90) GPU, got compute capability {cc[0]}.{cc[1]}"
            )
        fn = _LAUNCH_CACHE[fast_key] = compile_op(op, kd, nd, pad, num_sms)
    return fn


def _out_tensor(out, n, cols, device):
    if out is None:
        return torch.empty(n, cols, dtype=torch.bfloat16, device=device)
    if out.shape != (n, cols) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous bf16 [{n}, {cols}] tensor on {device}")
    return out


def _slot_map(w_slot: torch.Tensor, w_home: torch.Tensor) -> torch.Tensor:
    """``w_slot``, or ``w_home`` in its place when B == 0: a zero-sized tensor map cannot be encoded,
    and with no slot groups no tile ever reads (or writes) the slot map."""
    return w_home if w_slot.shape[0] == 0 else w_slot


def _rows_gemm(op: str, a, w_home, w_slot, cu_seqlens, pad: int, out, a_name: str, red_dim: int):
    """Forward (``red_dim`` 1) or dgrad (``red_dim`` 2): ``a [N, red] @ op(W_g)`` per group."""
    n, kd, nd, epn, nb = _check_inputs(a, w_home, w_slot, cu_seqlens, pad, x_name=a_name, red_dim=red_dim)
    fn = _launcher(op, kd, nd, pad, a.device)
    c = _out_tensor(out, n, nd if red_dim == 1 else kd, a.device)
    if n:
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
    return _rows_gemm("fwd", x, w_home, w_slot, cu_seqlens, pad, out, "x", 1)


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
    return _rows_gemm("dgrad", dy, w_home, w_slot, cu_seqlens, pad, out, "dy", 2)


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

    ``remote`` (inference): None, or ``(remote_experts, peers)``: then the last ``n_remote`` groups are
    remote groups, whose weights are read straight from their home rank (peer-mapped), and
    ``cu_seqlens`` has ``G = epn + B + n_remote`` entries. ``remote_experts`` int32 ``[n_remote >= 1]``
    (CUDA) holds the remote groups' global expert ids (ascending, -1 = an unused group); ``peers`` int64
    ``[R]`` (CUDA) holds ``peers[r]`` = the device address (valid on this GPU, e.g. torch symmetric memory)
    of rank r's home weights, a contiguous bf16 ``[epn, Kd, Nd]`` tensor like ``w_home``. Remote group j
    multiplies by ``W = (rank e // epn's home weights)[e % epn]``, ``e = remote_experts[j]``.
    Preconditions (on the device values, not checked: no host sync): every remote expert of a launch
    comes from one donor rank (each CTA builds its remote descriptor once, at its first remote tile: a
    different donor would need a new descriptor while loads that use the old one are in flight, i.e. the
    ring drained first; the kernel would read the first donor's weights instead), ``0 <= e < R * epn``
    for every used group, an unused group (-1) is empty, and every peer
    address is 16-byte aligned."""
    n, kd, nd, epn, nb = _check_inputs(x, w_home, w_slot, cu_seqlens, pad, check_device=False, remote=remote)
    if not isinstance(row_w, torch.Tensor):
        raise ValueError(f"row_w must be a torch.Tensor, got {type(row_w).__name__}")
    if row_w.dtype != torch.float32:
        raise ValueError(f"row_w must be float32, got {row_w.dtype}")
    if row_w.dim() != 1 or row_w.shape[0] != n:
        raise ValueError(f"row_w must be 1-D [N={n}] (one scale per row of x), got shape {tuple(row_w.shape)}")
    if not row_w.is_contiguous():
        raise ValueError("row_w must be contiguous")
    _check_inputs(x, w_home, w_slot, cu_seqlens, pad, remote=remote)
    if row_w.device != x.device:
        raise ValueError(f"row_w must be on the same device as x ({x.device}), got {row_w.device}")
    fn = _launcher("row_scale" if remote is None else "row_scale_remote", kd, nd, pad, x.device)
    y = _out_tensor(out, n, nd, x.device)
    if n:
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

    ``remote`` (inference): None, or ``(remote_experts, gate_peers, up_peers)``: the last ``n_remote``
    groups are remote groups, read from their home rank's gate and up weights (``gate_peers[r]``,
    ``up_peers[r]``: addresses of rank r's ``[epn, H, F]`` home weights, like ``w_gate_home`` /
    ``w_up_home``), with ``G = epn + B + n_remote``; as in ``group_gemm_row_scale``, preconditions
    included (one donor rank per launch)."""
    gate_names, up_names = ("w_gate_home", "w_gate_slot"), ("w_up_home", "w_up_slot")
    peer_names = ("gate_peers", "up_peers")
    n, hd, f, epn, nb = _check_inputs(x, w_gate_home, w_gate_slot, cu_seqlens, pad, w_names=gate_names,
                                      check_device=False, remote=remote, peer_names=peer_names)
    for name, t, like, ref in (("w_up_home", w_up_home, "w_gate_home", w_gate_home),
                               ("w_up_slot", w_up_slot, "w_gate_slot", w_gate_slot)):
        if isinstance(t, torch.Tensor) and t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {like} {tuple(ref.shape)}, got {tuple(t.shape)}")
    _check_inputs(x, w_up_home, w_up_slot, cu_seqlens, pad, w_names=up_names, check_device=False, remote=remote,
                  peer_names=peer_names)
    _check_inputs(x, w_gate_home, w_gate_slot, cu_seqlens, pad, w_names=gate_names, remote=remote,
                  peer_names=peer_names)
    _check_inputs(x, w_up_home, w_up_slot, cu_seqlens, pad, w_names=up_names, remote=remote, peer_names=peer_names)
    op = "swiglu" if store_preact else "swiglu_h_only"
    fn = _launcher(op if remote is None else op + "_remote", hd, f, pad, x.device)
    h = _out_tensor(out, n, f, x.device)
    gate = _out_tensor(gate_out, n, f, x.device) if store_preact else None
    up = _out_tensor(up_out, n, f, x.device) if store_preact else None
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``y = group_gemm_row_scale(swiglu(gate, up), W_down, row_w)`` up to the gate/up
    pre-activations, one kernel: ``d = g_y @ W_down_g^T`` (fp32) and, in its epilogue, from the saved bf16
    ``gate``/``up`` and ``row_w``: ``g_gate``, ``g_up`` (bf16, the gate/up projections' output gradients),
    ``h_w = row_w * silu(gate) * up`` (bf16, the down projection's wgrad operand: ``dW_down_g += h_w_g^T
    g_y_g``) and ``g_row_w[r] = sum_f d[r, f] * h[r, f]`` (fp32 [N], the route weights' gradient; per
    128-column tile partial sums, added here in a fixed order). Weights ``[epn, F, H]`` / ``[B, F, H]``.
    No host sync."""
    n, f, hd, epn, nb = _check_inputs(g_y, w_down_home, w_down_slot, cu_seqlens, pad, x_name="g_y", red_dim=2,
                                      w_names=("w_down_home", "w_down_slot"), check_device=False)
    for name, t, dt, shape in (("row_w", row_w, torch.float32, (n,)), ("gate", gate, torch.bfloat16, (n, f)),
                               ("up", up, torch.bfloat16, (n, f))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt:
            raise ValueError(f"{name} must be {str(dt).replace('torch.', '')}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (N rows of g_y, F = w_down_home.shape[1]), "
                             f"got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _check_inputs(g_y, w_down_home, w_down_slot, cu_seqlens, pad, x_name="g_y", red_dim=2,
                  w_names=("w_down_home", "w_down_slot"))
    for name, t in (("row_w", row_w), ("gate", gate), ("up", up)):
        if t.device != g_y.device:
            raise ValueError(f"{name} must be on the same device as g_y ({g_y.device}), got {t.device}")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    fn = _launcher("swiglu_bwd", hd, f, pad, g_y.device)
    tile_n = 128  # select_swiglu_bwd_config
    dev = g_y.device
    g_gate, g_up, h_w = (torch.empty(n, f, dtype=torch.bfloat16, device=dev) for _ in range(3))
    part = torch.empty(n, (f + tile_n - 1) // tile_n, dtype=torch.float32, device=dev)
    if n:
        fn(g_y, w_down_home, _slot_map(w_down_slot, w_down_home), cu_seqlens, row_w, gate, up, g_gate, g_up, h_w,
           part)
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
    for name, t in (("x", x), ("dy", dy), ("cu_seqlens", cu_seqlens), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, t, dt in (("x", x, torch.bfloat16), ("dy", dy, torch.bfloat16),
                        ("dw_home", dw_home, torch.bfloat16), ("dw_slot", dw_slot, torch.float32)):
        if t.dtype != dt:
            raise ValueError(f"{name} must be {str(dt).replace('torch.', '')}, got {t.dtype}")
    if x.dim() != 2 or dy.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"x [N, Kd] and dy [N, Nd] must be 2-D with equal N, got {tuple(x.shape)}, {tuple(dy.shape)}")
    n, kd = x.shape
    nd = dy.shape[1]
    if dw_home.dim() != 3 or tuple(dw_home.shape[1:]) != (kd, nd) or dw_home.shape[0] < 1:
        raise ValueError(f"dw_home must be [epn >= 1, Kd={kd}, Nd={nd}], got shape {tuple(dw_home.shape)}")
    if dw_slot.dim() != 3 or tuple(dw_slot.shape[1:]) != (kd, nd):
        raise ValueError(f"dw_slot must be [B, Kd={kd}, Nd={nd}], got shape {tuple(dw_slot.shape)}")
    if kd < 8 or kd % 8 or nd < 8 or nd % 8:
        raise ValueError(f"Kd and Nd must be positive multiples of 8, got Kd={kd}, Nd={nd}")
    _check_cu(cu_seqlens, dw_home.shape[0] + dw_slot.shape[0])
    dev = x.device
    for name, t in (("dy", dy), ("cu_seqlens", cu_seqlens), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if t.device != dev:
            raise ValueError(f"{name} must be on the same device as x ({dev}), got {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor for the CuTe kernel, got device {dev}")
    for name, t in (("x", x), ("dy", dy), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    fn = _launcher("wgrad", kd, nd, pad, dev)
    if n == 0:  # no rows: every group is empty, the home gradients are zero
        dw_home.zero_()
        return
    fn(x, dy, cu_seqlens, dw_home, dw_slot if dw_slot.shape[0] else _no_slots_f32(dw_home))


def _no_slots_f32(dw_home: torch.Tensor) -> torch.Tensor:
    """The wgrad kernel's fp32 slot argument when B == 0: an empty ``[0, Kd, Nd]`` fp32 view at
    ``dw_home``'s (valid, 16-byte aligned) address. No work item touches it: there are no slot groups."""
    _, kd, nd = dw_home.shape
    return dw_home.view(torch.float32).as_strided((0, kd, nd), (kd * nd, nd, 1))


# ---------------------------------------------------------------------------------------------------
# CI: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------------


def _compile_only(kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
                  op: str = "fwd") -> None:
    """Child-process entry of ``compile_group_gemm_for_sm90`` (environment already set)."""
    from csrc_cute.compile_check import expect_no_driver

    with expect_no_driver():
        compile_op(op, kd, nd, pad, num_sms)


def compile_group_gemm_for_sm90(
    dump_dir: str, kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
    op: str = "fwd",
):
    """Compile one kernel (``op`` = "fwd", "dgrad", "dgrad2", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd", or with remote groups "row_scale_remote", "swiglu_remote", "swiglu_h_only_remote"; for
    the SwiGLU ops ``kd`` is H and ``nd`` is F) for sm_90a (works on a CPU-only machine) and return a
    ``CompileCheckResult`` with the PTX/cubin paths and ptxas statistics (registers, shared memory,
    spills)."""
    from csrc_cute.compile_check import run_compile_check

    return run_compile_check(
        "csrc_cute.group_gemm.host:_compile_only",
        dump_dir,
        dict(kd=kd, nd=nd, pad=pad, num_sms=num_sms, op=op),
        arch="sm_90a",
    )
