"""
The upstream comparisons of ``bench/stream_bench.py``: one module per broker that has one
(``bench/upstream/<broker>.py``, found by the broker's registry name), each running the upstream
provider's trigger loop (or, where that provider is not installed, its pattern reproduced) the way
an AssetWatcher user runs it, on the stream the bench made and filled.

A module defines ``LABEL`` (what the table calls it) and ``async def drain(stream, n, messages,
timeout, variant) -> Drained``; optionally ``VARIANTS`` (names of settings it measures one row
each, on a fresh backlog; default one row, variant ``""``), ``async def idle_calls(stream, n,
seconds) -> float`` (broker calls per minute on an empty stream) and ``async def
kill_check(broker, messages, kills) -> dict`` (``--kill``: messages lost to ``kill -9``), and
``available() -> bool`` (False: the upstream provider is not installed here; the broker's upstream
rows are then reported as skipped). The clock
and the CPU window are the module's: the backlog is published before ``drain`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.triggerer_bench import BenchBroker, BenchStream


@dataclass
class Drained:
    """One measured drain: what the N watchers together persisted, how long it took, at what cost."""

    label: str
    messages: int  # messages persisted by at least one watcher (upstream watchers compete for them)
    seconds: float
    cpu: float  # CPU seconds of the process that ran the watchers, over the same window
    seen: float  # mean share of the backlog one watcher persisted (1.0: every watcher saw everything)
    calls: int | None = None  # broker calls in the window, where the module counts them
    note: str = ""


def upstream_module(broker: str) -> ModuleType | None:
    """``bench.upstream.<broker>``, or None when the broker has no upstream comparison."""
    name = f"{__name__}.{broker}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (its parent packages included), without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def upstream_available(module: ModuleType) -> bool:
    """Whether the module's upstream trigger can run here (its ``available()``; True without one)."""
    available = getattr(module, "available", None)
    return True if available is None else bool(available())


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the watcher tasks and wait for each (their own errors are theirs: not the bench's)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(BaseException):
            await task


async def until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` every 20 ms until it holds (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def new_stream(broker: BenchBroker, case_id: str, *, settle: bool = False) -> BenchStream:
    """``broker.stream(...)`` in a worker thread: a kit's admin client may run an event loop of its own."""
    return await asyncio.to_thread(lambda: broker.stream(case_id, settle=settle))
