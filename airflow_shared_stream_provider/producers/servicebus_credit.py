"""
The flow gate's credit shared by several receivers of one stream (Service Bus session receivers,
:mod:`.servicebus_sessions`, its only user): together they never receive more than the watchers
can queue. No Service Bus call here: a broker with several receivers per stream would share it
from ``_core``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from airflow_shared_stream_provider._core.tasks import first_of


class CreditPool:
    """
    The flow gate's credit, shared by the receivers of one stream.

    Invariant: ``reserved`` counts messages some receiver may still add to the stream (credit
    taken for a receive call in flight, or received messages not yet broadcast). A receiver may
    reserve only ``credit() - reserved``, so all receivers together never broadcast more than the
    gate allows. One task at a time waits on the gate (``wait_for_credit``); the others share it.
    """

    def __init__(self, credit: Callable[[], int], wait_for_credit: Callable[[], Awaitable[int]]) -> None:
        self._credit = credit
        self._wait_for_credit = wait_for_credit
        self.reserved = 0
        self._changed = asyncio.Event()
        self._gate_waiter: asyncio.Future[int] | None = None

    def available(self) -> int:
        return self._credit() - self.reserved

    def try_reserve(self, want: int, *, sharers: int = 1) -> int:
        """Reserve up to ``want``: no more than is free, nor than an equal share of the gate's
        credit among ``sharers`` (so one receiver's long idle wait cannot hold all of it)."""
        credit = self._credit()
        available = credit - self.reserved
        if available <= 0 or want <= 0:
            return 0
        share = max(1, -(-credit // max(1, sharers)))
        taken = min(want, share, available)
        self.reserved += taken
        return taken

    def release(self, count: int) -> None:
        """``count`` reserved messages will not be broadcast (a short receive, a dropped message)."""
        if count > 0:
            self.reserved -= count
            self._changed.set()

    def consumed(self, count: int = 1) -> None:
        """``count`` reserved messages are being broadcast now: the gate takes them over."""
        self.reserved -= count
        self._changed.set()

    async def reserve(self, want: int, *, sharers: int, wake: asyncio.Event, timeout: float | None) -> int:
        """Reserve credit, waiting for some; 0 if ``wake`` was set or ``timeout`` passed first."""
        taken = self.try_reserve(want, sharers=sharers)
        if taken or wake.is_set() or timeout == 0:
            return taken
        await first_of((self._wait_available(), wake.wait()), timeout)
        return self.try_reserve(want, sharers=sharers)

    async def _wait_available(self) -> None:
        if self._credit() > 0:
            # The gate has credit but reservations hold it: wait until one is released or used.
            self._changed.clear()
            await self._changed.wait()
            return
        if self._gate_waiter is None or self._gate_waiter.done():
            self._gate_waiter = asyncio.ensure_future(self._wait_for_credit())
        await asyncio.shield(self._gate_waiter)

    async def close(self) -> None:
        waiter, self._gate_waiter = self._gate_waiter, None
        if waiter is not None and not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
