"""CPU (CI) checks of the CuTe DSL grouped GEMM kernels (csrc_cute/group_gemm/): every variant compiles
for sm_90a without a GPU and ptxas reports one kernel with no spills, no stack frame and no serialized
wgmma; the PTX has the instructions of its design (wgmma majorness, TMA loads and stores, the remote
variants' descriptor machinery); layout probes of the epilogues (CuTe layout algebra at trace time); the
ptxas report parser.
"""

import os

import pytest

from csrc_cute import compile_check
from csrc_cute.group_gemm import (
    compile_group_gemm_for_sm90,
    select_swiglu_bwd_config,
    select_wgrad_config,
    select_wide_rows_config,
)


def compile_one_kernel_no_spills(tmp_path, op: str, kd: int, nd: int, pad: int, config=None) -> str:
    """Compile one GEMM variant (``config``: instead of the op's tile choice) for sm_90a, check ptxas
    reports one kernel with no spills, no stack frame and no serialized wgmma, and return its PTX text (skips
    when ptxas is missing)."""
    res = compile_group_gemm_for_sm90(str(tmp_path), kd=kd, nd=nd, pad=pad, op=op, config=config)
    assert res.ptx, f"no PTX written:\n{res.child_output}"
    assert res.cubin and all(os.path.getsize(c) > 0 for c in res.cubin), res.child_output
    if compile_check.find_ptxas() is None:
        pytest.skip("ptxas not available")
    print(f"\n[group_gemm {op} sm_90a Kd={kd} Nd={nd} P={pad}]\n" + res.summary())
    assert len(res.stats) == 1, res.summary()
    for s in res.stats:
        assert s.spill_bytes == 0, res.summary()
        assert s.stack_frame_bytes == 0, res.summary()
        assert not s.wgmma_serialized, res.summary()
    with open(res.ptx[0], "rb") as f:
        return f.read().decode(errors="replace")


def layout_probe(module: str, probe: str, tile_m: int, tile_n: int, **kwargs) -> dict:
    """Run layout probe `probe` of csrc_cute/group_gemm/<module>.py (CuTe layout algebra at trace time,
    no GPU) in the sm_90a compile child (csrc_cute/compile_check.py); returns the dict it returns."""
    value, _ = compile_check.run_in_compile_child(f"csrc_cute.group_gemm.{module}:{probe}",
                                                  dict(tile_m=tile_m, tile_n=tile_n, **kwargs), timeout=600)
    return value


def test_parse_ptxas_verbose():
    text = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : Function properties for k1\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
    )
    (s,) = compile_check.parse_ptxas_verbose(text)
    assert (s.name, s.registers, s.shared_bytes, s.cmem_bytes) == ("k1", 168, 1024, 400)
    assert (s.stack_frame_bytes, s.spill_store_bytes, s.spill_load_bytes, s.spill_bytes) == (8, 4, 12, 16)
    assert s.wgmma_serialized == ""
    # ptxas' serialized-wgmma notes name their function (here before its stats); other notes are ignored
    serial = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized "
              "due to insufficient register resources for the wgmma pipeline in the function 'k2'\n"
              "ptxas info    : (C7519) warpgroup.arrive is injected in around line 9 by compiler to allow use of "
              "registers in GMMA in function 'k1'\n")
    k1, k2 = compile_check.parse_ptxas_verbose(serial + text + text.replace("k1", "k2"))
    assert (k1.name, k1.wgmma_serialized) == ("k1", "")
    assert (k2.name, k2.wgmma_serialized) == ("k2", "due to insufficient register resources for the wgmma pipeline")


@pytest.mark.parametrize("pad", [128, 64])
def test_compile_sm90a_no_spills(tmp_path, pad):
    assert "wgmma.mma_async" in compile_one_kernel_no_spills(tmp_path, "fwd", 7168, 2048, pad)


