"""Static tile configurations of the grouped-GEMM kernels and how each op picks one (no DSL imports)."""

from __future__ import annotations

import math
import os


class GroupGemmConfig(tuple):
    """Static tile configuration: (tile_m, tile_n, num_sms, pingpong, band_m, tall_m_major, cluster_n,
    dynamic, cluster_m, scheduler_warp).
    ``pingpong``: the kernels whose consumers are cooperative by default (the row kernels: forward, dgrad,
    dgrad2, row scale; the wgrad; the fused SwiGLU) run two consumer warp groups that take alternate whole
    tiles instead, each one's epilogue under the other's mainloop (the SwiGLU backward is always pingpong).
    ``band_m`` (the row-grouped kernels; the wgrad ignores it): 0 walks the tiles M-major (each M tile
    over every N tile); b > 0 walks each group's tiles in bands of up to b M tiles, N tile by N tile
    within a band, so the CTAs that run at once share each weight tile (B) among the band's rows and
    read it while it is in L2, where the M-major walk has every wave of CTAs read the expert's whole
    weight again (``RowTileScheduler.row_tile``). ``tall_m_major`` (with band_m): only groups of at most
    band_m M tiles are walked N-major, each as one band; taller groups keep the M-major walk (the sweep
    found the forward and dgrad faster banded at short groups, slower at tall ones; bench_tiles sweeps it
    for the fused SwiGLU and its backward). ``cluster_n`` (1 or 2; the forward, dgrad, dgrad2, row-scale
    and wgrad kernels): 2 launches clusters of two CTAs that compute the same M tile at two neighbouring N tiles, each
    loading half of every A (rows) tile by TMA multicast into both CTAs' shared memory, so the cluster
    reads each A tile from L2 once for two output tiles (``GroupGemmSm90Base.cta_tiles``). ``dynamic``
    (clusters of one CTA): the persistent CTAs take the tiles in order from one global counter instead of
    every #CTAs-th tile from their block index (``walk.TileWalk``), so an SM that runs its tiles slower does
    not finish the launch last with a fixed share of them; no op chooses it yet (docs/design-notes.md,
    session 29: the pingpong kernels ran more cycles with it). ``cluster_m`` (1 or 2; the forward, dgrad,
    dgrad2, row-scale, fused SwiGLU and SwiGLU-backward kernels and the wgrads, gathered ones included, not with
    ``cluster_n`` = 2 nor ``dynamic``): 2 launches clusters of two CTAs that compute two M tiles of one group
    at the same N tile (the row kernels: a group's tiles in pairs, an odd group's last one at two n tiles, one a
    CTA, ``RowTileScheduler.pair_tile``; the wgrads: two m tiles of Kd of one work item, ``work_item``), each
    loading half of every B tile (the weights; the wgrads' dy^T) by TMA multicast into both, so the pair
    reads each B tile from L2 once. ``scheduler_warp`` (the static walk of the kernels whose producer is one
    warp: not the gathered nor the remote ones, which ignore it): the producer's warp 1 computes each tile's
    coordinates ahead and hands them to the loading warp and the consumers through a shared ring
    (``walk.TileWalk``), so that none computes them between two tiles; False: every warp computes them
    itself."""

    def __new__(cls, tile_m: int, tile_n: int, num_sms: int, pingpong: bool = False, band_m: int = 0,
                tall_m_major: bool = False, cluster_n: int = 1, dynamic: bool = False, cluster_m: int = 1,
                scheduler_warp: bool = True):
        if isinstance(band_m, bool) or int(band_m) < 0:
            raise ValueError(f"GroupGemmConfig: band_m must be an int >= 0, got {band_m!r}")
        if tall_m_major and not band_m:
            raise ValueError("GroupGemmConfig: tall_m_major needs band_m > 0 (the tallest group walked N-major)")
        if isinstance(cluster_n, bool) or cluster_n not in (1, 2):
            raise ValueError(f"GroupGemmConfig: cluster_n must be 1 or 2, got {cluster_n!r}")
        if cluster_n == 2 and int(num_sms) < 2:
            raise ValueError(f"GroupGemmConfig: cluster_n = 2 needs num_sms >= 2 (one cluster), got {num_sms!r}")
        if dynamic and cluster_n != 1:
            raise ValueError("GroupGemmConfig: dynamic needs cluster_n = 1 (a cluster's CTAs would have to take "
                             "their tiles together)")
        if isinstance(cluster_m, bool) or cluster_m not in (1, 2):
            raise ValueError(f"GroupGemmConfig: cluster_m must be 1 or 2, got {cluster_m!r}")
        if cluster_m == 2 and (cluster_n != 1 or dynamic or tall_m_major or int(num_sms) < 2):
            raise ValueError("GroupGemmConfig: cluster_m = 2 needs cluster_n = 1, a static walk, no tall_m_major "
                             f"and num_sms >= 2 (got cluster_n={cluster_n!r}, dynamic={dynamic!r}, "
                             f"tall_m_major={tall_m_major!r}, num_sms={num_sms!r})")
        if cluster_m == 2 and int(band_m) % 2:
            raise ValueError(f"GroupGemmConfig: cluster_m = 2 needs an even band_m (bands of whole M-tile pairs), "
                             f"got {band_m!r}")
        return super().__new__(cls, (int(tile_m), int(tile_n), int(num_sms), bool(pingpong), int(band_m),
                                     bool(tall_m_major), int(cluster_n), bool(dynamic), int(cluster_m),
                                     bool(scheduler_warp)))

    def __getnewargs__(self):  # pickled (a compile-ahead call, csrc_cute/jit.py) as its values
        return tuple(self)

    tile_m = property(lambda self: self[0])
    tile_n = property(lambda self: self[1])
    num_sms = property(lambda self: self[2])
    pingpong = property(lambda self: self[3])
    band_m = property(lambda self: self[4])
    tall_m_major = property(lambda self: self[5])
    cluster_n = property(lambda self: self[6])
    dynamic = property(lambda self: self[7])
    cluster_m = property(lambda self: self[8])
    scheduler_warp = property(lambda self: self[9])


