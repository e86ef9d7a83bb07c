"""CPU (CI) checks of the grouped GEMM host layer (csrc_cute/group_gemm/host.py): tile selection
(select_config, select_wgrad_config) and input validation of every op before a kernel is compiled;
errors read ``moonep.<op>: <argument> must ...``. The remote-groups validation is in
test_group_gemm_remote.py.
"""

import pytest
import torch

from csrc_cute.group_gemm import (
    group_gemm_dgrad,
    group_gemm_dgrad2,
    group_gemm_fwd,
    group_gemm_swiglu_bwd_gather,
    group_gemm_wgrad,
    group_gemm_wgrad_gather,
    group_gemm_wgrad_gather_b,
    select_config,
    select_dgrad_config,
    select_hbm_rows_config,
    select_swiglu_bwd_config,
    select_swiglu_config,
    select_wgrad_config,
    select_wide_rows_config,
)
from group_gemm_cases import zero_inputs, zero_swiglu_inputs


def test_select_config_rejects_small_pad():
    # cooperative, M-major
    assert tuple(select_config(128, 2048, 132)) == (128, 256, 132, False, 0, False, 1, False, 1, True)
    assert tuple(select_config(256, 2048, 132)) == (128, 256, 132, False, 0, False, 1, False, 1, True)
    assert tuple(select_config(128, 7168, 132)) == (128, 256, 132, False, 0, False, 1, False, 1, True)  # M-major too
    # the dgrad's, the dgrad2's and the down projection's at H = 7168 (28 tiles of 256): pingpong 128 x 192 in
    # bands of 16 M tiles (WIDE_ROWS_BAND)
    assert tuple(select_wide_rows_config(128, 7168, 132)) == (128, 192, 132, True, 16, False, 1, False, 1, True)
    assert select_wide_rows_config(128, 2048, 132) == select_config(128, 2048, 132)  # 8 tiles: cooperative
    assert select_wide_rows_config(128, 2049, 132).pingpong and select_wide_rows_config(128, 2049, 132).band_m == 16
    assert select_wide_rows_config(64, 7168, 132) == select_config(64, 7168, 132)  # tile_M 64: cooperative
    # the fused SwiGLU: every group in bands of 16 M tiles (SWIGLU_BAND); M-major at 8 n tiles
    assert tuple(select_swiglu_config(128, 2048, 132)) == (128, 128, 132, False, 16, False, 1, False, 1, True)
    assert tuple(select_swiglu_config(128, 1024, 132)) == (128, 128, 132, False, 0, False, 1, False, 1, True)
    assert select_config(64, 2048, 132).tile_m == 64
    for bad in (32, 16):
        with pytest.raises(ValueError, match=r"P \(pad\)"):
            select_config(bad, 2048)
    for bad in (0, 96, 8):
        with pytest.raises(ValueError, match=r"P \(pad\)"):
            select_config(bad, 2048)


def test_select_swiglu_bwd_config():
    # 160 columns where they pad F by at most 5%, else 128; tile_M as the forward's
    assert tuple(select_swiglu_bwd_config(128, 2048, 132)) == (128, 160, 132, False, 16, False, 1, False, 1, True)
    assert tuple(select_swiglu_bwd_config(64, 1568, 132)) == (64, 160, 132, False, 16, False, 1, False, 1, True)
    assert select_swiglu_bwd_config(128, 1024).band_m == 0  # 8 n tiles
    assert select_swiglu_bwd_config(128, 1024).tile_n == 128  # 1120 columns: 9% more
    assert select_swiglu_bwd_config(128, 200).tile_n == 128
    assert select_swiglu_bwd_config(128, 160).tile_n == 160
    # HBM below 4 TB/s (an H100): 192 columns in clusters sharing W_down, where 192 pads F by at most 5% at tile_M 128
    assert tuple(select_swiglu_bwd_config(128, 2048, 132, 3352.3)) == (128, 192, 132, False, 16, False, 1, False, 2,
                                                                       True)
    assert select_swiglu_bwd_config(128, 2048, 132, 4800.0) == select_swiglu_bwd_config(128, 2048, 132)
    assert select_swiglu_bwd_config(64, 2048, 132, 3352.3).tile_n == 160  # tile_M 64
    assert select_swiglu_bwd_config(128, 1568, 132, 3352.3).tile_n == 160  # 1728 columns: 10% more
    assert select_swiglu_bwd_config(128, 2048, 1, 3352.3).cluster_m == 1