@pytest.mark.parametrize(
    "op, kd, nd, pad",
    [
        ("dgrad", 7168, 2048, 128),  # gate/up projection's dgrad (output Kd = 7168)
        ("dgrad", 2048, 7168, 64),  # down projection's dgrad, tile_M = 64
        ("dgrad2", 7168, 2048, 128),  # gate + up projections' dgrad in one GEMM (Kd = H, Nd = F)
        ("dgrad2", 520, 200, 64),  # partial output tile, partial last k tile of each pair, tile_M = 64
        ("wgrad", 7168, 2048, 128),
        ("wgrad", 520, 136, 64),  # partial tiles in M and N, tile_N = 128
        # A's k rows gathered from x by index (cp.async), B by TMA: the gate/up projection's wgrad
        ("wgrad_gather", 7168, 2048, 128),
        ("wgrad_gather", 520, 136, 64),
        # the down projection's wgrad: the gathered-A wgrad of dW^T (A = g_out's rows by index, Kd = H,
        # Nd = F), stored transposed
        ("wgrad_gather_t", 7168, 2048, 128),
        ("wgrad_gather_t", 520, 136, 64),
    ],
)
def test_backward_compile_sm90a_no_spills(tmp_path, op, kd, nd, pad):
    ptx = compile_one_kernel_no_spills(tmp_path, op, kd, nd, pad)
    if op == "wgrad_gather_t":
        # dW^T's tiles are M-major in dW: every shared sub-tile written transposed (stmatrix .trans), its
        # 64 x 32 (pingpong) or tile_m x 32 sub-tiles stored by one TMA store per 64 rows (128 bytes: the
        # swizzle atom's width)
        cfg = select_wgrad_config(pad, kd, nd)
        stm = [ln for ln in ptx.splitlines() if "stmatrix" in ln]
        assert stm and all(".trans" in ln for ln in stm), stm[:1]
        assert ptx.count("cp.async.bulk.tensor.3d.global.shared") == (cfg.tile_m // 64) * (cfg.tile_n // 32)
        op = "wgrad_gather"
    if op == "wgrad_gather":
        check_gathered_wgrad_a(ptx, tile_m=128, tile_n=select_wgrad_config(pad, kd, nd).tile_n)
        op = "wgrad"
    # the tensor cores do the work: wgmma with the operand majorness of the op
    # (imm-trans-a, imm-trans-b: dgrad A and B K-major; wgrad A M-major and B N-major)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma, "no wgmma in the PTX"
    trans = {"dgrad": "0, 0;", "dgrad2": "0, 0;", "wgrad": "1, 1;"}[op]
    assert all(ln.replace(" ", "").endswith(trans.replace(" ", "")) for ln in mma), mma[0][-60:]
    assert "ld.local" not in ptx and "st.local" not in ptx
    if op.startswith("dgrad"):
        # the producer's TMA loads: per operand pair (one for dgrad, two for dgrad2) a home and a slot load
        # of A (2-D) and of B (3-D)
        pairs = 2 if op == "dgrad2" else 1
        assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * pairs
        assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global") == 2 * pairs
        # every descriptor prefetched: A per pair, home and slot B per pair, the store
        assert ptx.count("prefetch.tensormap") == 3 * pairs + 1
    if op == "wgrad":
        # home groups: bf16 through stmatrix and a TMA store over dw_home viewed (Kd, Nd, epn); slot
        # groups: the fp32 read-add-write
        assert "stmatrix" in ptx and "cp.async.bulk.tensor.3d.global.shared" in ptx
        assert "cvt.rn.bf16x2.f32" in ptx and "ld.global.f32" in ptx and "st.global.f32" in ptx


@pytest.mark.parametrize("op", ["dgrad2", "row_scale", "wgrad"])
def test_pingpong_option_compiles_sm90a_no_spills(tmp_path, op):
    """The row kernels' and the wgrad's pingpong option (``GroupGemmConfig.pingpong``, 128 x 192; the wgrads
    choose it, bench_tiles measures it for the others): each warp group a whole tile (m64n192 wgmma), the
    mainloops taking turns on named barriers, each epilogue's 64 x 32 TMA-store sub-tiles; the row-scaled
    forward's thread holds rows in both 64-row halves of its tile: four route weights loaded per tile."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, GroupGemmConfig(128, 192, 132, True))
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n192k16" in ln for ln in mma), mma[:1]
    assert "bar.arrive" in ptx and "bar.sync" in ptx
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared" if op == "wgrad"
                     else "cp.async.bulk.tensor.2d.global.shared") == (128 // 64) * (192 // 32)
    if op == "row_scale":
        assert ptx.count("ld.global.f32") == 4


@pytest.mark.parametrize("op", ["wgrad_gather", "wgrad_gather_t"])
def test_slow_hbm_gathered_wgrads_compile_sm90a_no_spills(tmp_path, op):
    """The layer's gathered wgrads on the tile ``select_wgrad_config`` picks on a GPU whose HBM is slower than
    PINGPONG_MIN_HBM_GBS (an H100): pingpong 128 x 192 (m64n192 wgmma) in clusters of two CTAs sharing each B
    tile, every B load multicast, the gathered A loaded as without clusters (``check_gathered_wgrad_a``)."""
    from csrc_cute.group_gemm.config import GroupGemmConfig, select_wgrad_config

    cfg = select_wgrad_config(128, 7168, 2048, 132, hbm_gbs=3352.0)
    assert tuple(cfg) == tuple(GroupGemmConfig(128, 192, 132, True, cluster_m=2))
    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, cfg)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n192k16" in ln for ln in mma), mma[:1]
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor.2d.shared::cluster.global" in ln]
    assert loads and all(".multicast::cluster" in ln for ln in loads)
    check_gathered_wgrad_a(ptx, tile_m=128, tile_n=192)


@pytest.mark.parametrize("op", ["swiglu_bwd_smem", "swiglu_bwd_gather"])
def test_slow_hbm_swiglu_bwd_compiles_sm90a_no_spills(tmp_path, op):
    """The SwiGLU backward (the op's shared-memory epilogue and the layer's gathered one) on the tile
    ``select_swiglu_bwd_config`` picks on a GPU whose HBM is slower than PINGPONG_MIN_HBM_GBS (an H100): 128 x 192
    (m64n192 wgmma) in bands of 16 in clusters of two CTAs sharing each W_down tile, within the consumers' 240
    registers (at their edge: a serpentine band walk, tried in session 38, made ptxas spill 8 B in the epilogue)."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    cfg = select_swiglu_bwd_config(128, 2048, 132, hbm_gbs=3352.0)
    assert tuple(cfg) == tuple(GroupGemmConfig(128, 192, 132, False, 16, cluster_m=2))
    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, cfg)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n192k16" in ln for ln in mma), mma[:1]
    assert any(".multicast::cluster" in ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln)