H100_H200_NUM_SMS = 132
# The raster (GroupGemmConfig.band_m, tall_m_major) of the fused SwiGLU and the SwiGLU backward where the
# output has more than BANDED_N_TILES n tiles; the forward stays M-major (the dgrad, dgrad2 and row-scale
# kernels: select_wide_rows_config). Tile sweeps at H = 7168, F = 2048, P = 128 (48 equal groups / 16 x 4096 /
# 48 skewed), each candidate's time over the M-major one's: the fused SwiGLU with only the groups of at most
# 16 M tiles banded 0.97/0.98/0.98 and 0.98/1.00/0.99 in two H200 runs at 456724f / 4d6def9
# (results/bench_tiles_456724f.json, the second with rotated rounds: results/bench_tiles_rotated_h200.log;
# bands of 16 everywhere: 1.00/1.00/1.00 and 1.00/1.00/0.99), but at the board's power cap (bench_tiles
# --sustained-s at eca93ff, results/bench_tiles_eca93ff.json: each candidate 1.5 s back to back) bands of 16
# everywhere took 0.97/0.97/0.96 of the M-major time and short groups alone 0.97/1.00/0.98 (burst, same run:
# 0.97/0.99/0.99 and 0.95/1.00/1.00), so the SwiGLU bands every group; the SwiGLU backward in bands of 16
# 0.99/1.00/0.99 and 0.99/1.00/0.96 (short groups alone the same within 1%). The forward (one weight, 8 n
# tiles) was faster banded only at 48 equal groups in the d6c9627 run, elsewhere at most 1% faster and up
# to 15% slower. At 48 equal groups (11 M tiles) the three rasters walk the same tiles in the same order,
# and their times still differed by up to 4%: that is the resolution of one sweep. The fused SwiGLU's
# pingpong option (then 128 x 96) took 1.04-1.05x the banded cooperative tile's time at the cap in bands of 16,
# 1.07-1.09x M-major (results/bench_tiles_6127f68.json); with one wgmma for gate and up (4240cdb) it ran at
# 128 x 64 (each half whole 128-byte swizzle atoms) and took 1.00-1.03x the banded cooperative tile's time at
# the cap (results/bench_tiles_4240cdb_swiglu.json); since the stage is tiled from the load's swizzle atom
# (base.widened_b_stages) it is 128 x 96 again, QuACK gemm_gated's tile (96 columns of gate and of up), and
# took 1.03-1.04x the banded cooperative tile's time in bands of 16, 1.06-1.07x M-major, in sustained runs
# (results/bench_tiles_b3ef4c5_swiglu.json), where the banded cooperative tile took 1.003/0.986/0.982x QuACK's.
SWIGLU_BAND = (16, False)
SWIGLU_BWD_BAND = (16, False)
BANDED_N_TILES = 8