def test_config_band_m_must_be_a_non_negative_int_and_tall_m_major_needs_it():
    from csrc_cute.group_gemm import GroupGemmConfig

    assert GroupGemmConfig(128, 256, 132, band_m=16).band_m == 16 and GroupGemmConfig(128, 256, 132).band_m == 0
    for bad in (-1, True):
        with pytest.raises(ValueError, match="band_m must be an int >= 0"):
            GroupGemmConfig(128, 256, 132, band_m=bad)
    assert GroupGemmConfig(128, 256, 132, band_m=16, tall_m_major=True).tall_m_major
    with pytest.raises(ValueError, match="tall_m_major needs band_m > 0"):
        GroupGemmConfig(128, 256, 132, tall_m_major=True)


def test_config_cluster_n_is_1_or_2_and_only_the_tma_a_kernels_take_2():
    from csrc_cute.group_gemm import GroupGemmConfig
    from csrc_cute.group_gemm.rows import GroupGemmSm90
    from csrc_cute.group_gemm.swiglu import GroupGemmSwigluGatherSm90, GroupGemmSwigluSm90
    from csrc_cute.group_gemm.wgrad import GroupGemmWgradGatherSm90, GroupGemmWgradSm90

    assert GroupGemmConfig(128, 256, 132).cluster_n == 1 and GroupGemmConfig(128, 256, 132, cluster_n=2).cluster_n == 2
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="cluster_n must be 1 or 2"):
            GroupGemmConfig(128, 256, 132, cluster_n=bad)
    with pytest.raises(ValueError, match="cluster_n = 2 needs num_sms >= 2"):
        GroupGemmConfig(128, 256, 1, cluster_n=2)
    cluster = GroupGemmConfig(128, 256, 132, cluster_n=2)
    for kernel in (GroupGemmSm90(cluster), GroupGemmSm90(cluster, b_k_major=True), GroupGemmWgradSm90(cluster)):
        assert kernel.cluster_n == 2
    for cls in (GroupGemmSwigluSm90, GroupGemmSwigluGatherSm90, GroupGemmWgradGatherSm90):
        with pytest.raises(ValueError, match=f"{cls.__name__}: GroupGemmConfig.cluster_n must be 1"):
            cls(GroupGemmConfig(128, 128, 132, cluster_n=2))


def test_config_cluster_m_is_1_or_2_and_only_the_kernels_sharing_b_take_2():
    from csrc_cute.group_gemm import GroupGemmConfig
    from csrc_cute.group_gemm.rows import GroupGemmDgrad2Sm90, GroupGemmRowScaleRemoteSm90, GroupGemmSm90
    from csrc_cute.group_gemm.swiglu import GroupGemmSwigluGatherSm90, GroupGemmSwigluRemoteSm90, GroupGemmSwigluSm90
    from csrc_cute.group_gemm.swiglu_bwd import GroupGemmSwigluBwdGatherSm90, GroupGemmSwigluBwdSm90
    from csrc_cute.group_gemm.wgrad import GroupGemmWgradGatherSm90, GroupGemmWgradSm90

    assert GroupGemmConfig(128, 256, 132).cluster_m == 1
    cluster = GroupGemmConfig(128, 192, 132, True, 16, cluster_m=2)
    assert (cluster.cluster_m, cluster.cluster_n, cluster.band_m) == (2, 1, 16)
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="cluster_m must be 1 or 2"):
            GroupGemmConfig(128, 256, 132, cluster_m=bad)
    for other in (dict(cluster_n=2), dict(dynamic=True), dict(band_m=16, tall_m_major=True), dict(num_sms=1)):
        with pytest.raises(ValueError, match="cluster_m = 2 needs cluster_n = 1, a static walk, no tall_m_major"):
            GroupGemmConfig(**{**dict(tile_m=128, tile_n=256, num_sms=132, cluster_m=2), **other})
    with pytest.raises(ValueError, match="cluster_m = 2 needs an even band_m"):
        GroupGemmConfig(128, 256, 132, band_m=3, cluster_m=2)
    for kernel in (GroupGemmSm90(cluster), GroupGemmSm90(cluster, b_k_major=True), GroupGemmDgrad2Sm90(cluster),
                   GroupGemmSwigluBwdSm90(cluster), GroupGemmSwigluBwdSm90(cluster, "smem"),
                   GroupGemmSwigluBwdGatherSm90(cluster), GroupGemmWgradSm90(cluster),
                   GroupGemmWgradGatherSm90(cluster), GroupGemmWgradGatherSm90(cluster, dw_m_major=True),
                   GroupGemmSwigluSm90(cluster), GroupGemmSwigluGatherSm90(cluster, store_preact=False)):
        assert (kernel.cluster_m, kernel.cluster_size) == (2, 2)
    for cls in (GroupGemmRowScaleRemoteSm90, GroupGemmSwigluRemoteSm90):  # remote groups: the CTA's own descriptors
        with pytest.raises(ValueError, match=f"{cls.__name__}: GroupGemmConfig.cluster_m must be 1"):
            cls(GroupGemmConfig(128, 128, 132, cluster_m=2))


