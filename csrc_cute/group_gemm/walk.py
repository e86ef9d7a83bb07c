"""Which output tiles a persistent CTA takes, and in what order (``GroupGemmConfig.dynamic``).

Static (the default): CTA b of G takes tiles b, b + G, b + 2G, ... (``GroupGemmSm90Base.cta_tiles``). No
communication, but each CTA's share is fixed before it starts: an SM whose tiles run slower (their data
farther away in L2 or in DRAM) finishes the launch last while the others idle, and the CTAs drift apart
over the tile order, so the tiles in flight span more of the rows and weights than the raster meant.

Dynamic: the tiles are handed out in order from one global counter (``tile_counter``, int32, zero at
launch: the host allocates it zeroed for every launch). The producer's warp 0 (the walk's writer) takes a
tile number by an atomic add and publishes it in a shared-memory ring of ``WALK_STAGES`` slots, one
mbarrier pair a slot; every other warp that walks the tiles (the consumers and, in the gathered kernels,
the other producer warps: the walk's readers) reads the slots in order. The writer publishes the next
tile before it loads the current one, so a reader that has finished a tile never waits for the next
one's number (it was published before the finished tile's last loads). A number >= #tiles ends the walk:
each CTA's writer takes numbers until its first such one, so a launch adds #tiles + #CTAs to the
counter. Tiles are numbered as in the static walk (``RowTileScheduler.row_tile``,
``GroupTileScheduler.work_item``), so the CTAs that run at once work on neighbouring tiles of the raster,
and every output element has the same k loop in either walk: the results are bitwise equal.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ..warp import ptr

# slots of the tile ring: the writer runs at most this many tiles ahead of the slowest reader
WALK_STAGES = 4


class TileWalk:
    """Mixin of ``GroupGemmSm90Base``: the dynamic walk's shared memory (``walk_fields``), its ring
    (``make_walk``) and its steps (``walk_first`` / ``walk_next``); the loops that walk the tiles keep the
    static walk's ``cutlass.range`` unless ``self.dynamic``."""

    # producer warps besides the writer that walk the tiles themselves (the gathered kernels: all four)
    walk_producer_readers = 0

    def walk_fields(self) -> dict:
        """The dynamic walk's shared-memory fields (none for the static walk)."""
        if not self.dynamic:
            return {}
        return {"walk_mbar": cute.struct.MemRange[cutlass.Int64, 2 * WALK_STAGES],
                "walk_tile": cute.struct.MemRange[cutlass.Int32, WALK_STAGES]}

    def walk_counter(self, tile_counter):
        """What a kernel passes on of its ``tile_counter`` argument: the counter for the dynamic walk, None
        for the static one (so its kernel's parameters are the ones it had without a walk)."""
        return tile_counter if self.dynamic else None

    @cute.jit
    def make_walk(self, storage):
        """The dynamic walk's ring (one writer thread; one arrival per reader warp) and its slots, or None
        for the static walk. Its mbarriers are initialised by warp 0 before the kernel's pipeline init
        barrier (``pipeline_init_arrive`` / ``pipeline_init_wait``)."""
        walk = None
        if cutlass.const_expr(self.dynamic):
            readers = self.num_mma_threads // 32 + self.walk_producer_readers
            ring = pipeline.PipelineAsync.create(
                barrier_storage=storage.walk_mbar.data_ptr(),
                num_stages=WALK_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
                defer_sync=True,
            )
            walk = (ring, storage.walk_tile.get_tensor(cute.make_layout(WALK_STAGES)))
        return walk

    @cute.jit
    def publish_tile(self, p, state):
        """Writer warp: takes the next tile number from ``p.tile_counter`` and publishes it in slot ``state``
        (lane 0; the slot's mbarrier arrive releases the shared store) -> (tile, next state)."""
        ring, slots = p.walk
        ring.producer_acquire(state)
        tile = cutlass.Int32(0)
        if cute.arch.lane_idx() == 0:
            tile = cute.arch.atomic_add(ptr(p.tile_counter, 0), cutlass.Int32(1), sem="relaxed", scope="gpu")
            slots[state.index] = tile
            ring.producer_commit(state)
        tile = cute.arch.shuffle_sync(tile, 0)
        state.advance()
        return tile, state

    @cute.jit
    def read_tile(self, p, state):
        """Reader warp: the tile number in slot ``state`` (lane 0 reads it, releases the slot and broadcasts
        it) -> (tile, next state)."""
        ring, slots = p.walk
        ring.consumer_wait(state)
        tile = cutlass.Int32(0)
        if cute.arch.lane_idx() == 0:
            tile = slots[state.index]
            ring.consumer_release(state)
        tile = cute.arch.shuffle_sync(tile, 0)
        state.advance()
        return tile, state

    @cute.jit
    def walk_first(self, p, is_writer):
        """The dynamic walk's first tile of this CTA and the cursor ``walk_next`` takes -> (tile, ring state,
        the tile after it: the writer publishes that one before it loads this one; a reader's is unused)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, WALK_STAGES)
        if is_writer:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, WALK_STAGES)
        tile = cutlass.Int32(0)
        ahead = cutlass.Int32(0)
        if is_writer:
            tile, state = self.publish_tile(p, state)
            ahead = tile
            if tile < p.num_tiles:
                ahead, state = self.publish_tile(p, state)
        else:
            tile, state = self.read_tile(p, state)
        return tile, state, ahead

    @cute.jit
    def walk_next(self, p, is_writer, state, ahead):
        """The dynamic walk's tile after the cursor's (``walk_first``) -> (tile, ring state, the tile after it)."""
        tile = ahead
        if is_writer:
            if tile < p.num_tiles:
                ahead, state = self.publish_tile(p, state)
        else:
            tile, state = self.read_tile(p, state)
        return tile, state, ahead

    # the loops over the dynamic walk (the static walk's are ``GroupGemmSm90Base``'s own; a function with
    # both would have the DSL carry one's loop variable into the other)

    @cute.jit
    def load_walked_tiles(self, mainloop, prod_state, p, tAgA, tAsA, b_loads, is_writer):
        """Producer warp: ``load_tiles`` over the dynamic walk (``is_writer``: warp 0, which takes the tiles)."""
        tile, walk_state, ahead = self.walk_first(p, is_writer)
        while tile < p.num_tiles:
            prod_state = self.load_tile(mainloop, prod_state, p, tAgA, tAsA, b_loads, tile)
            tile, walk_state, ahead = self.walk_next(p, is_writer, walk_state, ahead)
        return prod_state

    @cute.jit
    def consume_walked_tiles(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs):
        """Cooperative consumers: every tile of the dynamic walk (``consume_tile``)."""
        epi_count = cutlass.Int32(0)
        tile, walk_state, ahead = self.walk_first(p, False)
        while tile < p.num_tiles:
            read_state, release_state, epi_count = self.consume_tile(
                p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs, tile, tile, epi_count
            )
            tile, walk_state, ahead = self.walk_next(p, False, walk_state, ahead)

    @cute.jit
    def consume_walked_alternate_tiles(self, p, c, warp_idx, wg, mainloop, tCrA, tCrBs):
        """Pingpong consumers (``consume_alternate_tiles``) over the dynamic walk: warp group ``wg`` reads every
        tile and computes those of its parity of the walk's steps, each with the pipeline state after the stages
        of every earlier tile. Every mainloop passes the turn without reading whether a tile follows (session
        29's first version read the next tile's number before each mainloop for that: docs/design-notes.md);
        at the walk's end the warp group of the step after the last tile takes that last turn, so the turn
        barriers end balanced."""
        epi_count = cutlass.Int32(0)
        passed = cutlass.Int32(0)
        step = cutlass.Int32(0)
        tile, walk_state, ahead = self.walk_first(p, False)
        while tile < p.num_tiles:
            if step % 2 == wg:
                _, _, epi_count = self.consume_tile(
                    p, c, warp_idx, mainloop, self.consumer_state_at(passed), self.consumer_state_at(passed),
                    tCrA, tCrBs, tile, step, epi_count
                )
            passed = passed + self.tile_stages(p, tile)
            tile, walk_state, ahead = self.walk_next(p, False, walk_state, ahead)
            step = step + 1
        if step % 2 == wg:
            self.wait_mainloop_turn(step)