def _wide(nd: int, tile_n: int) -> bool:
    """Whether an output of `nd` columns has more than BANDED_N_TILES tiles of `tile_n` columns."""
    return -(-nd // tile_n) > BANDED_N_TILES


def _row_band(nd: int, tile_n: int, band: tuple[int, bool]) -> tuple[int, bool]:
    """(band_m, tall_m_major) of an output of `nd` columns in tiles of `tile_n`: `band` where it is `_wide`,
    else the M-major raster."""
    return band if _wide(nd, tile_n) else (0, False)


# The peak HBM bandwidth (GB/s) from which the dgrad2 and the row-scaled forward take pingpong tiles and the dgrad
# and the wgrads run without weight-sharing clusters: the H200's ~4.8 TB/s does, the H100 SXM's ~3.35 TB/s does
# not (select_wgrad_config, select_hbm_rows_config, select_dgrad_config).
PINGPONG_MIN_HBM_GBS = 4000.0

# The environment variable that names the peak HBM bandwidth (GB/s) the choices gated on PINGPONG_MIN_HBM_GBS are
# made for, in place of the device's (read with the device's properties, once a process; host._device_info).
# Why: those gates were measured on an H100 and an H200 only, so a user of another part (or of one whose
# properties report no memory clock) can pick a side; and an A/B of the two sides runs on one GPU with one kernel
# cache (3350 on an H200 runs the H100's tiles; a copied tree with the constant edited recompiled every kernel).
HBM_GBS_ENV = "MOONEP_HBM_GBS"


def tiles_hbm_gbs(device_gbs: float | None) -> float | None:
    """The peak HBM bandwidth (GB/s; None: unknown) the tiles are chosen for: ``$MOONEP_HBM_GBS`` where set (a
    positive finite number), else ``device_gbs``, the device's."""
    value = os.environ.get(HBM_GBS_ENV, "").strip()
    if not value:
        return device_gbs
    try:
        gbs = float(value)
    except ValueError:
        gbs = math.nan
    if not (math.isfinite(gbs) and gbs > 0):
        raise ValueError(f"${HBM_GBS_ENV} must be a positive number of GB/s (the peak HBM bandwidth the GEMM "
                         f"tiles are chosen for), got {value!r}")
    return gbs


def _slow_hbm(hbm_gbs: float | None) -> bool:
    """Whether a device of peak HBM bandwidth ``hbm_gbs`` (GB/s; None: unknown) is below PINGPONG_MIN_HBM_GBS,
    where the dgrad2 and the row-scaled forward take cooperative 128 x 256 tiles (fewer bytes per MMA) over
    pingpong and the dgrad, the wgrads and the SwiGLU backward share their B tiles in clusters."""
    return hbm_gbs is not None and hbm_gbs < PINGPONG_MIN_HBM_GBS


def _share_b_in_clusters(hbm_gbs: float | None, num_sms: int) -> bool:
    """Whether the dgrad, the wgrads and the SwiGLU backward run clusters of two CTAs sharing each B tile
    (``cluster_m`` = 2): where the HBM is slow (``_slow_hbm``) and a cluster of two fits ``num_sms``."""
    return _slow_hbm(hbm_gbs) and num_sms >= 2


def select_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Pick the tile shape: tile_M divides the group padding P (128 if P >= 128, else 64); cooperative
    consumers (the pingpong option at 128 x 128 / 160 / 192 measured no faster for the forward, dgrad,
    dgrad2 or wgrad at H = 7168, F = 2048 in two runs: results/bench_tiles_d6c9627.json; the dgrad and the
    row-scaled forward ran it at wide outputs in session 18: results/bench_tiles_3abd0d1.json); the M-major raster."""
    if not isinstance(pad, int) or pad < 16 or pad & (pad - 1):
        raise ValueError(f"P (pad) must be a power of two >= 16, got {pad!r}")
    tile_m = 128 if pad >= 128 else 64
    if pad < tile_m:
        raise ValueError(
            f"P (pad) = {pad} is smaller than the smallest supported tile_M ({tile_m}): every M tile "
            f"must lie inside one group, so group lengths must be multiples of {tile_m}"
        )
    tile_n = 256 if nd >= 256 else 128
    return GroupGemmConfig(tile_m, tile_n, num_sms)


# The dgrad and the row-scaled forward (the down projection) where the output has more than BANDED_N_TILES
# 256-column tiles and tile_M is 128: pingpong 128 x 192 (each consumer warp group a whole tile, its epilogue
# under the other's mainloop) in bands of 16 M tiles (WIDE_ROWS_BAND), chosen by the time per call at the
# board's power cap, where a training step runs (results/bench_sustained.json). Two H200 sweeps, H = 7168,
# F = 2048, P = 128, 48 equal / 16 x 4096 / 48 skewed groups, each candidate launched back to back for 1.5 s
# (bench_tiles --sustained-s): at eca93ff (results/bench_tiles_eca93ff.json) the banded pingpong tile took
# 0.92/0.93/0.92 of the M-major pingpong tile's time at the cap for the dgrad and 0.93/0.93/0.94 for the
# row-scaled forward, 0.96/0.97/0.96 and 0.98/0.97/0.98 of the cooperative 128 x 256 tile in bands of 64,
# at 1388-1448 MHz where the M-major pingpong tile ran at 1286-1316 MHz (at ec8e04b,
# results/bench_tiles_ec8e04b.json, without the banded pingpong candidates: cooperative banded 0.96-0.97x
# M-major pingpong). In the burst timing (the board below its cap) the M-major pingpong tile was 0.5-3% faster
# than the banded one and 3-6% faster than the cooperative banded tile (as in session 18's sweeps,
# results/bench_tiles_3abd0d1.json, bench_tiles_fb51b4d.json, which chose it). The dgrad2 (two operand pairs,
# Kd = H) takes the same tile since session 21 where HBM is fast (select_hbm_rows_config): at f5d15ce
# (results/bench_tiles_f5d15ce.json, after the pingpong turn change and the first-k-block overwrite) it took
# 0.97/0.97/0.97 of the previous choice's time at the cap (cooperative 128 x 256 in bands of 64 in clusters of
# two CTAs, sessions 17-18: results/bench_tiles_456724f.json, bench_tiles_b179bdb.json) and 0.97/0.99/0.97 in
# bursts; QuACK's K = 2F GEMM took 1.017/1.011/1.031x its time at the cap, 1.001/0.977/1.017x in bursts.
WIDE_ROWS_PINGPONG_TILE_N = 192
WIDE_ROWS_BAND = (16, False)


def select_wide_rows_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the dgrad (``nd`` = its output's Kd columns), and of the dgrad2 and the row-scaled forward where
    HBM is fast (``select_hbm_rows_config``): ``select_config``'s, or pingpong 128 x WIDE_ROWS_PINGPONG_TILE_N in
    WIDE_ROWS_BAND's raster where that has tile_M 128 and more than BANDED_N_TILES n tiles."""
    base = select_config(pad, nd, num_sms)
    if base.tile_m == 128 and _wide(nd, base.tile_n):
        return GroupGemmConfig(128, WIDE_ROWS_PINGPONG_TILE_N, num_sms, True, *WIDE_ROWS_BAND)
    return base


# The dgrad2 (two operand pairs: K = 2F) and the row-scaled forward on a GPU whose HBM moves less than
# PINGPONG_MIN_HBM_GBS: the cooperative 128 x 256 tile in bands of SLOW_HBM_ROWS_BAND M tiles in place of the
# wide-rows pingpong tile. On an H100 80GB HBM3 (session 32; 48 equal / 16 x 4096 / 48 skewed groups), each
# time over the pingpong tile's at the power cap (in bursts): the dgrad2 0.94/0.96/0.91x (0.86/0.87/0.94x),
# and 0.98/0.96/0.93x QuACK's K = 2F GEMM at the cap where the pingpong tile took 1.04/1.00/1.02x
# (results/bench_tiles_session32_h100.json); without the band (M-major) 1.4-1.7x. The row-scaled forward
# 0.98/0.96/0.97x (1.01/1.00/1.07x; results/bench_tiles_session32_h100_rows.json). The dgrad keeps the pingpong
# tile there: 1.01/0.99/0.98x at the cap, 1.02/1.06/1.01x in bursts. With K = 2F a tile's mainloop is twice
# the dgrad's, so hiding the epilogue under the next tile's matters half as much, and where HBM is slow the
# wider tile's fewer bytes per MMA decide (as for the wgrads). On the H200 the pingpong tile stays (the dgrad2
# in session 21: 0.97x the cooperative banded tile's time at the cap).
SLOW_HBM_ROWS_BAND = 64


def select_hbm_rows_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS,
                           hbm_gbs: float | None = None) -> GroupGemmConfig:
    """Tile of the dgrad2 and the row-scaled forward (``nd`` = the output's columns): ``select_wide_rows_config``'s,
    or, where that is the pingpong tile and the device's HBM bandwidth ``hbm_gbs`` (GB/s; None: unknown) is
    below PINGPONG_MIN_HBM_GBS, the cooperative 128 x 256 tile in bands of SLOW_HBM_ROWS_BAND M tiles."""
    wide = select_wide_rows_config(pad, nd, num_sms)
    if wide.pingpong and _slow_hbm(hbm_gbs):
        return GroupGemmConfig(128, 256, num_sms, False, SLOW_HBM_ROWS_BAND)
    return wide


