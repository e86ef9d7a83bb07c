"""Static tile configurations of the grouped-GEMM kernels and how each op picks one (no DSL imports)."""

from __future__ import annotations


class GroupGemmConfig(tuple):
    """Static tile configuration: (tile_m, tile_n, num_sms, pingpong, group_raster). ``pingpong``: the
    kernels whose consumers are cooperative by default (the row kernels: forward, dgrad, dgrad2, row
    scale; the wgrad) run two consumer warp groups that take alternate whole tiles instead, each one's
    epilogue under the other's mainloop (the SwiGLU backward is always pingpong, the fused SwiGLU
    ignores it). ``group_raster`` (the row-grouped kernels): the tiles of each group are walked N tile by
    N tile, all of the group's M tiles side by side, instead of M tile by M tile over every N tile; the
    CTAs running at once then share each weight tile (B) among the group's rows, which read it once
    while it is in L2, where the M-major walk has every CTA wave read the expert's whole weight again
    (``RowTileScheduler.row_tile``). The wgrad ignores it."""

    def __new__(cls, tile_m: int, tile_n: int, num_sms: int, pingpong: bool = False, group_raster: bool = False):
        return super().__new__(cls, (int(tile_m), int(tile_n), int(num_sms), bool(pingpong), bool(group_raster)))

    def __getnewargs__(self):  # pickled (a compile-ahead call, csrc_cute/jit.py) as its values
        return tuple(self)

    tile_m = property(lambda self: self[0])
    tile_n = property(lambda self: self[1])
    num_sms = property(lambda self: self[2])
    pingpong = property(lambda self: self[3])
    group_raster = property(lambda self: self[4])


H100_H200_NUM_SMS = 132


def select_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Pick the tile shape: tile_M divides the group padding P (128 if P >= 128, else 64); cooperative
    consumers (the pingpong option at 128 x 128 / 160 / 192 measured no faster for the forward, dgrad,
    dgrad2 or wgrad at H = 7168, F = 2048 in two runs: results/bench_tiles.json)."""
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


def select_swiglu_config(pad: int, f: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the fused gate/up kernel: tile_M as the forward's; tile_N = 128 columns of h, so a tile
    computes 128 columns of gate *and* of up (two 64 x 128 fp32 accumulators per consumer warp group,
    the register footprint of the forward's 128 x 256 tile)."""
    base = select_config(pad, f, num_sms)
    return GroupGemmConfig(base.tile_m, 128, num_sms)


def select_swiglu_bwd_config(pad: int, f: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the SwiGLU-backward dgrad (pingpong: each consumer warp group holds a whole tile's
    accumulators next to its epilogue's registers): tile_M as the forward's; 160 columns of F where
    that pads F by at most 5% (F = 2048: 13 tiles, the last 128 wide), else 128. The wider tile loads
    less into shared memory per FLOP: 0.91-1.00x the 128-column tile's time at the DESIGN shape
    (results/bench_tiles.json); at 192 columns ptxas spills."""
    base = select_config(pad, 128, num_sms)
    tile_n = 160 if -(-f // 160) * 160 - f <= f // 20 else 128
    return GroupGemmConfig(base.tile_m, tile_n, num_sms)


def select_wgrad_config(pad: int, kd: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile shape of the wgrad kernel: tile_M over Kd, tile_N over Nd; its k tile (64 rows) must divide P."""
    if not isinstance(pad, int) or pad < 16 or pad & (pad - 1):
        raise ValueError(f"P (pad) must be a power of two >= 16, got {pad!r}")
    if pad < 64:
        raise ValueError(
            f"P (pad) = {pad} is smaller than the wgrad kernel's k tile (64 rows): every k tile must lie "
            f"inside one group, so group lengths must be multiples of 64"
        )
    tile_m = 128 if kd > 64 else 64
    tile_n = 256 if nd >= 256 else 128
    return GroupGemmConfig(tile_m, tile_n, num_sms)
