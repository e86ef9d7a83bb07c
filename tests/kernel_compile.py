"""The CI check every CuTe kernel module gets: compile its kernels for sm_90a on this machine (no GPU)
and read ptxas' statistics."""

import tempfile

import pytest


def check_module_compiles(target: str, kernels: tuple[str, ...], n_configs: int, kwargs: dict | None = None,
                          files_per_config: int | None = None, extra: dict[str, int] | None = None) -> None:
    """Compile `target` ("csrc_cute.<module>:compile_all_for_check") in a child process; every kernel name
    in `kernels` must appear once per config (plus `extra[name]` more variants), every kernel use
    registers and spill nothing; with `files_per_config`, that many PTX and cubin files per config (plus
    the extra variants'). Skips when ptxas is missing."""
    extra = extra or {}
    from csrc_cute import compile_check

    if compile_check.find_ptxas() is None:
        pytest.skip("ptxas not found")
    with tempfile.TemporaryDirectory() as tmp:
        res = compile_check.run_compile_check(target, tmp, kwargs=kwargs)
    print()
    print(res.summary())
    names = [s.name for s in res.stats]
    for k in kernels:
        assert sum(k in n for n in names) == n_configs + extra.get(k, 0), (k, names)
    if files_per_config is not None:
        want = files_per_config * n_configs + sum(extra.values())
        assert len(res.ptx) == want and len(res.cubin) == want, (len(res.ptx), len(res.cubin), want)
    for s in res.stats:
        assert s.registers > 0 and s.spill_bytes == 0, s
