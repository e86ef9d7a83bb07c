"""tests/long_tests.txt, which tests/conftest.py uses to start the long tests first: every entry names an
existing test function, once; and a collection puts them first, in the file's order."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entries() -> list[str]:
    with open(os.path.join(ROOT, "tests", "long_tests.txt")) as f:
        return [n for n in (ln.split("#")[0].strip() for ln in f) if n]


def test_every_entry_names_one_existing_test_function():
    entries = _entries()
    assert len(entries) == len(set(entries)), "an entry is listed twice"
    for entry in entries:
        path, func = entry.split("::")
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in names, f"{entry}: no such test function (renamed? update tests/long_tests.txt)"


def test_collection_starts_with_the_listed_tests():
    """conftest's hook puts listed tests first, in the list's order (every parameter of a listed function),
    the rest after them in the order pytest collected them."""
    from types import SimpleNamespace

    from conftest import pytest_collection_modifyitems

    first, second = _entries()[:2]
    ids = ["tests/test_a.py::test_unlisted", f"{second}[1]", "tests/test_b.py::test_other", f"{first}[x]",
           f"{second}[0]"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{first}[x]", f"{second}[1]", f"{second}[0]",
                                         "tests/test_a.py::test_unlisted", "tests/test_b.py::test_other"]