def test_select_wgrad_config():
    # pingpong
    assert tuple(select_wgrad_config(128, 7168, 2048, 132)) == (128, 192, 132, True, 0, False, 1, False, 1, True)
    assert tuple(select_wgrad_config(64, 520, 136, 132)) == (128, 128, 132, False, 0, False, 1, False, 1, True)
    assert select_wgrad_config(64, 64, 64).tile_m == 64
    # by the device's HBM bandwidth (GB/s): the H100 SXM's takes the pingpong 128 x 192 tile in clusters of two CTAs
    # sharing B, the H200's (and an unknown one) without clusters; tiles other than 128 x 256 do not depend on it,
    # nor does one SM (no cluster of two)
    h100, h200 = 3352.0, 4915.0
    assert tuple(select_wgrad_config(128, 7168, 2048, 132, h100)) == (128, 192, 132, True, 0, False, 1, False, 2, True)
    assert select_wgrad_config(128, 7168, 2048, 132, h200) == select_wgrad_config(128, 7168, 2048, 132)
    assert tuple(select_wgrad_config(64, 520, 136, 132, h100)) == (128, 128, 132, False, 0, False, 1, False, 1, True)
    assert select_wgrad_config(128, 7168, 2048, 1, h100) == select_wgrad_config(128, 7168, 2048, 1)
    with pytest.raises(ValueError, match=r"P \(pad\)"):
        select_wgrad_config(32, 256, 256)
    with pytest.raises(ValueError, match=r"P \(pad\)"):
        select_wgrad_config(96, 256, 256)



@pytest.mark.parametrize("op, slow_hbm_tile", [
    # the dgrad2's and the row scale's: the cooperative 128 x 256 tile in bands of 64 M tiles
    ("dgrad2", (128, 256, 132, False, 64, False, 1, False, 1, True)),
    # the dgrad's: the wide-rows pingpong tile in clusters of two CTAs sharing the weight tiles (cluster_m = 2,
    # same raster; the H100 SXM is where it was swept)
    ("dgrad", (128, 192, 132, True, 16, False, 1, False, 2, True)),
])
def test_select_slow_hbm_rows_configs(op, slow_hbm_tile):
    # the dgrad2's / row scale's (select_hbm_rows_config) and the dgrad's (select_dgrad_config) tiles: the
    # wide-rows pingpong tile, except on a GPU whose HBM is slower than PINGPONG_MIN_HBM_GBS (the H100 SXM's):
    # slow_hbm_tile; the H200's and an unknown device's the wide-rows tile; outputs of at most BANDED_N_TILES
    # 256-column tiles and tile_M 64 keep select_config's cooperative tile; one SM: no cluster of two
    select = dict(dgrad2=select_hbm_rows_config, dgrad=select_dgrad_config)[op]
    h100, h200 = 3352.0, 4915.0
    assert select(128, 7168, 132) == select_wide_rows_config(128, 7168, 132)
    assert select(128, 7168, 132, h200) == select_wide_rows_config(128, 7168, 132)
    assert tuple(select(128, 7168, 132, h100)) == slow_hbm_tile
    assert select(128, 2048, 132, h100) == select_config(128, 2048, 132)
    assert select(64, 7168, 132, h100) == select_config(64, 7168, 132)
    assert select(128, 7168, 1, h100).cluster_m == 1
    with pytest.raises(ValueError, match=r"P \(pad\)"):
        select(96, 7168, 132, h100)


