"""
One asyncio lease keeper per producer: keeps in-flight messages invisible to other consumers.

SQS (visibility timeout), Pub/Sub (ack deadline) and Service Bus (peek-lock) all hand out a
message with a lease; if the lease runs out before the producer advances the message, the broker
redelivers it behind our back while a watcher still works on it. The keeper renews leases of
tracked messages in batches, shortly before they expire, and stops renewing a message once it has
been held for ``max_hold`` seconds (the triggerer's ack timeout plus a margin): by then the manager
has failed it and the producer redelivers it anyway.

Owned by the producer instance, started in ``open_stream`` and stopped in ``aclose``. The renewal
pass (:meth:`LeaseKeeper.renew_due`) takes the current time as an argument so unit tests drive it
with a fake clock instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from airflow_shared_stream_provider._core.tasks import wait_for

log = logging.getLogger(__name__)

HandleT = TypeVar("HandleT", bound=Hashable)

RenewFn = Callable[[Sequence[HandleT], float], Awaitable[Sequence[HandleT]]]
"""``renew(handles, lease_seconds)`` -> the handles whose renewal failed (lease lost)."""


@dataclass(slots=True)
class _Lease:
    expires_at: float
    hold_until: float


class LeaseKeeper(Generic[HandleT]):
    """
    Renew leases of tracked handles in batches until they are released or held too long.

    :param renew: coroutine renewing a batch, returning the handles it could not renew.
    :param lease_seconds: lease length requested on each renewal.
    :param renew_margin: renew this many seconds before a lease expires.
    :param max_hold: stop renewing a handle this many seconds after it was tracked.
    :param batch_size: most handles per ``renew`` call (SQS: 10).
    """

    def __init__(
        self,
        *,
        renew: RenewFn[HandleT],
        lease_seconds: float,
        renew_margin: float,
        max_hold: float,
        batch_size: int,
        now: Callable[[], float] = time.monotonic,
        name: str = "lease-keeper",
    ) -> None:
        if renew_margin >= lease_seconds:
            raise ValueError(f"renew_margin ({renew_margin}) must be below lease_seconds ({lease_seconds})")
        self._renew = renew
        self.lease_seconds = lease_seconds
        self.renew_margin = renew_margin
        self.max_hold = max_hold
        self.batch_size = batch_size
        self._now = now
        self._name = name
        self._leases: dict[HandleT, _Lease] = {}
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self.renewals = 0
        self.renew_calls = 0
        self.lost: set[HandleT] = set()

    def __len__(self) -> int:
        return len(self._leases)

    def track(self, handle: HandleT, *, lease_expires_at: float | None = None) -> None:
        """Start keeping ``handle``; its current lease ends at ``lease_expires_at`` (monotonic)."""
        now = self._now()
        expires = lease_expires_at if lease_expires_at is not None else now + self.lease_seconds
        self._leases[handle] = _Lease(expires_at=expires, hold_until=now + self.max_hold)
        if self._changed is not None:
            self._changed.set()

    def release(self, handle: HandleT) -> None:
        self._leases.pop(handle, None)
        self.lost.discard(handle)

    def expires_at(self, handle: HandleT) -> float | None:
        lease = self._leases.get(handle)
        return lease.expires_at if lease else None

    def next_due(self) -> float | None:
        """Monotonic time of the next renewal, or None when nothing is tracked."""
        due = [lease.expires_at - self.renew_margin for lease in self._leases.values()]
        return min(due) if due else None

    async def renew_due(self, now: float) -> int:
        """Renew every lease due at ``now``; return how many were renewed."""
        due: list[HandleT] = []
        for handle, lease in list(self._leases.items()):
            if lease.expires_at - self.renew_margin > now:
                continue
            if now >= lease.hold_until:
                # Held past the ack timeout: the manager has failed it; let the lease lapse.
                del self._leases[handle]
                continue
            due.append(handle)
        renewed = 0
        for start in range(0, len(due), self.batch_size):
            chunk = due[start : start + self.batch_size]
            self.renew_calls += 1
            failed = set(await self._renew(chunk, self.lease_seconds))
            new_expiry = self._now() + self.lease_seconds
            for handle in chunk:
                current = self._leases.get(handle)
                if current is None:
                    continue  # released while the renewal was in flight
                if handle in failed:
                    del self._leases[handle]
                    self.lost.add(handle)
                else:
                    current.expires_at = new_expiry
                    renewed += 1
        self.renewals += renewed
        return renewed

    def start(self) -> None:
        if self._task is None:
            self._changed = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._leases.clear()

    async def _run(self) -> None:
        assert self._changed is not None
        while True:
            due = self.next_due()
            self._changed.clear()
            timeout = None if due is None else max(0.0, due - self._now())
            try:
                await wait_for(self._changed.wait(), timeout=timeout)
                continue  # a new lease may be due earlier: recompute
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                pass
            try:
                await self.renew_due(self._now())
            except Exception:
                # A failed renewal call must not end lease keeping for everything else; the
                # broker redelivers what truly expired and the producer counts it there.
                log.warning("%s: lease renewal failed; retrying", self._name, exc_info=True)
                await asyncio.sleep(min(1.0, self.renew_margin / 2))
