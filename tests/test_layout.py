"""Size limits of the kernel sources (issue 16): no function in csrc_cute/ longer than 250 lines, no module
over 900 lines. Read with `ast`, so a kernel body (a `@cute.kernel` function) counts like any function."""

import ast
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc_cute"
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 250, 900
MODULES = sorted(CSRC.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CSRC)))
def test_kernel_module_sizes(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.name}: {text.count(chr(10))} lines > {MAX_MODULE_LINES}"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_limits_see_every_package():
    assert {p.parent.name for p in MODULES} >= {"csrc_cute", "group_gemm"} and len(MODULES) > 10