def test_hbm_gbs_of_device_properties():
    from types import SimpleNamespace

    from csrc_cute.group_gemm.host import hbm_gbs_of

    # an H100 SXM 80GB: 2619 MHz, double data rate, over 5120 bits
    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    assert hbm_gbs_of(h100) == pytest.approx(3352.3, abs=0.1)
    assert hbm_gbs_of(SimpleNamespace(memory_clock_rate=0, memory_bus_width=5120)) is None
    assert hbm_gbs_of(SimpleNamespace()) is None  # a torch without these fields


def test_tiles_hbm_gbs_takes_the_environment_over_the_device(monkeypatch):
    from csrc_cute.group_gemm.config import HBM_GBS_ENV, tiles_hbm_gbs

    h100, h200 = 3352.3, 4915.2
    monkeypatch.delenv(HBM_GBS_ENV, raising=False)
    assert tiles_hbm_gbs(h200) == h200 and tiles_hbm_gbs(None) is None
    monkeypatch.setenv(HBM_GBS_ENV, " ")  # blank: as unset
    assert tiles_hbm_gbs(h200) == h200
    # an H200 told the H100's bandwidth picks the H100's tiles (the A/B the variable is for), and a device that
    # reports no memory clock can be given one
    monkeypatch.setenv(HBM_GBS_ENV, "3350")
    assert tiles_hbm_gbs(h200) == 3350.0 and tiles_hbm_gbs(None) == 3350.0
    assert select_wgrad_config(128, 7168, 2048, 132, tiles_hbm_gbs(h200)) == select_wgrad_config(
        128, 7168, 2048, 132, h100)
    assert select_wgrad_config(128, 7168, 2048, 132, tiles_hbm_gbs(h200)).cluster_m == 2
    monkeypatch.setenv(HBM_GBS_ENV, "1e9")  # the H200's side on an H100
    assert select_wgrad_config(128, 7168, 2048, 132, tiles_hbm_gbs(h100)).cluster_m == 1
    for bad in ("fast", "0", "-3350", "nan", "inf", "3350GB/s"):
        monkeypatch.setenv(HBM_GBS_ENV, bad)
        with pytest.raises(ValueError, match=rf"^\$MOONEP_HBM_GBS must be a positive number of GB/s .* got '{bad}'$"):
            tiles_hbm_gbs(h200)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0].float(), *a[1:]), r"^moonep\.group_gemm: x must be bfloat16"),
        (lambda a: (a[0], a[1].half(), *a[2:]), r"^moonep\.group_gemm: w_home must be bfloat16"),
        (lambda a: (a[0], a[1], a[2].float(), a[3]), r"^moonep\.group_gemm: w_slot must be bfloat16"),
        (lambda a: (a[0].t(), *a[1:]), r"^moonep\.group_gemm: x must be contiguous"),
        (lambda a: (a[0], a[1].transpose(1, 2), *a[2:]), r"^moonep\.group_gemm: w_home must be contiguous"),
        (lambda a: (a[0][None], *a[1:]), r"^moonep\.group_gemm: x must have shape \[\*, \*\]"),
        (lambda a: (a[0], a[1][0], *a[2:]), r"^moonep\.group_gemm: w_home must have shape \[\*, \*, \*\]"),
        (lambda a: (a[0], a[1], a[2][0], a[3]), r"^moonep\.group_gemm: w_slot must have shape \[\*, 64, 64\]"),
        (lambda a: (a[0][:, :56].contiguous(), *a[1:]), r"^moonep\.group_gemm: x has 56 columns but w_home rows are 64"),
        (lambda a: (a[0], a[1], a[2][:, :, :56].contiguous(), a[3]),
         r"^moonep\.group_gemm: w_slot must have shape \[\*, 64, 64\], got \[1, 64, 56\]"),
        (lambda a: (a[0], a[1], a[2], a[3].long()), r"^moonep\.group_gemm: cu_seqlens must have dtype int32"),
        (lambda a: (a[0], a[1], a[2], a[3][:2]),
         r"^moonep\.group_gemm: cu_seqlens must have shape \[3\] \(one entry per group: epn \+ B = 3\)"),
        (lambda a: (a[0], a[1][:0], a[2], a[3][:1]), r"^moonep\.group_gemm: w_home must hold at least one expert"),
        (lambda a: a, r"^moonep\.group_gemm: x must be a CUDA tensor"),
    ],
)
def test_bad_inputs(mutate, match):
    with pytest.raises(ValueError, match=match):
        group_gemm_fwd(*mutate(zero_inputs()))


