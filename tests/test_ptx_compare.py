"""csrc_cute/ptx_compare.py: the kernel registry and its family selection, the PTX normalisation, and one
small family (sync at R = 2: two kernels, a few seconds) dumped twice end to end on the CPU. The full
dump (every family, a few minutes on two cores) is not run here."""

import os
import re

import pytest

from csrc_cute import ptx_compare

PTX = """//
.version 8.8
.target sm_90a
.file 1 "/somewhere/csrc_cute/sync.py"
.visible .entry kernel_cutlass__barrier_kernel_0x7f00deadbeef_2_256_0(
\t.param .u64 kernel_cutlass__barrier_kernel_0x7f00deadbeef_2_256_0_param_0
)
{
\t.loc 1 57 0
\tcall.uni helper_func_0x7f00aa, (%rd1);
\tret;
}
.func helper_func_0x7f00aa(.param .b64 p)
{
\tret;
}
\0"""


def test_normalise_renames_symbols_and_drops_source_positions():
    out = ptx_compare.normalise(PTX)
    assert ".visible .entry entry0(" in out and "entry0_param_0" in out
    assert "call.uni func0, (%rd1);" in out and ".func func0(" in out
    assert "0x7f00" not in out and ".file" not in out and ".loc" not in out and not out.endswith("\0")
    # the same code from elsewhere (other addresses, other source lines) normalises to the same text
    moved = PTX.replace("0x7f00deadbeef", "0x5500cafe").replace("0x7f00aa", "0x5511").replace("57 0", "90 0")
    assert ptx_compare.normalise(moved) == out


def test_families_and_groups_select_registered_kernels():
    assert ptx_compare.select_families("all") == list(ptx_compare.FAMILIES)
    assert ptx_compare.select_families("weights, gemm,comm") == ["gemm", "sync", "dispatch", "combine", "weights"]
    assert ptx_compare.select_families("planner") == ["plan", "plan_tokens"]
    with pytest.raises(ValueError, match=r"^ptx_compare: unknown family 'comms'; families: gemm, plan"):
        ptx_compare.select_families("gemm,comms")
    with pytest.raises(ValueError, match=r"^ptx_compare: --families selects no family"):
        ptx_compare.select_families(" , ")
    names = [n for n, _ in ptx_compare.selected_kernels("all")]
    assert len(names) == len(set(names)), "kernel names are file names: they must be unique"
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names), names
    for family, kernels in ptx_compare.FAMILIES.items():
        assert kernels, family
        prefix = "group_gemm." if family == "gemm" else family + "."
        assert all(n.startswith(prefix) for n, _ in kernels), family
    assert [n for n, _ in ptx_compare.selected_kernels("sync", "r2.")] == ["sync.barrier.r2.e96",
                                                                         "sync.exchange.r2.e96"]


def test_dump_sync_twice_is_identical_and_diff_sees_a_change(tmp_path, capsys):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        ptx_compare.dump(str(d), families="sync", only="r2.")
    files = sorted(os.listdir(dirs[0]))
    assert files == ["sync.barrier.r2.e96.ptx", "sync.exchange.r2.e96.ptx"]
    for f in files:
        texts = [(d / f).read_bytes() for d in dirs]
        assert texts[0] == texts[1], f"{f}: two dumps differ before normalisation"
        # the barrier's code: a flag released to the peers, theirs acquired, a timeout on the global timer
        assert all(s in texts[0] for s in (b".entry", b"st.release.sys", b"ld.acquire.sys", b"%globaltimer")), f
    assert ptx_compare.main(["diff", str(dirs[0]), str(dirs[1])]) == 0
    assert capsys.readouterr().out.count("same: ") == 2
    # one instruction changed, one kernel missing on one side: both reported, exit status 1
    changed = dirs[1] / files[0]
    changed.write_text(changed.read_text().replace("ret;", "exit;", 1))
    (dirs[1] / files[1]).unlink()
    assert ptx_compare.main(["diff", str(dirs[0]), str(dirs[1])]) == 1
    out = capsys.readouterr().out
    assert f"DIFFERENT: {files[0]}" in out and f"ONLY IN {dirs[0]}: {files[1]}" in out
