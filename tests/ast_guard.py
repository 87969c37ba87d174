"""
``ast.parse`` that survives CPython 3.11.7's AST recursion-counter bug (gh-106905, fixed in 3.11.8).

3.11 keeps the AST constructor's recursion depth in global state and resets it at the start of each
``ast.parse``. A parse that runs *inside* another one (the cyclic garbage collector runs finalizers in
the middle of the outer parse's allocations; a finalizer that logs an exception formats a traceback,
and 3.11's ``traceback`` calls ``ast.parse`` to place its carets; asyncio's "Task was destroyed but it
is pending" is one) leaves the counter where the inner parse started, and the outer one fails with
"SystemError: AST constructor recursion depth mismatch". CI went red once on exactly that, in a test
that only reads source files. The state is reset by the next call, so the failed parse is simply run
again: it is a pure function of its arguments.
"""

from __future__ import annotations

import ast
from typing import Any

_ATTEMPTS = 5
_MISMATCH = "recursion depth mismatch"


def install() -> None:
    """Replace ``ast.parse`` (every caller looks it up on the module) with the retrying one, once."""
    if getattr(ast.parse, "_retries_depth_mismatch", False):
        return
    parse = ast.parse

    def parse_again_on_depth_mismatch(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(_ATTEMPTS):
            try:
                return parse(*args, **kwargs)
            except SystemError as error:
                if _MISMATCH not in str(error) or attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    parse_again_on_depth_mismatch._retries_depth_mismatch = True  # type: ignore[attr-defined]
    ast.parse = parse_again_on_depth_mismatch  # type: ignore[assignment]