def test_bad_inner_dims():
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm: Kd must be a positive multiple of 8"):
        group_gemm_fwd(*zero_inputs(kd=60))
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm: Nd must be a positive multiple of 8"):
        group_gemm_fwd(*zero_inputs(nd=60))


def test_dgrad_bad_inputs():
    x, wh, ws, cu = zero_inputs()  # dy [256, Nd=64]
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_dgrad: dy must be bfloat16"):
        group_gemm_dgrad(x.float(), wh, ws, cu)
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_dgrad: dy has 56 columns but the weights have 64"):
        group_gemm_dgrad(x[:, :56].contiguous(), wh, ws, cu)
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_dgrad: cu_seqlens must have shape \[3\]"):
        group_gemm_dgrad(x, wh, ws, cu[:2])
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_dgrad: dy must be a CUDA tensor"):
        group_gemm_dgrad(x, wh, ws, cu)


def test_dgrad2_bad_inputs():
    x, wh, ws, cu = zero_inputs()  # dy [256, Nd=64]
    op = r"^moonep\.group_gemm_dgrad2: "
    with pytest.raises(ValueError, match=op + r"dy_b must be bfloat16 for the CuTe kernel"):
        group_gemm_dgrad2(x, wh, ws, x.float(), wh, ws, cu)
    with pytest.raises(ValueError, match=op + r"w_b_home must have shape \[2, 64, 64\]"):
        group_gemm_dgrad2(x, wh, ws, x, wh[:1], ws, cu)
    with pytest.raises(ValueError, match=op + r"P must be >= 64 for the CuTe kernel"):
        group_gemm_dgrad2(x, wh, ws, x, wh, ws, cu, pad=32)
    with pytest.raises(ValueError, match=op + r"dy_a must be a CUDA tensor"):
        group_gemm_dgrad2(x, wh, ws, x, wh, ws, cu)