@pytest.mark.parametrize("op", ["dgrad2", "row_scale"])
def test_slow_hbm_rows_compile_sm90a_no_spills(tmp_path, op):
    """The dgrad2 and the row-scaled forward on the tile ``select_hbm_rows_config`` picks on a GPU whose HBM is
    slower than PINGPONG_MIN_HBM_GBS (an H100): cooperative 128 x 256 (m64n256 wgmma from both consumer warp
    groups, no named turn barriers) in bands of 64 M tiles; the dgrad2's two operand pairs loaded by TMA as on
    the pingpong tile, the row scale's two route weights a thread and tile loaded once each."""
    from csrc_cute.group_gemm.config import GroupGemmConfig, select_hbm_rows_config

    kd, nd = (2048, 7168) if op == "row_scale" else (7168, 2048)  # the output has H = 7168 columns
    cfg = select_hbm_rows_config(128, 7168, 132, hbm_gbs=3352.0)
    assert tuple(cfg) == tuple(GroupGemmConfig(128, 256, 132, band_m=64))
    ptx = compile_one_kernel_no_spills(tmp_path, op, kd, nd, 128, cfg)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n256k16" in ln for ln in mma), mma[:1]
    assert "bar.arrive" not in ptx
    if op == "dgrad2":
        assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 4
        assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global") == 4
    else:
        assert ptx.count("ld.global.f32") == 2


def check_sigmoid_one_mufu(ptx: str) -> None:
    """The SwiGLU epilogues' sigmoid is ``base.sigmoid_approx``: one tanh.approx an element, no ex2 + rcp pair."""
    assert "tanh.approx.f32" in ptx, "the sigmoid is not computed through tanh.approx"
    assert "ex2.approx" not in ptx and "rcp.approx" not in ptx, "a sigmoid through ex2 + rcp (two MUFU ops)"


@pytest.mark.parametrize("op", ["swiglu", "swiglu_gather"])
def test_swiglu_pingpong_option_compiles_sm90a_no_spills(tmp_path, op):
    """The fused SwiGLU's pingpong option at 128 x 96 (each warp group gate and up of a whole tile in one
    128 x 192 accumulator: m64n192 wgmma on a stage of 64-byte swizzle atoms, 192 fp32 registers a thread),
    the mainloops taking turns on named barriers, each epilogue's 64 x 32 TMA-store sub-tiles of h, gate and
    up (2 x 3 each); the gathered variant's A by cp.async (the layer's at R = 1)."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, GroupGemmConfig(128, 96, 132, True, 16))
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n192k16.f32.bf16.bf16" in ln for ln in mma), mma[:1]
    assert "bar.arrive" in ptx and "bar.sync" in ptx
    check_sigmoid_one_mufu(ptx)
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") == 3 * (128 // 64) * (96 // 32)
    if op == "swiglu_gather":  # A by cp.async, no TMA load of A (the count of B load sites is not pinned here)
        check_cp_async_gather(ptx, copies=2 * (128 // 16), commits=2)
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" not in ptx


@pytest.mark.parametrize("op,config", [
    ("swiglu_gather", (128, 128, 132, False, 16)),  # cooperative; four producer warps walk the tiles
    ("wgrad_gather", (128, 192, 132, True)),  # pingpong; the same
    ("row_scale", (128, 192, 132, True, 16)),  # pingpong; the producer's warp 0 alone
])
def test_dynamic_walk_compiles_sm90a_no_spills(tmp_path, op, config):
    """``GroupGemmConfig.dynamic`` (walk.py): the producer's warp 0 takes each tile number by one atomic add on
    the counter (three sites: the walk's first two numbers and each step's), the tiles pass through the
    shared ring's mbarriers; no spills, no serialised wgmma. The static walk has no atomic."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    kd, nd = (2048, 7168) if op == "row_scale" else (7168, 2048)
    ptx = compile_one_kernel_no_spills(tmp_path / "dynamic", op, kd, nd, 128, GroupGemmConfig(*config, dynamic=True))
    assert ptx.count("atom.global.add.u32") == 3
    assert "mbarrier.try_wait" in ptx and "shfl.sync.idx" in ptx
    static = compile_one_kernel_no_spills(tmp_path / "static", op, kd, nd, 128, GroupGemmConfig(*config))
    assert "atom.global" not in static


