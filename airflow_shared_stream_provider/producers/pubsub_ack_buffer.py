"""
Pub/Sub's settle batching: acks and nacks gathered across ``advance`` calls and sent in batched
calls by one background task, so the manager's many small advances (one per lane, often one
message each) cost one broker call per ``batch_size`` messages instead of one each.

Beside the Pub/Sub producer (:mod:`.pubsub`) because it is its only user; it makes no Pub/Sub
call (ids and two send functions), so a second broker whose late ack is harmless would move it
back to ``_core``.

Invariants: an id is sent at most once by the buffer (it is taken out before its call); a send
that raises is never retried here and ends the flusher: the error is kept in
:attr:`AckBuffer.fatal` for the receive loop to raise (the group fails, the broker redelivers what
was not acked: at least once, never lost). A producer uses this only where a late ack is harmless
(the broker keeps the message leased meanwhile); a settlement ``advance`` must see done is awaited
there instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from airflow_shared_stream_provider._core.retry import chunks
from airflow_shared_stream_provider._core.tasks import cancel_and_wait

SendFn = Callable[[Sequence[str]], Awaitable[object]]


@dataclass(slots=True, eq=False)
class AckBuffer:
    """Ids to ack and to nack, sent by :meth:`start`'s task every ``interval`` s or ``batch_size`` ids."""

    send_acks: SendFn
    send_nacks: SendFn
    batch_size: int
    interval: float
    log: logging.Logger
    where: str = ""
    acks: list[str] = field(default_factory=list)
    nacks: list[str] = field(default_factory=list)
    fatal: BaseException | None = None
    """The error that ended the flusher; the receive loop raises it."""
    _wakeup: asyncio.Event | None = field(default=None, init=False)
    _lock: asyncio.Lock | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def add(self, acks: Iterable[str], nacks: Iterable[str]) -> None:
        """Queue ids for the next batched calls (``advance``: no await, no broker call)."""
        self.acks.extend(acks)
        self.nacks.extend(nacks)
        if self._wakeup is not None and (self.acks or self.nacks):
            self._wakeup.set()

    def start(self, name: str, *, where: str) -> None:
        """Start the flusher (in the stream's event loop, once the stream is open); ``where`` names it in logs."""
        self.where = where
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task = asyncio.create_task(self._run(), name=name)

    async def stop(self) -> None:
        """Stop the flusher; what is still queued stays queued for a last :meth:`flush`."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def flush(self) -> None:
        """Send every queued id now: acks, then nacks, in calls of at most ``batch_size``."""
        lock = self._lock
        if lock is None:
            return  # never started: nothing was received, nothing can be queued for the broker
        async with lock:
            while self.acks or self.nacks:
                acks, self.acks = self.acks, []
                nacks, self.nacks = self.nacks, []
                for chunk in chunks(acks, self.batch_size):
                    await self.send_acks(chunk)
                for chunk in chunks(nacks, self.batch_size):
                    await self.send_nacks(chunk)

    async def _run(self) -> None:
        wakeup = self._wakeup
        assert wakeup is not None
        while True:
            await wakeup.wait()
            if self.interval > 0 and len(self.acks) + len(self.nacks) < self.batch_size:
                await asyncio.sleep(self.interval)  # let more ids gather into the same calls
            wakeup.clear()
            try:
                await self.flush()
            except Exception as exc:  # surfaced through the receive loop
                self.log.error("Acknowledging on %s failed; terminating the stream", self.where, exc_info=True)
                self.fatal = exc
                return
