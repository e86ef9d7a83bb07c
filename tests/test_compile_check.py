"""csrc_cute/compile_check.py's compile child: one per test process and arch, serving every compile check
in turn; each request compiles what it asks for again (kernels in memory forgotten) and gets its own
artifacts and output; a failed request names its target and cause, and the next one gets a new child."""

import os
import time

import pytest

from csrc_cute import compile_check

BARRIER = dict(configs=[[2, 96]], kinds=["barrier"])


def test_requests_share_one_child_and_each_gets_its_own_artifacts(tmp_path):
    pid, _ = compile_check.run_in_compile_child("os:getpid")
    # the same kernel three times, each request compiles it again (on a machine without a CUDA driver only
    # the first compile of a process fails at loading; the later ones succeed and are kept in memory)
    outputs = []
    for name in ("a", "b", "c"):
        _, out = compile_check.run_in_compile_child("csrc_cute.sync:compile_all_for_check", BARRIER,
                                                    str(tmp_path / name))
        outputs.append(out)
    arts = [compile_check.find_artifacts(str(tmp_path / name)) for name in ("a", "b", "c")]
    assert [(len(a["ptx"]), len(a["cubin"])) for a in arts] == [(1, 1)] * 3, arts
    assert len({os.path.basename(a["ptx"][0]) for a in arts}) == 1
    assert all(out.count("compiled barrier R=2 E=96") == 1 for out in outputs), outputs  # each its own output
    assert compile_check.run_in_compile_child("os:getpid")[0] == pid
    # a request whose artifacts are not wanted leaves none for the next one
    compile_check.run_in_compile_child("csrc_cute.sync:compile_all_for_check", BARRIER)
    compile_check.run_in_compile_child("os:getpid", dump_dir=str(tmp_path / "d"))
    assert os.listdir(tmp_path / "d") == []


def test_a_failed_request_names_its_cause_and_the_next_gets_a_new_child():
    pid, _ = compile_check.run_in_compile_child("os:getpid")
    with pytest.raises(RuntimeError, match=r"(?s)compile of csrc_cute\.no_such_module:f for sm_90a failed: "
                                           r".*ModuleNotFoundError"):
        compile_check.run_in_compile_child("csrc_cute.no_such_module:f")
    new_pid, _ = compile_check.run_in_compile_child("os:getpid")
    assert new_pid != pid


def sleep_for(seconds: float) -> None:
    """A request that outlasts its timeout (the child imports this module)."""
    time.sleep(seconds)


def test_a_request_past_its_timeout_ends_the_child():
    pid, _ = compile_check.run_in_compile_child("os:getpid")
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"compile of tests\.test_compile_check:sleep_for for sm_90a failed: "
                                           r"timed out after 1 s"):
        compile_check.run_in_compile_child("tests.test_compile_check:sleep_for", dict(seconds=60), timeout=1)
    assert time.monotonic() - t < 30  # killed, not waited for
    assert compile_check.run_in_compile_child("os:getpid")[0] != pid