@pytest.mark.parametrize("op", ["dgrad2", "wgrad"])
def test_cluster_option_compiles_sm90a_no_spills(tmp_path, op):
    """``GroupGemmConfig.cluster_n`` = 2: clusters of two CTAs, each loading its half of every A tile by
    TMA multicast into both (one multicast load per A operand), the cluster's start and end synchronised
    (barrier.cluster), each consumer warp releasing a stage in both CTAs (mapa + a remote mbarrier arrive);
    the B loads stay per CTA."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, GroupGemmConfig(128, 256, 132, cluster_n=2))
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln and ".global.tile.mbarrier" in ln]
    multicast = [ln for ln in loads if ".multicast::cluster" in ln]
    if op == "dgrad2":  # A (the rows) is 2-D, B (the weights) 3-D: every A load multicast, no B load
        assert multicast == [ln for ln in loads if ".2d." in ln] and len(multicast) % 2 == 0
    else:  # A = x^T and B = dy^T both 2-D: A's loads multicast, B's not
        assert multicast and len(multicast) < len(loads)
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "mapa.shared::cluster" in ptx and "mbarrier.arrive.release.cta.shared::cluster" in ptx


@pytest.mark.parametrize("op, pingpong, band_m, tile_n", [
    ("dgrad", True, 16, 192), ("dgrad2", False, 64, 256), ("row_scale", True, 0, 192),
    ("swiglu_bwd_smem", True, 16, 160), ("swiglu_bwd_gather", True, 0, 160),
    ("wgrad", False, 0, 256), ("wgrad", True, 0, 192), ("wgrad_gather", False, 0, 256),
    ("wgrad_gather_t", True, 0, 192), ("swiglu", False, 16, 128), ("swiglu_gather", False, 16, 128),
])
def test_weight_sharing_cluster_option_compiles_sm90a_no_spills(tmp_path, op, pingpong, band_m, tile_n):
    """``GroupGemmConfig.cluster_m`` = 2: clusters of two CTAs at two M tiles of one group and one n tile, each
    B load (the weights; the wgrads' dy^T) a multicast one (the CTA's half of the tile into both CTAs; the row
    kernels' B rings, home and slot weights, each also load the other CTA's half for the lone tiles, into this
    CTA alone: ``b_loads.BTileLoads.load_b_tile``), every A load the CTA's own (TMA, or the gathered rows'
    cp.async); the stages released in both CTAs (mapa + a remote mbarrier arrive)."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    config = GroupGemmConfig(128, tile_n, 132, pingpong, band_m, cluster_m=2)
    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, config)
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln and ".global.tile.mbarrier" in ln]
    multicast = [ln for ln in loads if ".multicast::cluster" in ln]
    if op.startswith("wgrad"):  # A = x^T and B = dy^T both 2-D
        assert multicast and all(".2d." in ln for ln in multicast)
    else:  # B (the weights) is 3-D, A (the rows) 2-D: each B load multicast, no A load; each place that loads
        # a home or slot B tile issues two (this CTA's half, the other CTA's for a lone tile)
        assert multicast == [ln for ln in loads if ".3d." in ln]
        assert multicast and len(multicast) % 4 == 0, multicast
    if "gather" in op:  # A gathered by each CTA's cp.async
        assert "cp.async.ca.shared.global" in ptx or "cp.async.cg.shared.global" in ptx
    else:  # A's loads are each CTA's own
        assert len(loads) > len(multicast)
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "mapa.shared::cluster" in ptx and "mbarrier.arrive.release.cta.shared::cluster" in ptx


