"""The opt-in of the long test variants (marked ``slow``), written once for every suite that has them."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Literal

import pytest


def slow_asked(config: pytest.Config, env_var: str) -> bool:
    """True when the run asked for slow tests (``-m slow``, not ``-m "not slow"``) or ``env_var`` is ``1``."""
    markexpr = str(config.getoption("markexpr", "") or "")
    return re.search(r"(?<!not )\bslow\b", markexpr) is not None or os.environ.get(env_var) == "1"


def skip_unless_slow(config: pytest.Config, env_var: str, what: str) -> None:
    """Skip the running test unless :func:`slow_asked`; the reason says how to ask."""
    if not slow_asked(config, env_var):
        pytest.skip(f"{what}: run with -m slow or {env_var}=1")


def slow_opt_in(
    env_var: str, what: str, *, scope: Literal["function", "module"] = "function", autouse: bool = False
) -> Callable[..., None]:
    """
    The fixture ``_slow_opt_in`` of a module with long variants: skips unless :func:`slow_asked`.

    Assign it in the module (``_slow_opt_in = slow_opt_in("KILL_LOOP_SLOW", "kill loop")``) and use it
    first (``usefixtures``, or ``autouse``): ``scope="module"`` skips before the module's broker and
    Airflow fixtures start, which is where the long variants spend their time.
    """

    @pytest.fixture(scope=scope, autouse=autouse, name="_slow_opt_in")
    def _opt_in(request: pytest.FixtureRequest) -> None:
        skip_unless_slow(request.config, env_var, what)

    return _opt_in
