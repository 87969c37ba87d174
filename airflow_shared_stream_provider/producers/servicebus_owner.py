"""
The work other tasks queue for the one task that uses a Service Bus receiver (without sessions).

The SDK's receiver is not coroutine-safe, and a settlement awaited while a receive call is in
flight waits for that call's read cycle (measured: 5 settlements/s instead of 2,600/s). So the
receive loop owns the receiver: ``advance`` (settlements) and the lease keeper (lock renewals) only
queue work here, and the loop runs it between receive calls (:meth:`OwnerQueue.run`), in order, on
the receiver that received the messages. Session receivers own theirs the same way, one per
session (:mod:`.servicebus_sessions`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from airflow_shared_stream_provider._core.producer import Decided
from airflow_shared_stream_provider.producers.servicebus_types import ServiceBusDelivery, ServiceBusReceiver

SettleOne = Callable[[ServiceBusReceiver, Decided[ServiceBusDelivery]], Awaitable[None]]
RenewNow = Callable[[ServiceBusReceiver, Sequence[str]], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class _Request:
    """Settle a batch, or renew locks (the keeper awaits ``future``)."""

    kind: Literal["settle", "renew"]
    entries: tuple[Decided[ServiceBusDelivery], ...] = ()
    tokens: tuple[str, ...] = ()
    future: asyncio.Future[list[str]] | None = None


class OwnerQueue:
    """Settlements and renewals waiting for the receiver's owner; ``ready`` is set while any wait."""

    def __init__(self, *, settle_one: SettleOne, renew_now: RenewNow, concurrency: int) -> None:
        self._settle_one = settle_one
        self._renew_now = renew_now
        self.concurrency = concurrency
        """Settlements awaited at once (never overlapping a receive call)."""
        self.ready = asyncio.Event()
        self._requests: deque[_Request] = deque()

    def __bool__(self) -> bool:
        return bool(self._requests)

    def settle(self, entries: Sequence[Decided[ServiceBusDelivery]]) -> None:
        """Queue one lane's outcomes (``advance``); they are settled in this order."""
        self._submit(_Request("settle", entries=tuple(entries)))

    async def renew(self, lock_tokens: Sequence[str]) -> list[str]:
        """Queue a renewal of these locks and wait for it; return the tokens whose lock was lost."""
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._submit(_Request("renew", tokens=tuple(lock_tokens), future=future))
        return await future

    def _submit(self, request: _Request) -> None:
        self._requests.append(request)
        self.ready.set()

    async def run(self, receiver: ServiceBusReceiver) -> None:
        """(The owner) carry out the queued settlements and renewals, in order, on ``receiver``."""
        requests = self._requests
        while requests:
            request = requests.popleft()
            if request.kind == "renew":
                try:
                    result = await self._renew_now(receiver, request.tokens)
                except BaseException as exc:
                    if request.future is not None and not request.future.done():
                        request.future.set_exception(exc)
                    raise
                if request.future is not None and not request.future.done():
                    request.future.set_result(result)
                continue
            # Consecutive settle requests are merged and settled ``concurrency`` at a time.
            pending = deque(request.entries)
            while requests and requests[0].kind == "settle":
                pending.extend(requests.popleft().entries)
            try:
                while pending:
                    chunk = [pending.popleft() for _ in range(min(self.concurrency, len(pending)))]
                    try:
                        if len(chunk) == 1:
                            await self._settle_one(receiver, chunk[0])
                        else:
                            await asyncio.gather(*(self._settle_one(receiver, entry) for entry in chunk))
                    except BaseException:
                        pending.extendleft(reversed(chunk))
                        raise
            finally:
                if pending:
                    # Cancelled (the group is stopping) or failed mid-batch: keep what is left for
                    # ``aclose``, which settles it before closing the receiver.
                    requests.appendleft(_Request("settle", entries=tuple(pending)))
                    self.ready.set()
        self.ready.clear()

    def cancel(self) -> None:
        """The receiver is gone: drop what is queued; a renewal still awaited is cancelled."""
        for request in self._requests:
            if request.future is not None and not request.future.done():
                request.future.cancel()
        self._requests.clear()
