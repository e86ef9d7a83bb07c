"""Which output tiles a persistent CTA takes, in what order, and who computes their coordinates.

Static (the default): CTA b of G takes tiles b, b + G, b + 2G, ... (``GroupGemmSm90Base.cta_tiles``). No
communication, but each CTA's share is fixed before it starts: an SM whose tiles run slower (their data
farther away in L2 or in DRAM) finishes the launch last while the others idle, and the CTAs drift apart
over the tile order, so the tiles in flight span more of the rows and weights than the raster meant.

Dynamic (``GroupGemmConfig.dynamic``): the tiles are handed out in order from one global counter
(``tile_counter``, int32, zero at launch: the host allocates it zeroed for every launch). The producer's warp 0
(the walk's writer) takes a tile number by an atomic add, computes its coordinates and publishes both in a
shared-memory ring of ``WALK_STAGES`` slots, one mbarrier pair a slot; every other warp that walks the tiles
(the consumers and, in the gathered kernels, the other producer warps: the walk's readers) reads the slots in
order. The writer publishes the next tile before it loads the current one, so a reader that has finished a
tile never waits for the next one's number (it was published before the finished tile's last loads). Each
CTA's writer takes numbers until its first one >= #tiles (a launch adds #tiles + #CTAs to the counter) and
publishes that one as -1, the walk's end (``WALK_END``). Tiles are numbered as in the static walk
(``RowTileScheduler.row_tile``, ``GroupTileScheduler.work_item``), so the CTAs that run at once work on
neighbouring tiles of the raster, and every output element has the same k loop in either walk: the results
are bitwise equal.

Scheduled (``GroupGemmConfig.scheduler_warp``, the static walk of the kernels whose producer is one warp): the
producer's warp 1, idle otherwise, is the writer of the static walk: it computes each tile's coordinates
(``tile_info``: in clusters sharing B ``pair_tile``'s warp scans over ``cu_seqlens``, dependent global loads)
and publishes them in the same ring, up to ``WALK_STAGES`` tiles ahead, then ``WALK_END``; the loading
warp 0 and the consumers (cooperative and pingpong: ``TileWalk._init_walk``) read them. Why: computed by the
loading warp, a clustered tile's coordinates took about 1.4 us between a tile's last TMA load and the next one's
first, where the 5-stage ring gives that first load about 1.5 us of lead, so the consumers found a tile's first k
block not yet loaded at 99.3% of tile starts (ncu of the H100 dgrad at 48 equal groups, session 43); and computed
by the consumers themselves, they sit between a tile's epilogue and its first wgmma (cooperative) or take 7.6% of
the warp samples (pingpong, the same ncu in session 44). The results are bitwise the unscheduled walk's (the
same tiles in the same order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ..warp import ptr

# slots of the tile ring: the writer runs at most this many tiles ahead of the slowest reader
WALK_STAGES = 4
# the tile number that ends a walk in the ring: a reader's loop runs while its tile is >= 0, so it holds no
# #tiles through its loop (in the clustered row kernels #tiles is computed, ``count_groups``: holding it cost
# the row-scaled pingpong consumers a register they did not have, 8 B of spills at sm_90a, session 45)
WALK_END = -1


class TileWalk:
    """Mixin of ``GroupGemmSm90Base``: the walk ring's shared memory (``walk_fields``), the ring (``make_walk``),
    its writers (the dynamic walk's ``publish_next``, the scheduler warp's ``schedule_tiles``), its readers' step
    (``read_tile``), the dynamic walk's loading cursor (``walk_first`` / ``walk_next``) and the loops over the
    ring; the loops over an unscheduled static walk are ``cutlass.range`` loops of ``GroupGemmSm90Base``. A slot
    holds a tile number and the tile's coordinates (the scheduler's ``tile_info``, ``tile_info_words`` of them)."""

    # producer warps besides the writer that walk the tiles themselves (the gathered kernels: all four)
    walk_producer_readers = 0
    # whether producer warp 1 may schedule the static walk (``GroupGemmConfig.scheduler_warp``): not where every
    # producer warp loads (the gathered kernels) nor where the loading warp walks the tiles its own way (remote)
    scheduled_walk = True

    def _init_walk(self, config):
        """The walk of ``config``: ``self.dynamic``; ``self.scheduled`` (the static walk with the scheduler warp);
        ``self.walked`` (either: the loading warp and the consumers, pingpong ones included, take their tiles and
        the tiles' coordinates from the ring; in the pingpong kernels the coordinates computed in the consumers
        took 7.6% of the H100 dgrad's warp samples under ncu, session 44, and read from the ring the clustered
        dgrad ran 0.6-0.9% faster at the power cap, session 45)."""
        self.scheduled = not self.dynamic and config.scheduler_warp and self.scheduled_walk
        self.walked = self.dynamic or self.scheduled

    def walk_fields(self) -> dict:
        """The walk ring's shared-memory fields (none for an unscheduled static walk): a slot's words are the
        tile number, then its ``tile_info``."""
        if not self.walked:
            return {}
        return {"walk_mbar": cute.struct.MemRange[cutlass.Int64, 2 * WALK_STAGES],
                "walk_tile": cute.struct.MemRange[cutlass.Int32, (1 + self.tile_info_words) * WALK_STAGES]}

    def walk_counter(self, tile_counter):
        """What a kernel passes on of its ``tile_counter`` argument: the counter for the dynamic walk, None
        for the static one (so its kernel's parameters are the ones it had without a walk)."""
        return tile_counter if self.dynamic else None

    @cute.jit
    def make_walk(self, storage):
        """The walk ring (one writer thread; one arrival per reader warp) and its slots (word, slot), or None for
        an unscheduled static walk. Its mbarriers are initialised by warp 0 before the kernel's pipeline init
        barrier (``pipeline_init_arrive`` / ``pipeline_init_wait``)."""
        walk = None
        if cutlass.const_expr(self.walked):
            readers = self.num_mma_threads // 32 + (1 if self.scheduled else self.walk_producer_readers)
            ring = pipeline.PipelineAsync.create(
                barrier_storage=storage.walk_mbar.data_ptr(),
                num_stages=WALK_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
                defer_sync=True,
            )
            walk = (ring, storage.walk_tile.get_tensor(cute.make_layout((1 + self.tile_info_words, WALK_STAGES))))
        return walk

    def no_tile_info(self):
        """The coordinates a slot holds past the walk's end (zeros; nothing reads them)."""
        return tuple(cutlass.Int32(0) for _ in range(self.tile_info_words))

    @cute.jit
    def publish(self, p, state, tile, info):
        """Writer warp: ``tile`` and its coordinates ``info`` into slot ``state`` once it is free (lane 0; the
        slot's mbarrier arrive releases the shared stores) -> the next state."""
        ring, slots = p.walk
        ring.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            slots[0, state.index] = tile
            for w in cutlass.range_constexpr(self.tile_info_words):
                slots[1 + w, state.index] = info[w]
            ring.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def publish_next(self, p, state):
        """The dynamic walk's writer (warp 0): takes the next tile number from ``p.tile_counter`` once slot
        ``state`` is free and publishes it with its coordinates -> (tile, its coordinates, next state)."""
        ring, _ = p.walk
        ring.producer_acquire(state)
        tile = cutlass.Int32(0)
        if cute.arch.lane_idx() == 0:
            tile = cute.arch.atomic_add(ptr(p.tile_counter, 0), cutlass.Int32(1), sem="relaxed", scope="gpu")
        tile = cute.arch.shuffle_sync(tile, 0)
        info = self.no_tile_info()
        if tile < p.num_tiles:
            info = self.tile_info(p, tile)
        else:
            tile = cutlass.Int32(WALK_END)
        state = self.publish(p, state, tile, info)
        return tile, info, state

    @cute.jit
    def schedule_tiles(self, p):
        """The scheduler warp (producer warp 1, the scheduled static walk): publishes this CTA's tiles (b, b + G,
        ...) with their coordinates, then ``WALK_END``."""
        bidx, gdim = self.cta_tiles()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, WALK_STAGES)
        for tile in cutlass.range(bidx, p.num_tiles, gdim, unroll=1):
            state = self.publish(p, state, tile, self.tile_info(p, tile))
        self.publish(p, state, cutlass.Int32(WALK_END), self.no_tile_info())

    @cute.jit
    def read_tile(self, p, step):
        """Reader warp: the tile number and coordinates of the walk's ``step``-th tile of this CTA (every lane
        reads them, the same words; after the warp's reads lane 0 releases the slot) -> (tile, coordinates). A
        reader carries its step alone through its loop (the slot and its phase follow from it): one register over
        a tile where a pipeline state would keep three."""
        ring, slots = p.walk
        state = pipeline.PipelineState(WALK_STAGES, step, step % WALK_STAGES, (step // WALK_STAGES) % 2)
        ring.consumer_wait(state)
        # the same words in every lane: marked warp-uniform, so that they may live in uniform registers
        tile = cute.arch.make_warp_uniform(slots[0, state.index])
        info = tuple(cute.arch.make_warp_uniform(slots[1 + w, state.index]) for w in range(self.tile_info_words))
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            ring.consumer_release(state)
        return tile, info

    @cute.jit
    def walk_first(self, p, is_writer):
        """The dynamic walk's loading warps: this CTA's first tile and the cursor ``walk_next`` takes -> (tile, its
        coordinates, ring state, the tile after it and its coordinates: the writer publishes that one before it
        loads this one; a reader's are unused). Readers only (the consumers, the scheduled walk's loading warp)
        call ``read_tile`` instead: the cursor would carry unused registers through their loops, and the DSL
        traces both sides of ``is_writer`` even where it is a Python bool (the writer's needs ``tile_counter``)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, WALK_STAGES)
        tile = cutlass.Int32(0)
        info = self.no_tile_info()
        ahead = (cutlass.Int32(0), self.no_tile_info())
        if is_writer:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, WALK_STAGES)
            tile, info, state = self.publish_next(p, state)
            ahead = (tile, info)
            if tile >= 0:
                ahead_tile, ahead_info, state = self.publish_next(p, state)
                ahead = (ahead_tile, ahead_info)
        else:
            tile, info = self.read_tile(p, state.count)
            state.advance()
        return tile, info, state, ahead

    @cute.jit
    def walk_next(self, p, is_writer, state, ahead):
        """The dynamic walk's loading warps: the tile after the cursor's (``walk_first``) -> (tile, its coordinates,
        ring state, the tile after it and its coordinates)."""
        tile, info = ahead
        if is_writer:
            if tile >= 0:
                ahead_tile, ahead_info, state = self.publish_next(p, state)
                ahead = (ahead_tile, ahead_info)
        else:
            tile, info = self.read_tile(p, state.count)
            state.advance()
        return tile, info, state, ahead

    # the loops over the ring's walk (an unscheduled static walk's are ``GroupGemmSm90Base``'s own; a function with
    # both would have the DSL carry one's loop variable into the other)

    @cute.jit
    def load_walked_tiles(self, mainloop, prod_state, p, tAgA, tAsA, b_loads, is_writer):
        """Producer warp: ``load_tiles`` over the ring's walk (``is_writer``: the dynamic walk's warp 0, which
        takes the tiles)."""
        if cutlass.const_expr(self.dynamic):
            tile, info, walk_state, ahead = self.walk_first(p, is_writer)
            while tile >= 0:
                prod_state = self.load_tile(mainloop, prod_state, p, tAgA, tAsA, b_loads, info)
                tile, info, walk_state, ahead = self.walk_next(p, is_writer, walk_state, ahead)
        else:  # a reader of the scheduler warp's walk
            step = cutlass.Int32(0)
            tile, info = self.read_tile(p, step)
            while tile >= 0:
                prod_state = self.load_tile(mainloop, prod_state, p, tAgA, tAsA, b_loads, info)
                step = step + 1
                tile, info = self.read_tile(p, step)
        return prod_state

    @cute.jit
    def consume_walked_tiles(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs):
        """Cooperative consumers: every tile of the ring's walk (``consume_tile``)."""
        epi_count = cutlass.Int32(0)
        step = cutlass.Int32(0)
        tile, info = self.read_tile(p, step)
        while tile >= 0:
            read_state, release_state, epi_count = self.consume_tile(
                p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs, info, step, epi_count
            )
            step = step + 1
            tile, info = self.read_tile(p, step)

    @cute.jit
    def consume_walked_alternate_tiles(self, p, c, warp_idx, wg, mainloop, tCrA, tCrBs):
        """Pingpong consumers (``consume_alternate_tiles``) over the ring's walk: warp group ``wg`` reads every
        tile and computes those of its parity of the walk's steps, each with the pipeline state after the stages
        of every earlier tile -> the walk's steps. No mainloop reads whether a tile follows to pass its turn
        (session 29's first version read the next tile's number before each mainloop for that:
        docs/design-notes.md)."""
        epi_count = cutlass.Int32(0)
        passed = cutlass.Int32(0)
        step = cutlass.Int32(0)
        tile, info = self.read_tile(p, step)
        while tile >= 0:
            passed, epi_count = self.consume_alternate_step(p, c, warp_idx, wg, mainloop, tCrA, tCrBs, info, step,
                                                            passed, epi_count)
            step = step + 1
            tile, info = self.read_tile(p, step)
        return step
