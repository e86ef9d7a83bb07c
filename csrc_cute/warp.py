"""Warp-level and addressing helpers shared by the CuTe DSL kernels of csrc_cute (plan, dispatch,
combine, weights, sync).

Plain Python on DSL values, called while a kernel is traced: no dynamic `if`, so they need no AST
rewriting and can be used from any `@cute.kernel` / `@cute.jit` body. Every warp helper assumes all
32 lanes of the warp take part.
"""

# (no `from __future__ import annotations`: the DSL reads annotations at runtime)

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def match_any(val, *, loc=None, ip=None) -> Int32:
    """match.any.sync.b32 over the full warp: mask of lanes holding the same value."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(val).ir_value(loc=loc, ip=ip)],
        "match.any.sync.b32 $0, $1, -1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def lanemask_lt(*, loc=None, ip=None) -> Int32:
    return Int32(cute.arch.nvvm.read_ptx_sreg_lanemask_lt(T.i32(), loc=loc, ip=ip))


def ctz(m):
    """Index of the lowest set bit of a non-zero 32-bit mask."""
    return cute.arch.popc((m & (Int32(0) - m)) - Int32(1))


def warp_incl_scan(x, lane):
    for i in range(5):
        y = cute.arch.shuffle_sync_up(x, 1 << i, mask_and_clamp=0)
        x = cutlass.select_(lane >= (1 << i), x + y, x)
    return x


def warp_sum(x):
    return cute.arch.warp_redux_sync(Int32(x), "add")


def overlap(a0, a1, b0, b1):
    """Length of [a0, a1) ∩ [b0, b1) (0 if empty)."""
    lo = cutlass.max(a0, b0)
    hi = cutlass.min(a1, b1)
    return cutlass.max(hi - lo, Int32(0))


def ptr(t, i):
    """LLVM pointer to element i of tensor t (for atomics and raw loads/stores)."""
    return (t.iterator + i).llvm_ptr


def searches(n, rounds, load, before):
    """Per round r: the first index i in [0, n) with before(r, load(r, i)) false (n if none), that
    being true on a prefix. Branch-free binary searches (i clamped to n - 1), interleaved over the
    rounds so that their loads overlap."""
    los = [Int32(0) for _ in range(rounds)]
    his = [Int32(n) for _ in range(rounds)]
    for _it in range(n.bit_length()):
        for r in range(rounds):
            mid = (los[r] + his[r]) // 2
            x = load(r, cutlass.min(mid, Int32(n - 1)))
            act = los[r] < his[r]
            right = before(r, x)
            los[r] = cutlass.select_(act & right, mid + 1, los[r])
            his[r] = cutlass.select_(act & (right == False), mid, his[r])  # noqa: E712
    return los


def lower_bounds(lst, W, rows, keys):
    """Per round r: the first index of row rows[r] of the [*, W] list lst (ascending, -1 = end) whose
    entry is not below keys[r] (W if none)."""
    return searches(W, len(keys), lambda r, i: lst[rows[r] * W + i],
                    lambda r, x: (x >= 0) & (x < keys[r]))