@pytest.mark.parametrize(
    "op, kd, nd, pad",
    [
        ("swiglu", 7168, 2048, 128),  # gate/up projection, training (h, gate, up stored)
        ("swiglu_h_only", 7168, 2048, 128),  # inference: h only
        ("swiglu", 520, 200, 64),  # tile_M = 64, partial tiles
        # A rows gathered from x by index (cp.async), B by TMA
        ("swiglu_gather", 7168, 2048, 128),
        ("swiglu_gather", 520, 200, 64),
        ("row_scale", 2048, 7168, 128),  # down projection with route weights
        ("row_scale", 520, 200, 64),
        ("swiglu_bwd", 7168, 2048, 128),  # down-projection dgrad + SwiGLU backward (Kd = H, Nd = F here)
        ("swiglu_bwd", 520, 200, 64),
        ("swiglu_bwd_smem", 7168, 2048, 128),  # its shared-memory (TMA) epilogue
        ("swiglu_bwd_smem", 520, 200, 64),
        # its A rows (g_y) gathered from g_out by index (cp.async), W_down by TMA
        ("swiglu_bwd_gather", 7168, 2048, 128),
        # inference with remote groups (weights read from the home rank through the peer mapping)
        ("swiglu_h_only_remote", 7168, 2048, 128),
        ("swiglu_remote", 520, 200, 64),
        ("row_scale_remote", 2048, 7168, 128),
        ("row_scale_remote", 520, 200, 64),
    ],
)
def test_fused_compile_sm90a_no_spills(tmp_path, op, kd, nd, pad):
    op_name = op
    ptx = compile_one_kernel_no_spills(tmp_path, op, kd, nd, pad)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert "ld.local" not in ptx and "st.local" not in ptx
    check_remote_descriptors(ptx, rings=(2 if op.startswith("swiglu") else 1) if op.endswith("_remote") else 0)
    op = op.removesuffix("_remote")
    if op.startswith("swiglu_gather"):
        check_gathered_a(ptx, tile_m=pad)
        op = "swiglu" + op.removeprefix("swiglu_gather")
    bwd_tile = select_swiglu_bwd_config(pad, nd)
    subtiles = (bwd_tile.tile_m // 64) * (bwd_tile.tile_n // 32)  # the shared-memory epilogue's 64 x 32
    if op == "swiglu_bwd_gather":
        check_gathered_swiglu_bwd_a(ptx, tile_m=pad, subtiles=subtiles)
        op = "swiglu_bwd_smem"  # the shared-memory epilogue's checks
    if op.startswith("swiglu_bwd"):
        # dgrad: A and B K-major; one accumulator of the tile's columns (160 at F = 2048, 128 at F = 200);
        # the activation's backward in the epilogue
        assert mma and all(f"m64n{bwd_tile.tile_n}k16.f32.bf16.bf16" in ln for ln in mma), mma[:1]
        assert all(ln.replace(" ", "").endswith("0,0;") for ln in mma), mma[0][-60:]
        assert "shfl.sync.bfly" in ptx
        check_sigmoid_one_mufu(ptx)
        # row_w: the register epilogue loads one per row slot (2 per 64-row block of a warp group's tile:
        # pingpong, each warp group owns whole tiles) in each of its full-tile and partial-tile paths; the
        # shared-memory one (a single path) those of a sub-tile's two rows per sub-tile
        slots = 2 * (2 if pad >= 128 else 1)
        smem = op == "swiglu_bwd_smem"
        assert ptx.count("ld.global.f32") == (2 * subtiles if smem else 2 * slots), ptx.count("ld.global.f32")
        fragment_io = [m for m in ("ld.global.b16", "ld.global.b32", "st.global.b16", "st.global.b32") if m in ptx]
        if smem:
            # gate/up and the three outputs only through shared memory: TMA loads (64 x 32 sub-tiles, on
            # mbarriers; A's home and slot loads besides) and TMA stores, 4-byte shared accesses in the
            # accumulator layout
            assert not fragment_io, fragment_io
            assert ptx.count("cp.async.bulk.tensor.2d.global.shared") == 3 * subtiles
            assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * subtiles + (
                0 if op_name.endswith("gather") else 2)
            assert "ld.shared.b32" in ptx and "st.shared.b32" in ptx and "mbarrier.init" in ptx
        else:
            assert fragment_io and "cp.async.bulk.tensor.2d.global.shared" not in ptx
    elif op.startswith("swiglu"):
        # one accumulator of 256 columns, gate's 128 then up's, one wgmma a k block; the activation is
        # computed in the kernel
        assert mma and all("m64n256k16.f32.bf16.bf16" in ln for ln in mma), mma[:1]
        check_sigmoid_one_mufu(ptx)
        # TMA stores of 4 sub-tiles (128 x 32) per tile: h, and with the pre-activations also gate and up
        stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
        assert stores == (12 if op == "swiglu" else 4), stores
    else:
        # the route weight: two distinct rows per thread and tile (four with pingpong consumers:
        # test_pingpong_option_compiles_sm90a_no_spills), loaded once each (loads CSE'd)
        rows = 4 if op_name == "row_scale" and select_wide_rows_config(pad, nd).pingpong else 2
        assert ptx.count("ld.global.f32") == rows, ptx.count("ld.global.f32")


def check_cp_async_gather(ptx: str, copies: int, commits: int):
    """A gathered operand's loads: ``copies`` 16-byte cp.async, each predicated (zero fill: a source size
    chosen per copy); ``commits`` sites where each producer thread arrives on the stage's full mbarrier when
    its copies land (noinc); the full barriers count 1 + 128 arrivals (the TMA warp and the 128 threads)."""
    import re

    found = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)
    assert len(found) == copies, len(found)
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == commits
    assert re.search(r"mov\.b32\s+(%r\d+), 129;\s+mbarrier\.init\.shared\.b64 \[%r\d+\], \1;", ptx)


