"""``tests/slow_tests.txt`` names real tests: an id left behind by a rename or a move would silently
put its test back into the default run (or hide a typo)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_functions(path: pathlib.Path) -> set:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_listed_id_names_a_test_function_of_a_test_file(listed_slow_ids):
    ids = listed_slow_ids
    assert ids
    for node_id in sorted(ids):
        m = re.fullmatch(r"(tests/[\w/]+\.py)::(\w+)(\[.+\])?", node_id)
        assert m, f"slow_tests.txt: {node_id!r} is not a node id 'tests/PATH.py::test_NAME[PARAMS]'"
        path = ROOT / m.group(1)
        assert path.is_file(), f"slow_tests.txt: {node_id!r}: no file {m.group(1)}"
        assert m.group(2) in _test_functions(path), f"slow_tests.txt: {node_id!r}: no {m.group(2)} in {m.group(1)}"
