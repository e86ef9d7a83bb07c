"""Bulk (TMA engine) copies between global and shared memory for the row-moving kernels (sm_90a).

A bulk copy moves up to a few KiB with one instruction issued by one thread; the copy engine does the
work. Kernels that write the same bytes to many places (dispatch's pull writes each token row to all
of its rows) otherwise spend most of their time with the load/store queue full of 16-byte vector
stores (ncu on an H200: 43% of the stalls), leaving HBM half idle.

  bulk_load(smem, gmem, nbytes, mbar)   global -> shared; completes `nbytes` of transactions on the
                                        mbarrier at `mbar` (arm it with mbarrier_arrive_and_expect_tx)
  bulk_store(gmem, smem, nbytes)        shared -> global, in the issuing thread's current bulk group
  commit_stores()                       close that group
  wait_stores_read(n)                   until at most n of the thread's groups still read shared memory
  wait_stores_done()                    until every group's writes are performed

Addresses: shared as 32-bit shared-window addresses (Pointer.toint() of a shared pointer), global as
64-bit; both 16-byte aligned, nbytes a multiple of 16.
"""

# (no `from __future__ import annotations`: the DSL reads annotations at runtime)

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _asm(operands, text: str, constraints: str, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, operands, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def bulk_load(smem_addr, gmem_addr, nbytes, mbar_addr, *, loc=None, ip=None) -> None:
    _asm([Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
          Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(mbar_addr).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];", "r,l,r,r",
         loc=loc, ip=ip)


@dsl_user_op
def bulk_store(gmem_addr, smem_addr, nbytes, *, loc=None, ip=None) -> None:
    _asm([Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
          Int32(nbytes).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r", loc=loc, ip=ip)


def commit_stores() -> None:
    cute.arch.cp_async_bulk_commit_group()


def wait_stores_read(n: int) -> None:
    cute.arch.cp_async_bulk_wait_group(n, read=True)


def wait_stores_done() -> None:
    cute.arch.cp_async_bulk_wait_group(0)
