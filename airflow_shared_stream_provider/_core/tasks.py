"""
Cancelling, waiting and closing: the asyncio chores every broker producer has when a stream stops.

Invariant: a producer that is stopping never raises out of these (the manager is already ending
the group, and a close that raises would strand what is left to release); what fails is logged
and left to the broker (a lease that lapses redelivers its message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


class Closable(Protocol):
    def close(self) -> Awaitable[Any]: ...


async def wait_for(awaitable: Awaitable[_T], timeout: float | None) -> _T:
    """
    ``asyncio.wait_for`` that never loses a cancellation: use it instead, everywhere.

    Before Python 3.12, ``asyncio.wait_for`` swallows a cancellation of its caller that arrives in
    the loop turn its awaitable completes: it returns the result, and the caller runs on, cancelled
    in name only. The manager stops a group by cancelling its poll task, often in the very turn
    a watcher's departure sets the event a stream waits on (the cohort wait, the credit wait): the
    stream then ran forever with no watcher and ``unsubscribe`` never returned (found by
    tests/unit/test_filter_isolation.py run alone). Here the caller's cancellation always
    propagates; a timeout raises ``asyncio.TimeoutError`` after the awaitable was cancelled and
    ended, as with ``asyncio.wait_for``. On 3.12+ this is ``asyncio.wait_for`` (fixed there).
    """
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(awaitable, timeout)
    task = asyncio.ensure_future(awaitable)
    if timeout is None:
        return await task  # awaiting a task directly: a cancellation reaches it, or us after it ended
    try:
        # asyncio.wait only waits: a cancellation of ours raises here even if the task just ended.
        await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # it ends (bpo-32751); a cancellation of ours meanwhile raises
    if not task.cancelled() and task.exception() is None:
        return task.result()  # it finished despite the cancel: its result, as asyncio.wait_for
    raise asyncio.TimeoutError


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """
    Cancel what is still running and wait for it to end. The errors of tasks that already ended are
    retrieved and dropped (no "exception was never retrieved"): the caller is stopping them.
    """
    running = [task for task in tasks if task is not None]
    for task in running:
        if not task.done():
            task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def first_of(awaitables: Sequence[Awaitable[Any]], timeout: float | None) -> None:
    """Return when any of ``awaitables`` finished (raising its error) or ``timeout`` passed; cancel the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def best_effort(
    step: Awaitable[Any], log: logging.Logger, failure: str, *args: object, timeout: float | None
) -> bool:
    """
    Await one closing step for at most ``timeout`` seconds (None: no limit). On an error or the timeout, log
    ``failure % args`` (say what the broker does with what was not done) and return False.
    """
    try:
        await wait_for(step, timeout=timeout)
    except Exception:
        log.warning(failure, *args, exc_info=True)
        return False
    return True


async def close_quietly(*closables: Closable | None, log: logging.Logger, where: str) -> None:
    """Close each of ``closables`` in order (None is skipped); an error is logged, never raised."""
    for closable in closables:
        if closable is None:
            continue
        try:
            await closable.close()
        except Exception:
            log.warning("%s: error closing %s", where, type(closable).__name__, exc_info=True)
