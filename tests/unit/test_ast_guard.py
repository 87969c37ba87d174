"""The test-wide ``ast.parse`` survives a parse nested in it by a finalizer (CPython 3.11.7's bug)."""

from __future__ import annotations

import ast
import gc
import sys
from pathlib import Path

from tests import ast_guard


class _ParsesWhenCollected:
    """Cyclic garbage whose finalizer parses, from a deeper frame, as a logged traceback would."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        def deeper(frames: int) -> ast.AST:
            return deeper(frames - 1) if frames else ast.parse("x + 1")

        deeper(10)


def test_a_parse_nested_by_the_garbage_collector_does_not_fail_the_outer_parse() -> None:
    """On 3.11.7 without the guard every one of these parses fails with a SystemError."""
    ast_guard.install()  # conftest installed it; installing again changes nothing
    source = Path(ast.__file__).read_text()
    gc.collect()
    for _ in range(20):
        for _ in range(200):
            _ParsesWhenCollected()
        tree = ast.parse(source)
        assert any(isinstance(node, ast.FunctionDef) and node.name == "parse" for node in tree.body)
    print(sys.version.split()[0], "parsed 20 times with finalizers parsing inside")