# The dgrad on a GPU whose HBM moves less than PINGPONG_MIN_HBM_GBS: the wide-rows pingpong tile in clusters of two
# CTAs sharing each weight tile (GroupGemmConfig.cluster_m = 2: two M tiles of one group at one n tile, each CTA
# loading half of the weight tile into both). Measured on an H100 80GB HBM3 only (session 33; the gate stands for
# the boards swept, not for a bandwidth argument: the H200 keeps the tile its sweeps chose until it is swept
# with clusters, as A-sharing clusters there made the pingpong kernels 0.99-1.15x slower). 48 equal / 16 x 4096
# / 48 skewed groups, bench_tiles --sustained-s 1.5 at 8f342f5 (results/bench_tiles_session33_h100.json): at the
# power cap 0.98/0.95/0.98x the unclustered tile's time and 1.01/0.99/1.02x QuACK's (unclustered 1.03/1.04/1.05x),
# in bursts 1.00/0.96/1.00x. Under ncu with clocks free (48 equal groups, the version that paired M tiles 2q,
# 2q + 1 of the whole output, results/ncu_gemm_session33_h100_equal.json) the clustered kernel kept the tensor
# pipe busy 97.7% of its cycles (unclustered 95.5%, QuACK 99.1%) and its SMs' busy cycles within 1.4% of each
# other (3.4%); pairs across group ends read 15% more from DRAM at 48 skewed groups (_skewed.json), hence
# pairs within a group (RowTileScheduler.pair_tile). The dgrad2 keeps its cooperative tile there (clustered:
# 1.01/0.99/1.03x its time at the cap), and the row scale was not swept with clusters.
def select_dgrad_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS,
                        hbm_gbs: float | None = None) -> GroupGemmConfig:
    """Tile of the dgrad (``nd`` = its output's Kd columns): ``select_wide_rows_config``'s, in clusters of two
    CTAs sharing the weight tiles where that is the pingpong tile and the device's HBM bandwidth ``hbm_gbs``
    (GB/s; None: unknown) is below PINGPONG_MIN_HBM_GBS."""
    wide = select_wide_rows_config(pad, nd, num_sms)
    if wide.pingpong and _share_b_in_clusters(hbm_gbs, num_sms):
        return GroupGemmConfig(wide.tile_m, wide.tile_n, num_sms, True, wide.band_m, cluster_m=2)
    return wide


