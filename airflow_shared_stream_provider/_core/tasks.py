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
log = logging.getLogger(__name__)

# Seconds :func:`wait_for` gives a task it cancelled (because we were) to end before we go on.
_CANCEL_GRACE = 1.0


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

    Before 3.12 the awaitable runs as a task of its own that is only *waited for*
    (``asyncio.wait``), with or without a timeout: our cancellation raises here even if the task
    just ended, or swallowed the cancellation passed on to it (a client library's own
    ``asyncio.wait_for``, see :func:`call_keeping_cancellation`).
    """
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(awaitable, timeout)
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        # Let it end before we do (a client call winding down before its client is closed),
        # but not forever: a task that ignores its cancellation must not hold ours.
        await asyncio.wait((task,), timeout=_CANCEL_GRACE)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: we are ending, what it raised meanwhile is dropped
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # it ends (bpo-32751); a cancellation of ours meanwhile raises
    if not task.cancelled() and task.exception() is None:
        return task.result()  # it finished despite the cancel: its result, as asyncio.wait_for
    raise asyncio.TimeoutError


async def call_keeping_cancellation(call: Awaitable[_T], where: str) -> _T:
    """
    Await a call into a client library such that a cancellation of ours it loses still ends us.

    The manager stops a stream by cancelling its poll task and awaits its end (``unsubscribe``,
    triggerer shutdown). A library can lose a cancellation that reaches it mid-call: redis-py's
    asyncio client sends each command through ``asyncio.wait_for``, which before Python 3.12
    swallows a cancellation arriving in the turn the send completes. The receive loop then read
    on, cancelled in name only, with nobody listening, holding its connection and leases, and
    ``unsubscribe`` never returned (``tests/integration/redis``' lease test hung in 10 of 28 runs
    on a loaded machine; docs/production.md, finding 8). ``where`` names the stream in the warning this logs then.

    Python 3.11+: the call is awaited in place and ``Task.cancelling()``, which still counts the
    lost request, is checked after it. 3.10 has no such count: the call runs in a task of its own
    that we wait for with ``asyncio.wait``, which raises our cancellation whatever the call does
    with the one passed on to it. Either way, what the call returned is dropped: the stream is
    ending, and a message it received is redelivered by the broker (its lease lapses).
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is None:  # Python 3.10: a task of its own, only waited for (see wait_for)
        return await wait_for(call, None)
    try:
        result = await call
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if cancelling():  # the call turned our cancellation into an error of its own
            _log_lost_cancellation(where)
            raise asyncio.CancelledError from exc
        raise
    if cancelling():
        _log_lost_cancellation(where)
        raise asyncio.CancelledError
    return result


def _log_lost_cancellation(where: str) -> None:
    log.warning("%s: a client call lost the cancellation of this stream; ending it as asked", where)


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
