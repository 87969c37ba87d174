"""
Retrying broker calls: a whole call, a batch call that fails for part of its entries, and the
backoff between attempts. No broker SDK: the producer says what a failure means, this module only
counts attempts and waits.

Invariant: nothing here turns a failure into a success. What still fails after the last attempt is
handed back (:func:`retry_entries`) or its error raised (:func:`retry_call`); the producer decides
whether that message is redelivered by the broker or the ``advance`` must fail.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

Retry = tuple[list[T], str]
"""What one attempt of a batch call leaves: the entries a retry may still fix, and why they failed."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: ``base`` seconds before the first retry, doubling, at most ``cap``."""

    base: float
    cap: float = math.inf

    def delay(self, retry: int) -> float:
        """Seconds to wait before the ``retry``-th retry (1-based)."""
        return min(self.cap, self.base * 2.0 ** (retry - 1))


class ErrorStreak:
    """
    Consecutive failures of a call that is repeated for as long as the stream runs (a receive, an
    accept): how long to wait before the next try, and when to give up (``limit`` in a row; None:
    never). A success resets the streak.
    """

    __slots__ = ("backoff", "count", "limit")

    def __init__(self, backoff: Backoff, *, limit: int | None = None) -> None:
        self.backoff = backoff
        self.limit = limit
        self.count = 0

    def failed(self) -> float | None:
        """Count one more failure; the delay before the next try, or None once ``limit`` is reached."""
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            return None
        return self.backoff.delay(self.count)

    def reset(self) -> None:
        self.count = 0


async def retry_entries(
    entries: Iterable[T],
    send: Callable[[list[T]], Awaitable[Retry[T]]],
    *,
    attempts: int,
    backoff: Backoff,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> Retry[T]:
    """
    Send ``entries`` with ``send``, then resend what it says a retry may fix, up to ``attempts``
    calls in all, waiting ``backoff`` between them.

    ``send(pending)`` returns the entries to retry and why they failed (entries that failed for
    good it keeps to itself); it raises for an error no retry can fix. Returns what still failed
    after the last attempt with the last reason given (``([], "")`` when everything went through).
    No call is made for no entries.
    """
    pending = list(entries)
    error = ""
    for attempt in range(attempts):
        if not pending:
            break
        if attempt:
            await sleep(backoff.delay(attempt))
        pending, why = await send(pending)
        error = why or error
    return pending, error


async def retry_call(
    call: Callable[[], Awaitable[R]],
    *,
    attempts: int,
    backoff: Backoff,
    retriable: Callable[[BaseException], bool],
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> R:
    """Await ``call()``; on an error ``retriable`` accepts, call again (``attempts`` calls in all), else raise it."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as exc:
            if attempt >= attempts or not retriable(exc):
                raise
        await sleep(backoff.delay(attempt))


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size`` (a broker's most entries per batch call)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