# The fused SwiGLU (plain and gathered) runs without clusters. Sharing its gate and up tiles in clusters of two CTAs
# (cluster_m = 2, session 49; B is two thirds of a stage's bytes) took, on an H100 80GB HBM3 at the power cap,
# 1.00/0.99/1.00x (plain) and 0.98/0.98/0.99x (gathered) the unclustered tile's time at 48 equal / 16 x 4096 / 48
# skewed groups (results/bench_tiles_session49_h100_swiglu_clusters.json), and the layer's step with its gathered
# SwiGLU clustered 27.31 against 27.30 ms (results/bench_peers_session49_h100_swiglu_cluster_layer_ab.json): within
# the spread, so the simpler launch stays. Not yet swept on an H200, where that kernel ran the layer's step at its
# lowest clock (1.17 GHz, docs/design-notes.md, session 24).
def select_swiglu_config(pad: int, f: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the fused gate/up kernel: tile_M as the forward's; tile_N = 128 columns of h, so a tile
    computes 128 columns of gate *and* of up (one 64 x 256 fp32 accumulator per consumer warp group,
    one wgmma a k block: the forward's 128 x 256 tile); in SWIGLU_BAND's raster where F has more
    than BANDED_N_TILES such tiles."""
    base = select_config(pad, f, num_sms)
    return GroupGemmConfig(base.tile_m, 128, num_sms, False, *_row_band(f, 128, SWIGLU_BAND))


def select_swiglu_bwd_config(pad: int, f: int, num_sms: int = H100_H200_NUM_SMS,
                             hbm_gbs: float | None = None) -> GroupGemmConfig:
    """Tile of the SwiGLU-backward dgrad (pingpong: each consumer warp group holds a whole tile's
    accumulators next to its epilogue's registers): tile_M as the forward's; 160 columns of F where
    that pads F by at most 5% (F = 2048: 13 tiles, the last 128 wide), else 128. The wider tile loads
    less into shared memory per FLOP: 0.91-1.00x the 128-column tile's time at the DESIGN shape
    (results/bench_tiles_d6c9627.json). Where the device's HBM moves less than PINGPONG_MIN_HBM_GBS
    (``hbm_gbs``, GB/s; None: unknown) and tile_M is 128, 192 columns (QuACK gemm_dgated's tile: 11 n tiles at
    F = 2048) in clusters of two CTAs sharing each W_down tile, where 192 pads F by at most 5%: see
    WIDE_SWIGLU_BWD_TILE_N. In SWIGLU_BWD_BAND's raster where F has more than BANDED_N_TILES n tiles."""
    base = select_config(pad, 128, num_sms)
    if base.tile_m == 128 and _share_b_in_clusters(hbm_gbs, num_sms) and _pads_at_most_5pct(f, WIDE_SWIGLU_BWD_TILE_N):
        return GroupGemmConfig(128, WIDE_SWIGLU_BWD_TILE_N, num_sms, False,
                               *_row_band(f, WIDE_SWIGLU_BWD_TILE_N, SWIGLU_BWD_BAND), cluster_m=2)
    tile_n = 160 if _pads_at_most_5pct(f, 160) else 128
    return GroupGemmConfig(base.tile_m, tile_n, num_sms, False, *_row_band(f, tile_n, SWIGLU_BWD_BAND))


def _pads_at_most_5pct(f: int, tile_n: int) -> bool:
    """Whether tiles ``tile_n`` wide cover ``f`` columns with at most 5% of them past f."""
    return -(-f // tile_n) * tile_n - f <= f // 20


# The SwiGLU backward's tile_N where the HBM is slow (select_swiglu_bwd_config): 192 columns in clusters sharing
# W_down, its shared-memory epilogue in 64 x 32 TMA sub-tiles computed 16 columns at a time (epi_math_n). On an
# H100 80GB HBM3 (session 36, bench_tiles --sustained-s 1.5 --idle-s 0.5; 48 equal / 16 x 4096 / 48 skewed groups;
# results/bench_tiles_session36_h100_swiglu_bwd_192.json), each time over the 160-column tile's at the power cap:
# plain 0.98/0.96/1.02x, gathered 0.95/0.92/0.96x; QuACK gemm_dgated's time over it 1.01/1.02/1.00x (plain) and
# 1.09/1.10/1.14x (gathered), where the 160-column tile's was 0.99/0.98/1.02x and 1.03/1.02/1.09x. Session 35's
# 192-column kernel in 64 x 16 TMA sub-tiles took 1.04-1.25x (results/bench_tiles_session35_h100_swiglu_bwd_wide.json):
# those sub-tiles doubled the epilogue's round trips and read 1.7x the DRAM bytes (ncu at 128 x 160: 4.0 -> 6.7 GB,
# results/ncu_gemm_session36_h100_swiglu_bwd_subtiles.json). The H200 keeps 160 columns until it is swept.
WIDE_SWIGLU_BWD_TILE_N = 192


# The wgrad (and the gathered-A wgrads, the layer's three) at tile_M 128 where Nd >= 256: pingpong 128 x 192 in
# place of the cooperative 128 x 256, in clusters of two CTAs sharing each B (dy^T) tile (cluster_m = 2, two m
# tiles of one work item) on a GPU whose HBM moves less than PINGPONG_MIN_HBM_GBS (the H100 SXM's ~3.35 TB/s;
# the gate names the board swept, as the dgrad's), without clusters where it moves at least that (the H200's
# ~4.8 TB/s) or does not say. On an H100 80GB HBM3 at 02108d0 (session 34, bench_tiles --sustained-s 1.5;
# 48 equal / 16 x 4096 / 48 skewed groups; results/bench_tiles_session34_h100_wgrad.json), each time over the
# cooperative 128 x 256 tile's at the power cap: the wgrad 0.95/1.00/0.94x, the gathered wgrad 0.96/0.98/0.94x,
# the transposed gathered wgrad 0.96/0.98/0.94x; QuACK's time over it 1.05/1.10/1.11x (wgrad) and
# 1.05/1.05/1.04x (gathered), where the cooperative tile's was 0.99/1.10/1.04x and 1.00/1.02/0.98x. Unclustered,
# the pingpong tile took 1.00-1.35x the cooperative one's time in that run (as in session 31's, below); why
# sharing B turns that around was not profiled (the pair reads each B tile from L2 once, and session 31's ncu
# found the unclustered pingpong tile waiting on memory). The cooperative tile in clusters sharing B: 0.97-1.01x
# its unclustered time. The H200 keeps its unclustered pingpong tile until it is swept with clusters. H200 sweeps
# of session 18 at H = 7168, F = 2048, P = 128 (48 equal / 16 x 4096 / 48 skewed groups; rotated rounds): the
# wgrad 0.94/0.98/0.97 and 0.93/1.00/0.96 of the cooperative tile's time (results/bench_tiles_fb51b4d.json,
# bench_tiles_b179bdb.json), the gathered wgrad 0.93/0.94/0.95
# (bench_tiles_b179bdb.json), and at the power cap 0.95/1.00/0.96 (results/bench_tiles_4a8c9c5_wgrad_gather.json);
# with the A tiles shared in a cluster the pingpong wgrad was 1.10-1.15x slower. On an H100 80GB HBM3 (session
# 31, results/bench_tiles_session31_h100.json, at the cap) the pingpong tile took 1.02/0.99/1.35x the
# cooperative one's time for the wgrad and 1.17/1.30/1.12x for the gathered wgrad; under ncu the pingpong
# wgrad at 48 skewed groups read L2 at a 42.5% hit rate with DRAM 80% busy (QuACK's 128 x 192 pingpong tile in
# clusters sharing B: 68%, results/ncu_gemm_session31_h100.json): there the kernel waits on HBM, and the
# cooperative tile loads 9% fewer bytes per MMA.
WGRAD_PINGPONG_TILE_N = 192


def select_wgrad_config(pad: int, kd: int, nd: int, num_sms: int = H100_H200_NUM_SMS,
                        hbm_gbs: float | None = None) -> GroupGemmConfig:
    """Tile shape of the wgrad kernel: tile_M over Kd, tile_N over Nd (cooperative; pingpong 128 x
    WGRAD_PINGPONG_TILE_N where that would be 128 x 256, in clusters sharing B where the device's HBM bandwidth
    ``hbm_gbs`` (GB/s; None: unknown) is below PINGPONG_MIN_HBM_GBS); its k tile (64 rows) must divide P."""
    if not isinstance(pad, int) or pad < 16 or pad & (pad - 1):
        raise ValueError(f"P (pad) must be a power of two >= 16, got {pad!r}")
    if pad < 64:
        raise ValueError(
            f"P (pad) = {pad} is smaller than the wgrad kernel's k tile (64 rows): every k tile must lie "
            f"inside one group, so group lengths must be multiples of 64"
        )
    tile_m = 128 if kd > 64 else 64
    tile_n = 256 if nd >= 256 else 128
    if tile_m == 128 and tile_n == 256:
        cluster_m = 2 if _share_b_in_clusters(hbm_gbs, num_sms) else 1
        return GroupGemmConfig(128, WGRAD_PINGPONG_TILE_N, num_sms, pingpong=True, cluster_m=cluster_m)
    return GroupGemmConfig(tile_m, tile_n, num_sms)
