"""An empty CuTe DSL kernel with the barrier kernel's arguments and launch shape (csrc_cute/sync.py: one
CTA of 256 threads; peer ctrl addresses, ctrl, rank, timeout, op id), launched the same way (apache-tvm-ffi,
the current stream). bench_op_overhead.py times it beside the barrier: launch and argument costs are the
same, so the difference is the barrier's body (fences, signal store, spin, the op-id compare)."""

# (no `from __future__ import annotations`: the DSL reads the annotations at runtime)

import cutlass.cute as cute
from cutlass import Int32, Int64

from csrc_cute import sync
from csrc_cute.status import control_words


@cute.kernel
def _empty_kernel(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, rank: Int32, timeout_ns: Int64, op_id: Int32):
    pass  # nothing: only the launch is measured


@cute.jit
def _empty_launch(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, rank: Int32, timeout_ns: Int64, op_id: Int32,
                  stream):
    _empty_kernel(peer_ctrl, ctrl, rank, timeout_ns, op_id).launch(
        grid=(1, 1, 1), block=(sync._NT, 1, 1), stream=stream)


def compile_empty(R: int, E: int):
    """The compiled launcher: call it as the barrier's, (peer_ctrl, ctrl, rank, timeout_ns, op_id)."""
    peers = cute.runtime.make_fake_compact_tensor(Int64, (R,), assumed_align=8)
    ctrl = cute.runtime.make_fake_compact_tensor(Int32, (control_words(R, E),), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_empty_launch, peers, ctrl, Int32(0), Int64(0), Int32(0), stream,
                        options="--enable-tvm-ffi")
