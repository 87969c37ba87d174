"""The opt-in of the long test variants (marked ``slow``), written once for every suite that has them."""

from __future__ import annotations

import os
import re

import pytest


def slow_asked(config: pytest.Config, env_var: str) -> bool:
    """True when the run asked for slow tests (``-m slow``, not ``-m "not slow"``) or ``env_var`` is ``1``."""
    markexpr = str(config.getoption("markexpr", "") or "")
    return re.search(r"(?<!not )\bslow\b", markexpr) is not None or os.environ.get(env_var) == "1"
