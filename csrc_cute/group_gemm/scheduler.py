"""Tile schedulers: which output tiles a persistent CTA walks and what each needs (group, k tiles).

``RowTileScheduler`` (forward, dgrad, the fused row kernels): every group length is a multiple of the
padding P and tile_M divides P, so each M tile of the output lies in exactly one group; tiles (M-major
raster, or N-major within bands of a group's M tiles: ``GroupGemmConfig.band_m``) are strided over
min(#tiles, #SMs) CTAs and a tile's group is the number of group ends ``cu[g] <= m0`` (``m0`` = first
row of the tile), counted by one warp with a ballot over ``cu_seqlens`` 32 entries at a time (no host
sync). A tile whose group reaches G lies past the last group: no loads, no MMA, zeros. In clusters sharing B
(``GroupGemmConfig.cluster_m`` = 2) the walk hands out pairs of M tiles (``pair_tile``).

``GroupTileScheduler`` (wgrad): work items (group, m tile, n tile), group-major, strided over the CTAs;
an item's k tiles are its group's rows / tile_k, read from ``cu_seqlens`` on the device.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..warp import warp_incl_scan, warp_sum


class RowTileScheduler:
    """Mixin of the row-grouped kernels (with ``GroupGemmSm90Base``). Its ``load_tile`` reads the
    kernel's ``p.cu_seqlens``, ``p.num_n_tiles``, ``p.num_tiles``, ``p.k_tiles`` and the B loads
    ``p.home_rings`` / ``p.slot_rings`` (indices into the B operands: group g < epn reads the home
    weights' expert g, a slot group the slot weights' g - epn)."""

    @cute.jit
    def row_tile(self, cu_seqlens: cute.Tensor, tile: cutlass.Int32, num_n_tiles: cutlass.Int32):
        """Tile ``tile`` of a row-grouped kernel -> (m tile, n tile, group). M-major raster: tile = m x
        #n tiles + n. With ``band_m`` = b the tiles of a group (the same range of indices: its M tiles
        times #n tiles) are walked in bands of up to b M tiles, N-major within a band, so CTAs that run
        at once read the same weight tiles (groups lie on M-tile boundaries: their ends are multiples of
        P, which tile_M divides); with ``tall_m_major`` only groups of at most b M tiles are (each one
        band). Past the last group: M-major. With ``cluster_n`` = 2 the walk's n tiles are pairs of n tiles
        (``_row_tiles``) and each CTA of the cluster takes its own of the pair (``cluster_rank``)."""
        m_idx = tile // num_n_tiles
        n_idx = tile % num_n_tiles
        g = self.tile_group(cu_seqlens, m_idx * self.tile_m)
        if cutlass.const_expr(self.band_m > 0):
            if g < cute.size(cu_seqlens, mode=[0]):
                first = cutlass.Int32(0)
                if g > 0:
                    first = cu_seqlens[g - 1] // self.tile_m
                local = tile - first * num_n_tiles  # in [0, group's M tiles x #n tiles)
                if cutlass.const_expr(self.tall_m_major):
                    if cu_seqlens[g] // self.tile_m - first <= self.band_m:  # a short group: one band
                        m_idx, n_idx = self.band_tile(cu_seqlens, g, first, local, num_n_tiles)
                else:
                    m_idx, n_idx = self.band_tile(cu_seqlens, g, first, local, num_n_tiles)
        if cutlass.const_expr(self.cluster_n > 1):
            n_idx = n_idx * self.cluster_n + self.cluster_rank()
        return m_idx, n_idx, g

    @cute.jit
    def pair_tile(self, p, tile: cutlass.Int32):
        """``cluster_m`` = 2: tile ``tile`` of the walk -> (this CTA's M tile, n tile, group: G past the last
        group; whether it is a lone tile). The walk's tiles are a group's M tiles in pairs at one n tile (its
        first two, its next two, ...), both CTAs reading one weight tile (each loads half of it into both),
        and, where the group has an odd number of M tiles, its last M tile at two n tiles (a lone tile: the
        cluster's CTAs take its n tiles 2s and 2s + 1, each loading its own weight tile whole: ``load_b_tile``).
        Group h then holds (t_h // 2) x #n + (t_h % 2) x ceil(#n / 2) tiles (``pair_group``), one range of tile
        numbers walked in bands of up to max(``band_m`` / 2, 1) pairs, N-major within a band (``band_pair``);
        the groups one after another, then the rows past the last group in pairs, M-major (tile = pair x #n +
        n). A lone last M tile of an odd group had a pair of its own before (session 39), whose second CTA
        multiplied zeros: at 48 skewed groups (17 of them odd) 3% of the dgrad's tile slots. With an odd
        number of n tiles the lone tile's last step has one n tile: the second CTA gets the M tile past the
        output's last (``_row_tiles`` counts up to (#M tiles + G + 1) / 2 pairs of n tiles), as do either CTA's
        pairs past the last group's: its A loads read past A's end (TMA zero fill) and its stores are
        dropped. Why not pair M tiles 2q, 2q + 1 of the whole output: a pair across a group end loads two
        weight tiles out of either group's band, and at 48 skewed groups (22 odd ones) that read 15% more
        from DRAM than without clusters (ncu, session 33)."""
        num_n_tiles = p.num_n_tiles
        g, first_tile, first_item = self.pair_group(p.cu_seqlens, tile, num_n_tiles)
        num_m_tiles = cutlass.Int32(cute.ceil_div(self.output_rows(p), self.tile_m))
        local = tile - first_item
        m_idx, n_idx = cutlass.Int32(0), cutlass.Int32(0)
        lone = cutlass.Boolean(False)
        end_tile = num_m_tiles  # past the last group: the rows to the output's end
        if g < p.num_groups:
            end_tile = p.cu_seqlens[g] // self.tile_m
            m_idx, n_idx, lone = self.band_pair(first_tile, end_tile, local, num_n_tiles)
        else:  # M-major pairs
            pair = local // num_n_tiles
            n_idx = local - pair * num_n_tiles
            m_idx = first_tile + 2 * pair + self.cluster_rank()
        if m_idx >= end_tile:
            m_idx = num_m_tiles
        return m_idx, n_idx, g, lone

    @cute.jit
    def band_pair(self, first_tile, end_tile, local, num_n_tiles: cutlass.Int32):
        """``pair_tile``'s tile ``local`` of the group whose M tiles are [``first_tile``, ``end_tile``) -> (this
        CTA's M tile, n tile, whether it is the lone tile). A band of h pairs takes its n tiles two at a time,
        2h tiles a step (the h pairs at n tile 2s, then at 2s + 1), and the group's last band adds its lone
        tile to each step (2h + 1 tiles, the lone tile last), so both CTAs of the lone tile read weight
        tiles that the band's pairs read at the same time. A lone tile's second n tile past the last: the
        group's end (``pair_tile`` moves it past the output)."""
        band = max(self.band_m // 2, 1)
        tiles = end_tile - first_tile
        pairs = tiles // 2
        bands = cutlass.max((pairs + band - 1) // band, 1)
        b = cutlass.min(local // (band * num_n_tiles), bands - 1)
        in_band = local - b * band * num_n_tiles
        height = cutlass.min(pairs - b * band, band)  # the band's pairs (0: a group of one M tile)
        band_lone = cutlass.select_(b == bands - 1, tiles - 2 * pairs, 0)  # 1: the band takes the lone tile
        step = in_band // (2 * height + band_lone)
        r = in_band - step * (2 * height + band_lone)
        rank = self.cluster_rank()
        is_lone = r >= height * cutlass.min(num_n_tiles - 2 * step, 2)
        col = cutlass.select_(r >= height, 1, 0)
        # the lone tile follows the band's pairs: row 2 x pairs of the group, its CTAs at n tiles 2s, 2s + 1
        n_idx = 2 * step + cutlass.select_(is_lone, rank, col)
        lone_past = n_idx >= num_n_tiles  # the lone tile's second CTA past the last n tile: past the group
        pair = b * band + cutlass.select_(is_lone, height, r - col * height)
        m_idx = first_tile + 2 * pair + cutlass.select_(is_lone, cutlass.select_(lone_past, 1, 0), rank)
        n_idx = cutlass.min(n_idx, num_n_tiles - 1)
        return m_idx, n_idx, is_lone

    def output_rows(self, p):
        """The rows of the kernel's output (``pair_tile``'s M tiles cover them): its C tensor's."""
        return cute.size(p.mC, mode=[0])

    @cute.jit
    def pair_group(self, cu_seqlens: cute.Tensor, tile: cutlass.Int32, num_n_tiles: cutlass.Int32):
        """``pair_tile``'s tile ``tile`` -> (its group, G past the last group; the group's first M tile; the
        group's first tile). Group h holds (t_h // 2) x #n + (t_h % 2) x ceil(#n / 2) tiles of its t_h M tiles,
        so groups 0..h hold #n x (e_h - o_h) / 2 + o_h x ceil(#n / 2), e_h its end in M tiles and o_h how many
        of groups 0..h have an odd t (a warp scan); the group of ``tile`` is the number of groups whose tiles
        end at or before it, and its first tile the largest such end (warp reductions: uniform registers).
        One warp."""
        lane = cute.arch.lane_idx()
        num_groups = cute.size(cu_seqlens, mode=[0])
        half_n = (num_n_tiles + 1) // 2
        g = cutlass.Int32(0)
        first_item = cutlass.Int32(0)
        odd_total = cutlass.Int32(0)  # odd groups before this chunk of 32
        for base in cutlass.range(0, num_groups, 32, unroll=1):
            idx = base + lane
            valid = idx < num_groups
            at = cutlass.min(idx, num_groups - 1)
            end = cu_seqlens[at] // self.tile_m
            start = cutlass.select_(at > 0, cu_seqlens[cutlass.max(at - 1, 0)] // self.tile_m, 0)
            odd = cutlass.select_(valid, (end - start) & 1, 0)
            odd_to = odd_total + warp_incl_scan(odd, lane)  # odd groups up to idx
            items_end = num_n_tiles * ((end - odd_to) // 2) + odd_to * half_n
            before = valid & (items_end <= tile)
            g = g + cute.arch.popc(cute.arch.vote_ballot_sync(before))
            last_end = cute.arch.warp_redux_sync(cutlass.select_(before, items_end, 0), "max")
            first_item = cutlass.max(first_item, last_end)
            odd_total = odd_total + warp_sum(odd)
        first_tile = cutlass.Int32(0)
        if g > 0:
            first_tile = cu_seqlens[g - 1] // self.tile_m
        return g, first_tile, first_item

    @cute.jit
    def band_tile(self, cu_seqlens: cute.Tensor, g, first, local, num_n_tiles: cutlass.Int32):
        """Tile ``local`` of group ``g`` whose M tiles start at ``first`` walked in bands of ``band_m`` M tiles,
        N-major within a band -> (M tile, n tile)."""
        band = local // (self.band_m * num_n_tiles)
        band_first = first + band * self.band_m
        end = cu_seqlens[g] // self.tile_m
        # the band's M tiles: band_m, or what is left of the group (>= 1: it holds the tile)
        height = cutlass.min(self.band_m, end - band_first)
        in_band = local - band * self.band_m * num_n_tiles
        n_idx = in_band // height
        return band_first + (in_band - n_idx * height), n_idx

    @cute.jit
    def tile_group(self, cu_seqlens: cute.Tensor, row0: cutlass.Int32) -> cutlass.Int32:
        """Index of the group holding row ``row0`` (== G when past the last group). One warp."""
        lane = cute.arch.lane_idx()
        num_groups = cute.size(cu_seqlens, mode=[0])
        g = cutlass.Int32(0)
        for base in cutlass.range(0, num_groups, 32, unroll=1):
            idx = base + lane
            hit = cutlass.Boolean(False)
            if idx < num_groups:
                hit = cu_seqlens[idx] <= row0
            g = g + cute.arch.popc(cute.arch.vote_ballot_sync(hit))
        return g

    @cute.jit
    def count_groups(self, p):
        """Sets ``p.num_groups`` (G, from the length of ``cu_seqlens``) and, in clusters sharing B, ``p.num_tiles``
        to the pair walk's length (``pair_tile``): its groups' tiles (``pair_group`` of a tile past them all: the
        launch's count, ``_row_tiles``, bounds them) and the pairs of the rows past the last group. The launch's
        count is an upper bound for any routing ((#M tiles + G + 1) / 2 pairs of n tiles); its tiles past this
        length lie past the output, and walked they cost each CTA a turn and a dropped epilogue apiece (ncu of the
        H100 dgrad at 48 equal groups, session 40: 9.4% more tiles than QuACK's walk, none with MMA work)."""
        p.num_groups = cute.size(p.cu_seqlens, mode=[0])
        if cutlass.const_expr(self.cluster_m > 1):
            _, groups_end, group_tiles = self.pair_group(p.cu_seqlens, p.num_tiles, p.num_n_tiles)
            rows_past = cutlass.max(cute.ceil_div(self.output_rows(p), self.tile_m) - groups_end, 0)
            p.num_tiles = group_tiles + (rows_past + 1) // 2 * p.num_n_tiles

    # the words of a tile's coordinates (``tile_info``) that the scheduler warp hands on (``walk.TileWalk``)
    tile_info_words = 4

    @cute.jit
    def tile_info(self, p, tile: cutlass.Int32):
        """Tile ``tile`` of the walk -> its coordinates, the words that ``tile_work`` and ``load_tile`` read: (m
        tile, n tile, group (G past the last group), 1 where its weight tile is loaded whole: ``load_b_tile``'s
        ``lone``, else 0): ``row_tile``, or ``pair_tile`` in clusters sharing B. One warp."""
        lone = cutlass.Int32(0)
        if cutlass.const_expr(self.cluster_m > 1):
            m_idx, n_idx, g, is_lone = self.pair_tile(p, tile)
            lone = cutlass.Int32(cutlass.select_(is_lone, 1, 0))
        else:
            m_idx, n_idx, g = self.row_tile(p.cu_seqlens, tile, p.num_n_tiles)
        return m_idx, n_idx, g, lone

    @cute.jit
    def tile_work(self, p, info):
        """Consumers: a tile's coordinates (``tile_info``) -> (m tile, n tile, number of k tiles); a tile past the
        last group has none (its accumulators stay zero)."""
        m_idx, n_idx, g, _ = info
        k_count = p.k_tiles if g < p.num_groups else 0
        return m_idx, n_idx, k_count

    @cute.jit
    def tile_stages(self, p, info):
        """The ring stages (k tiles) the producer loads for a tile (``tile_info``; 0 past the last group)."""
        return self.tile_work(p, info)[2]

    def weight_tile_lone(self, info):
        """``load_b_tile``'s ``lone`` of a tile (``tile_info``): None without clusters sharing B."""
        return None if self.cluster_m == 1 else info[3] != 0

    @cute.jit
    def load_tile(self, mainloop, prod_state, p, tAgA: cute.Tensor, tAsA: cute.Tensor, b_loads, info):
        """Producer warp (``load_tiles``' step): all k tiles of A and of the B operand(s) of a tile's group (its
        coordinates: ``tile_info``); a tile past the last group loads nothing."""
        b_home = [b_loads[i] for i in p.home_rings]
        b_slot = [b_loads[i] for i in p.slot_rings]
        num_home = b_home[0].num_experts()
        m_idx, n_idx, g, _ = info
        lone = self.weight_tile_lone(info)
        load = (mainloop, prod_state, p.tma_a, tAgA, tAsA, m_idx, n_idx, p.k_tiles)
        if g < num_home:
            prod_state = self.load_expert_tile(*load, b_home, g, lone=lone)
        elif g < p.num_groups:
            prod_state = self.load_expert_tile(*load, b_slot, g - num_home, lone=lone)
        return prod_state


class GroupTileScheduler:
    """Mixin of the wgrad kernel: work items (group, m tile, n tile) over ``p.num_tiles`` =
    G x ``p.tiles_per_group``; ``load_tile`` reads ``p.cu_seqlens``, ``p.num_n_tiles`` and the one
    B load."""

    @cute.jit
    def work_item(
        self,
        cu_seqlens: cute.Tensor,
        tile: cutlass.Int32,
        num_n_tiles: cutlass.Int32,
        tiles_per_group: cutlass.Int32,
    ):
        """Work item ``tile`` -> (group, m tile, n tile, first k tile, number of k tiles). With
        ``cluster_n`` = 2 an item's n tile is a pair of n tiles, with ``cluster_m`` = 2 its m tile a pair of m
        tiles (the second one past the output where it has an odd number: zero A, its stores dropped), each
        CTA of the cluster taking its own; both CTAs have the item's group and k tiles."""
        g = tile // tiles_per_group
        rest = tile - g * tiles_per_group
        m_idx = rest // num_n_tiles
        n_idx = rest - m_idx * num_n_tiles
        if cutlass.const_expr(self.cluster_n > 1):
            n_idx = n_idx * self.cluster_n + self.cluster_rank()
        if cutlass.const_expr(self.cluster_m > 1):
            m_idx = m_idx * self.cluster_m + self.cluster_rank()
        row_start = cutlass.Int32(0)
        if g > 0:
            row_start = cu_seqlens[g - 1]
        row_end = cu_seqlens[g]
        k_start = row_start // self.tile_k
        k_count = (row_end - row_start) // self.tile_k
        return g, m_idx, n_idx, k_start, k_count

    # the words of a work item's coordinates (``tile_info``) that the scheduler warp hands on (``walk.TileWalk``)
    tile_info_words = 5

    @cute.jit
    def tile_info(self, p, tile: cutlass.Int32):
        """Work item ``tile`` (< ``p.num_tiles``) -> (group, m tile, n tile, first k tile, number of k tiles):
        ``work_item``."""
        return self.work_item(p.cu_seqlens, tile, p.num_n_tiles, p.tiles_per_group)

    @cute.jit
    def tile_stages(self, p, info):
        """The ring stages (k tiles) the producer loads for a work item (``tile_info``): its group's rows / tile_k."""
        return info[4]

    @cute.jit
    def count_groups(self, p):
        """Sets ``p.num_home`` (epn, from the home gradients ``p.mC`` viewed (Kd, Nd, epn))."""
        p.num_home = cute.size(p.mC, mode=[2])

    @cute.jit
    def load_tile(self, mainloop, prod_state, p, tAgA: cute.Tensor, tAsA: cute.Tensor, b_loads, info):
        """Producer warp (``load_tiles``' step): a work item's (``tile_info``) k tiles of A = x^T and B = dy^T
        (``load_work_item``)."""
        (b_load,) = b_loads
        _, m_idx, n_idx, k_start, k_count = info
        return self.load_work_item(mainloop, prod_state, p.tma_a, tAgA, tAsA, b_load, m_idx, n_idx, k_start, k_count)

    @cute.jit
    def load_work_item(self, mainloop, prod_state, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                       b_load, m_idx, n_idx, k_start: cutlass.Int32, k_count: cutlass.Int32):
        """Producer warp: k tiles [k_start, k_start + k_count) of work item (m tile ``m_idx``, n tile
        ``n_idx``), A (TMA, RestM, RestK) and B (``b_load``: its ``BTileLoad``) by TMA."""
        return self.load_k_tiles(
            mainloop, prod_state, tma_a, tAgA[(None, m_idx, None)], tAsA, [b_load.at(n_idx)], k_start, k_count,
        )