def test_wgrad_bad_inputs():
    x, wh, ws, cu = zero_inputs()
    dy = x.clone()
    dwh, dws = wh.clone(), ws.float()  # home gradients bf16 (written), slot gradients fp32 (accumulated)
    op = r"^moonep\.group_gemm_wgrad: "
    with pytest.raises(ValueError, match=op + r"dw_home must be bfloat16"):
        group_gemm_wgrad(x, dy, cu, wh.float(), dws)
    with pytest.raises(ValueError, match=op + r"dw_slot must have dtype float32"):
        group_gemm_wgrad(x, dy, cu, dwh, ws)
    with pytest.raises(ValueError, match=op + r"x must be bfloat16"):
        group_gemm_wgrad(x.float(), dy, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dy must have shape \[256, \*\]"):
        group_gemm_wgrad(x, dy[:128], cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dw_slot must have shape \[\*, 64, 64\]"):
        group_gemm_wgrad(x, dy, cu, dwh, dws[:, :8].contiguous())
    with pytest.raises(ValueError, match=op + r"cu_seqlens must have shape \[3\]"):
        group_gemm_wgrad(x, dy, cu[:2], dwh, dws)
    with pytest.raises(ValueError, match=op + r"x must be a CUDA tensor"):
        group_gemm_wgrad(x, dy, cu, dwh, dws)


def test_wgrad_gather_bad_inputs():
    """group_gemm_wgrad_gather: x [S, Kd] + row_src [N] in place of the rows; dy has the N rows. Checked before
    any device check (CPU tensors suffice); errors name the gathered op."""
    x, wh, ws, cu = zero_inputs()
    src = torch.zeros(256, dtype=torch.int32)
    dy, dwh, dws = x.clone(), wh.clone(), ws.float()
    tokens = x[:100].contiguous()  # S = 100 tokens, N = 256 rows
    op = r"^moonep\.group_gemm_wgrad_gather: "
    for bad, rule in ((src.long(), "dtype int32"), (src.view(16, 16), "shape"),
                      (torch.zeros(512, dtype=torch.int32)[::2], "contiguous"), (src.float(), "dtype int32")):
        with pytest.raises(ValueError, match=op + f"row_src must .*{rule}"):
            group_gemm_wgrad_gather(tokens, bad, dy, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dy must have shape \[128, \*\], got \[256, 64\]"):
        group_gemm_wgrad_gather(tokens, src[:128], dy, cu, dwh, dws)  # one row of dy per entry of row_src
    with pytest.raises(ValueError, match=op + r"x must be bfloat16"):
        group_gemm_wgrad_gather(tokens.float(), src, dy, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"x must be contiguous"):
        group_gemm_wgrad_gather(x.t(), src, dy, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dy must be bfloat16"):
        group_gemm_wgrad_gather(tokens, src, dy.half(), cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dw_home must have shape \[\*, 32, 64\], got \[2, 64, 64\]"):
        group_gemm_wgrad_gather(tokens[:, :32].contiguous(), src, dy, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dw_home must be bfloat16"):
        group_gemm_wgrad_gather(tokens, src, dy, cu, wh.float(), dws)
    with pytest.raises(ValueError, match=op + r"dw_slot must have dtype float32"):
        group_gemm_wgrad_gather(tokens, src, dy, cu, dwh, ws)
    with pytest.raises(ValueError, match=op + r"cu_seqlens must have shape \[3\]"):
        group_gemm_wgrad_gather(tokens, src, dy, cu[:2], dwh, dws)
    with pytest.raises(ValueError, match=op + r"P must be a power of two"):
        group_gemm_wgrad_gather(tokens, src, dy, cu, dwh, dws, pad=96)
    with pytest.raises(ValueError, match=op + r"P must be >= 64 for the CuTe kernel"):
        group_gemm_wgrad_gather(tokens, src, dy, cu, dwh, dws, pad=32)
    with pytest.raises(ValueError, match=op + r"Kd must be a positive multiple of 8"):
        group_gemm_wgrad_gather(tokens[:, :60].contiguous(), src, dy, cu, dwh[:, :60].contiguous(),
                                dws[:, :60].contiguous())
    with pytest.raises(ValueError, match=op + r"x must be a CUDA tensor"):
        group_gemm_wgrad_gather(tokens, src, dy, cu, dwh, dws)
    # the kernel's 32-bit row offsets: x below 2**31 elements (meta tensors: no memory)
    big = torch.empty(2**31 // 64, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=op + r"x must have fewer than 2\*\*31 elements"):
        group_gemm_wgrad_gather(big, src.to("meta"), dy.to("meta"), cu.to("meta"), dwh.to("meta"), dws.to("meta"))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0].float(), *a[1:]), r"x must be bfloat16"),
        (lambda a: (a[0], a[1].half(), *a[2:]), r"w_gate_home must be bfloat16"),
        (lambda a: (a[0], a[1], a[2].float(), *a[3:]), r"w_gate_slot must be bfloat16"),
        (lambda a: (*a[:3], a[3].half(), *a[4:]), r"w_up_home must be bfloat16"),
        (lambda a: (*a[:4], a[4][:, :, :56].contiguous(), a[5]), r"w_up_slot must have shape \[1, 64, 64\], got \[1, 64, 56"),
        (lambda a: (*a[:4], a[4].transpose(1, 2), a[5]), r"w_up_slot must be contiguous"),
        (lambda a: (*a[:3], a[3][:, :, :56].contiguous(), *a[4:]), r"w_up_home must have shape \[2, 64, 64\]"),
        (lambda a: (*a[:4], a[4][:0], a[5]), r"w_up_slot must have shape \[1, 64, 64\], got \[0, 64, 64\]"),
        (lambda a: (a[0][:, :56].contiguous(), *a[1:]), r"w_gate_home must have shape \[\*, 56, \*\]"),
        (lambda a: (*a[:5], a[5][:2]), r"cu_seqlens must have shape \[3\] \(one entry per group: epn \+ B = 3\)"),
        (lambda a: a, r"x must be a CUDA tensor"),
    ],
)
def test_swiglu_bad_inputs(mutate, match):
    from csrc_cute.group_gemm import group_gemm_swiglu

    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_swiglu: " + match):
        group_gemm_swiglu(*mutate(zero_swiglu_inputs()))


def test_row_scale_bad_inputs():
    from csrc_cute.group_gemm import group_gemm_row_scale

    x, wh, ws, cu = zero_inputs()
    rw = torch.ones(x.shape[0])
    op = r"^moonep\.group_gemm_row_scale: "
    with pytest.raises(ValueError, match=op + r"row_w must have dtype float32"):
        group_gemm_row_scale(x, wh, ws, cu, rw.double())
    with pytest.raises(ValueError, match=op + r"row_w must have shape \[256\]"):
        group_gemm_row_scale(x, wh, ws, cu, rw[:128])
    with pytest.raises(TypeError, match=op + r"row_w must be a Tensor"):  # the contract's type error
        group_gemm_row_scale(x, wh, ws, cu, 1.0)
    with pytest.raises(ValueError, match=op + r"w_home must be bfloat16"):
        group_gemm_row_scale(x, wh.half(), ws, cu, rw)
    with pytest.raises(ValueError, match=op + r"x must be a CUDA tensor"):
        group_gemm_row_scale(x, wh, ws, cu, rw)


def test_swiglu_bwd_bad_inputs():
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd

    n, f, hd = 256, 64, 128
    g_y = torch.zeros(n, hd, dtype=torch.bfloat16)
    wdh, wds = torch.zeros(2, f, hd, dtype=torch.bfloat16), torch.zeros(1, f, hd, dtype=torch.bfloat16)
    cu = torch.zeros(3, dtype=torch.int32)
    rw = torch.zeros(n)
    gate, up = torch.zeros(n, f, dtype=torch.bfloat16), torch.zeros(n, f, dtype=torch.bfloat16)
    ok = (g_y, wdh, wds, cu, rw, gate, up)
    for i, bad, match in (
        (0, g_y.float(), r"g_y must be bfloat16"),
        (0, g_y[:, :64].contiguous(), r"w_down_home must have shape \[\*, \*, 64\]"),
        (1, wdh.half(), r"w_down_home must be bfloat16"),
        (2, wds[:, :, :64].contiguous(), r"w_down_slot must have shape \[\*, 64, 128\]"),
        (3, cu[:2], r"cu_seqlens must have shape \[3\]"),
        (4, rw.double(), r"row_w must have dtype float32"),
        (4, rw[:8], r"row_w must have shape \[256\]"),
        (5, gate[:, :32].contiguous(), r"gate must have shape \[256, 64\]"),
        (6, up.float(), r"up must be bfloat16"),
        (6, up.t().contiguous().t(), r"up must be contiguous"),
        (None, None, r"g_y must be a CUDA tensor"),
    ):
        args = list(ok)
        if i is not None:
            args[i] = bad
        with pytest.raises(ValueError, match=r"^moonep\.group_gemm_swiglu_bwd: " + match):
            group_gemm_swiglu_bwd(*args)


def test_wgrad_gather_b_bad_inputs():
    """group_gemm_wgrad_gather_b: dy_src [S, Nd] + row_src [N] in place of dy's rows; x has the N rows.
    Checked before any device check (CPU tensors suffice); errors name the gathered op."""
    x, wh, ws, cu = zero_inputs()
    src = torch.zeros(256, dtype=torch.int32)
    dwh, dws = wh.clone(), ws.float()
    tokens = x[:100].contiguous()  # S = 100 tokens of g_out, N = 256 rows of x
    op = r"^moonep\.group_gemm_wgrad_gather_b: "
    for bad, rule in ((src.long(), "dtype int32"), (src.view(16, 16), "shape"),
                      (torch.zeros(512, dtype=torch.int32)[::2], "contiguous"), (src.float(), "dtype int32")):
        with pytest.raises(ValueError, match=op + f"row_src must .*{rule}"):
            group_gemm_wgrad_gather_b(x, tokens, bad, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"row_src must have one entry per row of x \(N = 256\)"):
        group_gemm_wgrad_gather_b(x, tokens, src[:128], cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"x must be bfloat16"):
        group_gemm_wgrad_gather_b(x.float(), tokens, src, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dy_src must .*bfloat16"):
        group_gemm_wgrad_gather_b(x, tokens.half(), src, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dy_src must be contiguous"):
        group_gemm_wgrad_gather_b(x, tokens.t(), src, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dw_home must have shape \[\*, 64, 32\], got \[2, 64, 64\]"):
        group_gemm_wgrad_gather_b(x, tokens[:, :32].contiguous(), src, cu, dwh, dws)
    with pytest.raises(ValueError, match=op + r"dw_slot must have dtype float32"):
        group_gemm_wgrad_gather_b(x, tokens, src, cu, dwh, ws)
    with pytest.raises(ValueError, match=op + r"cu_seqlens must have shape \[3\]"):
        group_gemm_wgrad_gather_b(x, tokens, src, cu[:2], dwh, dws)
    with pytest.raises(ValueError, match=op + r"P must be a power of two"):
        group_gemm_wgrad_gather_b(x, tokens, src, cu, dwh, dws, pad=96)
    with pytest.raises(ValueError, match=op + r"P must be >= 64 for the CuTe kernel"):
        group_gemm_wgrad_gather_b(x, tokens, src, cu, dwh, dws, pad=32)
    with pytest.raises(ValueError, match=op + r"Nd must be a positive multiple of 8"):
        group_gemm_wgrad_gather_b(x, tokens[:, :60].contiguous(), src, cu, dwh[..., :60].contiguous(),
                                  dws[..., :60].contiguous())
    with pytest.raises(ValueError, match=op + r"x must be a CUDA tensor"):
        group_gemm_wgrad_gather_b(x, tokens, src, cu, dwh, dws)
    # the kernel's 32-bit row offsets: dy_src below 2**31 elements (meta tensors: no memory)
    big = torch.empty(2**31 // 64, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=op + r"dy_src must have fewer than 2\*\*31 elements"):
        group_gemm_wgrad_gather_b(x.to("meta"), big, src.to("meta"), cu.to("meta"), dwh.to("meta"), dws.to("meta"))


def test_swiglu_bwd_gather_bad_inputs():
    """group_gemm_swiglu_bwd_gather: g_out [S, H] + row_src [N] in place of g_y [N, H]; gate, up, row_w have
    the N rows. Checked before any device check (CPU tensors suffice); errors name the gathered op."""
    n, hd, f = 256, 64, 128
    g_out = torch.zeros(100, hd, dtype=torch.bfloat16)  # S = 100 tokens
    src = torch.zeros(n, dtype=torch.int32)
    wdh, wds = torch.zeros(2, f, hd, dtype=torch.bfloat16), torch.zeros(1, f, hd, dtype=torch.bfloat16)
    cu = torch.zeros(3, dtype=torch.int32)
    row_w, gate = torch.zeros(n), torch.zeros(n, f, dtype=torch.bfloat16)
    args = (g_out, src, wdh, wds, cu, row_w, gate, gate.clone())
    op = r"^moonep\.group_gemm_swiglu_bwd_gather: "
    cases = [
        (lambda a: (a[0], a[1].long(), *a[2:]), r"row_src must .*dtype int32"),
        (lambda a: (a[0], a[1].view(16, 16), *a[2:]), r"row_src must .*shape"),
        (lambda a: (a[0], a[1][:128], *a[2:]), r"row_w must have shape \[128\]"),  # N from row_src
        (lambda a: (a[0].float(), *a[1:]), r"g_out must be bfloat16"),
        (lambda a: (a[0].t(), *a[1:]), r"g_out must be contiguous"),
        (lambda a: (*a[:2], a[2][..., :32].contiguous(), *a[3:]), r"w_down_home must have shape \[\*, \*, 64\]"),
        (lambda a: (*a[:3], a[3][:, :64].contiguous(), *a[4:]), r"w_down_slot must have shape \[\*, 128, 64\]"),
        (lambda a: (*a[:4], a[4][:2], *a[5:]), r"cu_seqlens must have shape \[3\]"),
        (lambda a: (*a[:5], a[5].double(), *a[6:]), r"row_w must have dtype float32"),
        (lambda a: (*a[:6], a[6][:, :64].contiguous(), a[7]), r"gate must have shape \[256, 128\]"),
        (lambda a: (*a[:7], a[7].half()), r"up must .*bfloat16"),
    ]
    for mutate, match in cases:
        with pytest.raises(ValueError, match=op + match):
            group_gemm_swiglu_bwd_gather(*mutate(args))
    with pytest.raises(ValueError, match=op + r"P must be >= 64 for the CuTe kernel"):
        group_gemm_swiglu_bwd_gather(*args, pad=32)
    with pytest.raises(ValueError, match=op + r"g_out must be a CUDA tensor"):
        group_gemm_swiglu_bwd_gather(*args)
    # the kernel's 32-bit row offsets: g_out below 2**31 elements (meta tensors: no memory)
    big = torch.empty(2**31 // 64, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=op + r"g_out must have fewer than 2\*\*31 elements"):
        group_gemm_swiglu_bwd_gather(big, *(t.to("meta") for t in args[1:]))