def check_gathered_a(ptx: str, tile_m: int):
    """The gathered A operand: loaded by 16-byte cp.async (one per row a producer thread owns, tile_m / 16
    rows, in each of the home and slot tile loads), predicated (zero fill: a source size chosen per
    copy), each thread arriving on the stage's mbarrier when its copies land (noinc); the full barriers
    count 1 + 128 arrivals; no TMA load (nor descriptor) of A, only B's 3-D loads (home and slot, gate and
    up, in each of the home and slot tile loads)."""
    check_cp_async_gather(ptx, copies=2 * (tile_m // 16), commits=2)
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" not in ptx
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global") == 8
    assert ptx.count("prefetch.tensormap") == 4 + 3  # B's four atoms and the stores of h, gate, up


def check_gathered_wgrad_a(ptx: str, tile_m: int, tile_n: int):
    """The wgrad's gathered A operand (M-major, k rows by index): one 16-byte cp.async per k row a producer
    thread owns (tile_m / 16 of a k tile's 64), predicated (zero fill: a source size chosen per copy), in
    the one k-tile loop; each thread arrives on the stage's mbarrier when its copies land (noinc); the full
    barriers count 1 + 128 arrivals; no TMA load (nor descriptor) of A: the k tile's 2-D loads are B's
    (tile_n / 64 boxes of 64 columns), the prefetched descriptors B's and the store's."""
    check_cp_async_gather(ptx, copies=tile_m // 16, commits=1)
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == tile_n // 64
    assert ptx.count("prefetch.tensormap") == 2


def check_gathered_swiglu_bwd_a(ptx: str, tile_m: int, subtiles: int):
    """The SwiGLU-backward's gathered A operand (g_y rows of g_out by index, K-major): one 16-byte cp.async
    per row a producer thread owns (tile_m / 16), in each of the home and slot tile loads, predicated (zero
    fill), noinc arrivals, full barriers of 1 + 128 arrivals; no TMA load of A: the 3-D loads are W_down's
    (home, slot), the 2-D loads only the shared-memory epilogue's gate/up sub-tiles (two per sub-tile), the
    prefetched descriptors W_down's two and the epilogue's five."""
    check_cp_async_gather(ptx, copies=2 * (tile_m // 16), commits=2)
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global") == 2
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * subtiles
    assert ptx.count("prefetch.tensormap") == 2 + 5


def check_remote_descriptors(ptx: str, rings: int):
    """The remote variants (``rings`` B rings) build one descriptor per ring, once (its global address
    replaced, one release fence, one acquire per descriptor), and exactly one of the four B-load sets
    of the producer (home, slot, remote, unused remote group) goes through the built descriptors; the
    other variants (``rings`` 0) have none of this machinery."""
    import re

    replaced = re.findall(r"tensormap\.replace\.tile\.global_address\.global\.b1024\.b64\s+\[(%rd\d+)\]", ptx)
    assert len(replaced) == rings, replaced
    assert ptx.count("fence.proxy.tensormap::generic.release") == min(rings, 1)
    assert ptx.count("fence.proxy.tensormap::generic.acquire") == rings
    if rings:
        loads = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\S*\s+\[%r\d+\],\s*\[(%rd\d+),", ptx)
        via_desc = [r for r in loads if r in replaced]
        assert loads and len(via_desc) == len(loads) // 4, (len(via_desc), len(loads))
    else:
        assert "tensormap.replace" not in ptx and "fence.proxy.tensormap" not in ptx


@pytest.mark.parametrize("tile_m, tile_n", [(128, 256), (64, 128)])
def test_wgrad_epilogue_threads_cover_the_tile_once(tile_m, tile_n):
    """The wgrad epilogue of the slot groups adds each thread's accumulators straight into the fp32 dW:
    the consumer threads' partitions of an output tile must cover every element exactly once (layout
    algebra at trace time, no GPU). Guards against slicing the tiled MMA by warp group instead of by
    thread."""
    res = layout_probe("wgrad", "wgrad_epilogue_coverage", tile_m, tile_n)
    n = tile_m * tile_n
    assert res == dict(writes=n, distinct=n, elements=n, inside=True), res


@pytest.mark.parametrize("tile_m", [128, 64])
def test_swiglu_gather_copy_covers_the_a_stage_once(tile_m):
    """The gathered A operand's cp.async copy: the 128 producer threads' partitions of a (tile_m, 64) A
    stage cover every element exactly once, each copy one 16-byte chunk of one row, and the stage's
    shared layout (the swizzled one TMA fills and wgmma reads) keeps every such chunk 8 consecutive,
    16-byte aligned elements: a 16-byte cp.async writes exactly where TMA would (CPU)."""
    res = layout_probe("swiglu", "swiglu_gather_copy_coverage", tile_m, 128)
    n = tile_m * 64
    assert res == dict(values=n, distinct=n, elements=n, bad_chunks=0, bad_smem=0, smem_distinct=n), res


@pytest.mark.parametrize("tile_m", [128, 64])
def test_wgrad_gather_copy_covers_the_a_stage_once(tile_m):
    """The gathered wgrad's M-major cp.async copy: the 128 producer threads' partitions of a (tile_m, 64) A
    stage (M = H columns of x, 64 k rows) cover every element exactly once, each copy 8 consecutive M
    elements of one k row (16 contiguous bytes of one token row of x), and the stage's shared layout (the
    swizzled M-major one TMA fills and wgmma reads) keeps every such chunk 8 consecutive, 16-byte aligned
    elements: a 16-byte cp.async writes exactly where TMA would (CPU)."""
    res = layout_probe("wgrad", "wgrad_gather_copy_coverage", tile_m, 128)
    n = tile_m * 64
    assert res == dict(values=n, distinct=n, elements=n, bad_chunks=0, bad_smem=0, smem_distinct=n), res


def _store_subtiles(tile_m: int, tile_n: int, pingpong: bool) -> dict:
    """Threads, sub-tiles and values per thread and sub-tile of the TMA-store epilogue of the row kernels, the
    wgrad and the fused SwiGLU (``base._init_tma_store_epilogue``): 32 columns of one warp group's 64 rows
    (pingpong) or of the whole tile's rows (cooperative)."""
    return dict(threads=128 if pingpong else 2 * tile_m, subtiles=(tile_m // 64 if pingpong else 1) * (tile_n // 32),
                per_subtile=16)


@pytest.mark.parametrize("tile_m, tile_n, pingpong, dw_m_major", [(128, 192, True, True), (128, 256, False, True),
                                                                  (64, 128, False, True), (128, 192, True, False)])
def test_wgrad_store_reads_each_subtile_of_the_accumulator(tile_m, tile_n, pingpong, dw_m_major):
    """The wgrad's home-tile store takes sub-tile e of its output from the retiled accumulator's sub-tile e,
    for the N-major gradient and for the M-major one (stmatrix transposing; the down projection's dW^T):
    checked for every thread and value against the real layouts (CPU)."""
    res = layout_probe("wgrad", "wgrad_store_pairing", tile_m, tile_n, pingpong=pingpong, dw_m_major=dw_m_major)
    assert res == dict(covered=True, mismatches=0, **_store_subtiles(tile_m, tile_n, pingpong)), res


@pytest.mark.parametrize("tile_m, tile_n", [(128, 128), (64, 128), (128, 64), (128, 96)])
def test_swiglu_b_stage_halves_are_the_gate_and_up_loads(tile_m, tile_n):
    """The fused SwiGLU's one B ring of 2 tile_n columns a stage: each half (gate's, up's) as the kernel
    cuts it is the ring's columns [half tile_n, (half + 1) tile_n), laid out there as one tile_n-column TMA
    load writes (the same swizzle, a whole number of swizzle periods in), for every element of every
    stage (CPU). Checked to fail when both halves are cut at the first."""
    res = layout_probe("swiglu", "swiglu_b_stage_halves", tile_m, tile_n)
    assert res == dict(mismatches=0, checked=2 * res["stages"] * tile_n * 64, stages=res["stages"],
                       same_swizzle=True), res


@pytest.mark.parametrize("tile_m, tile_n, pingpong", [(128, 128, False), (64, 128, False), (128, 96, True),
                                                      (128, 64, True)])
def test_swiglu_epilogue_pairs_gate_and_up(tile_m, tile_n, pingpong):
    """The fused SwiGLU's epilogue reads gate of output sub-tile e at accumulator sub-tile gate_subtile(e)
    and up at up_subtile(e): for every thread and value of the register -> shared copy both are
    the (row, column) it stores, up's tile_n columns on, checked against the real layouts (CPU). The plain
    index e fails this at the pingpong tiles (two 64-row blocks a warp group)."""
    res = layout_probe("swiglu", "swiglu_gate_up_pairing", tile_m, tile_n, pingpong=pingpong)
    assert res == dict(covered=True, mismatches=0, **_store_subtiles(tile_m, tile_n, pingpong)), res


@pytest.mark.parametrize("tile_m, tile_n, pingpong", [(128, 256, False), (64, 128, False), (128, 192, True)])
def test_rows_store_reads_each_subtile_of_the_accumulator(tile_m, tile_n, pingpong):
    """The forward/dgrad store takes output sub-tile e from the retiled accumulator's sub-tile e, cooperative
    and pingpong: checked for every thread and value against the real layouts (CPU)."""
    res = layout_probe("rows", "rows_store_pairing", tile_m, tile_n, pingpong=pingpong)
    assert res == dict(covered=True, mismatches=0, **_store_subtiles(tile_m, tile_n, pingpong)), res


@pytest.mark.parametrize("tile_m, tile_n", [(128, 128), (64, 128), (128, 160)])
def test_swiglu_bwd_row_reduction_layout(tile_m, tile_n):
    """The route-weight gradient is reduced per row in registers (static row slots), then over the four
    lanes of a quad: checked against the real accumulator layout for every thread of the warp group
    that computes a tile (pingpong: one warp group per tile, two rows per 64-row block) (CPU)."""
    res = layout_probe("swiglu_bwd", "swiglu_bwd_row_quads", tile_m, tile_n)
    assert res == dict(threads=128, bad_slot=0, bad_quad=0, bad_cover=0, slots=2 * tile_m // 64), res


@pytest.mark.parametrize("op", ["swiglu_bwd_smem", "swiglu_bwd_gather"])
def test_wide_swiglu_bwd_smem_compiles_sm90a_no_spills(tmp_path, op):
    """The SwiGLU backward at 128 x 192 in clusters sharing W_down (QuACK's gemm_dgated tile; the ops' tile where the
    HBM is slow, select_swiglu_bwd_config): its shared-memory epilogue in 64 x 32 TMA sub-tiles whose columns the
    threads compute 16 at a time (``SwigluBwdSmemEpilogue.epi_math_n``), which fits the consumers' registers next to
    192 accumulators a thread (32 at a time, ptxas spilled): m64n192 wgmma, 12 sub-tiles a tile, each one's gate/up
    loaded and three outputs stored by TMA, two route weights a sub-tile. Both kernels run the plain kernel's
    register budgets, 24 producer and 240 consumer registers (the gathered one at 40 / 232 spilled 40-108 B)."""
    from csrc_cute.group_gemm.config import GroupGemmConfig

    config = GroupGemmConfig(128, 192, 132, False, 16, cluster_m=2)
    ptx = compile_one_kernel_no_spills(tmp_path, op, 7168, 2048, 128, config)
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mma and all("m64n192k16.f32.bf16.bf16" in ln for ln in mma), mma[:1]
    subtiles = 2 * 192 // 32
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") == 3 * subtiles
    # gate/up per sub-tile, and the plain kernel's A (g_y) stages by TMA; the gathered one's A by cp.async
    gathered = op == "swiglu_bwd_gather"
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * subtiles + (0 if gathered else 2)
    assert ("cp.async.cg.shared.global" in ptx) == gathered
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in ptx and "setmaxnreg.inc.sync.aligned.u32 240;" in ptx
    assert ptx.count("ld.global.f32") == 2 * subtiles  # a sub-tile's two halves share their rows: read once


@pytest.mark.parametrize("tile_m, tile_n", [(128, 128), (64, 128), (128, 160), (128, 192)])
def test_swiglu_bwd_smem_subtile_pairs_accumulator_elements(tile_m, tile_n):
    """The shared-memory epilogue reads gate/up of a 64 x 32 sub-tile (past 160 columns in two 64 x 16 halves)
    through a chunk MMA's partition and pairs element v with accumulator element first(e) + v: checked for every
    thread of the warp group and every chunk against the real layouts (CPU)."""
    res = layout_probe("swiglu_bwd", "swiglu_bwd_smem_subtile_layout", tile_m, tile_n)
    width = 32 if tile_n <= 160 else 16
    subtiles = (tile_m // 64) * (tile_n // width)
    assert res == dict(threads=128, subtiles=subtiles, per_subtile=width // 2, covered=True, mismatches=0), res
