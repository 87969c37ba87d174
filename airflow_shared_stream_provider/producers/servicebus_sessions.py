"""
Session-enabled Service Bus entities: one session receiver per accepted session, under one client.

:class:`SessionPool` runs ``max_concurrent_sessions`` *slots*. A slot accepts the next available
session (``session_id=NEXT_AVAILABLE_SESSION``: the broker hands out a session that has a message
and that no receiver holds), serves it with a :class:`SessionReceiver` until the session is
released, then accepts again. Each :class:`SessionReceiver` is the single owner of its SDK
receiver (the SDK receiver is not coroutine-safe): it receives, settles and renews the session
lock in one task, settlements always between receive calls and on the receiver that received the
message. Received messages go to one queue that ``open_stream`` broadcasts from.

Ordering invariant, per session: a message is completed only after every earlier message of its
session that this receiver received was completed or dead-lettered. The manager already advances
one lane (= session id) in fan-out order; what it cannot do is stop a later message from being
completed after an earlier one was abandoned. So a message that is not settled for good
(``REDELIVER`` / ``HOLD``) *holds* its session: it is abandoned (``delivery_count + 1``, so the
poison cap and ``MaxDeliveryCount`` still end a poison message), nothing later of that session is
settled on this receiver, and the receiver is closed, which releases the later messages without
counting a delivery. The broker then serves the session again from the abandoned message on.

A session ends in one of three ways, each closing its receiver so another session gets a turn:
*idle* (nothing unsettled, no message for ``session_idle_timeout``), *held* (above), *lost*
(``SessionLockLostError``: the broker redelivers every unsettled message of the session with
``delivery_count + 1``). Messages of an ended session still in the manager are not settled when
they advance: they are reported as redelivered.

Credit: the flow gate's credit is shared by every session receiver through :class:`CreditPool`,
so that all of them together never receive more than the watchers can queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal

from airflow_shared_stream_provider._core.dispositions import Decision, Disposition
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError, missing_dependency
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.producer import Decided

try:
    from azure.servicebus import ServiceBusReceivedMessage
    from azure.servicebus.aio import ServiceBusReceiver
    from azure.servicebus.exceptions import (
        MessageAlreadySettled,
        MessageLockLostError,
        OperationTimeoutError,
        ServiceBusConnectionError,
        ServiceBusError,
        SessionCannotBeLockedError,
        SessionLockLostError,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_dependency("servicebus", "azure-servicebus", exc) from exc

if TYPE_CHECKING:
    from airflow_shared_stream_provider.producers.servicebus import ServiceBusDelivery
    from airflow_shared_stream_provider.triggers.servicebus import ServiceBusStreamSettings

ACCEPT_PAUSE: Final = 1.0
"""Seconds a slot waits after an accept found no session (the accept itself already waited
``max_wait_time`` per SDK attempt on the broker side)."""
ACCEPT_ERROR_BACKOFF: Final = 1.0
ACCEPT_ERROR_BACKOFF_MAX: Final = 30.0
MAX_ACCEPT_ERRORS: Final = 3
"""Consecutive accept failures (each already retried by the SDK) after which the group fails."""
MIN_RECEIVE_WAIT: Final = 0.01

SessionState = Literal["open", "holding", "lost", "released"]
_HOLDS_SESSION: Final = frozenset({Disposition.REDELIVER, Disposition.HOLD})
# A lost message lock on a session receiver can only mean the session lock went first; either way
# the session must be given up, or a later message could be completed ahead of this one.
_LOCK_LOST: Final = (SessionLockLostError, MessageLockLostError, ServiceBusConnectionError)


@dataclass
class ServiceBusCounters(StreamCounters):
    """The shared counters plus what only session-enabled entities have."""

    sessions_accepted: int = 0
    sessions_released: int = 0
    sessions_lost: int = 0


def renew_margin(lease_seconds: float) -> float:
    """Renew a third of the lock duration before expiry, at most 10 s before."""
    return min(10.0, lease_seconds / 3.0)


def _seconds_until(moment: datetime | None) -> float | None:
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - datetime.now(UTC)).total_seconds()


def _earliest(*delays: float | None) -> float | None:
    known = [delay for delay in delays if delay is not None]
    return max(0.0, min(known)) if known else None


async def _first_of(awaitables: Sequence[Awaitable[Any]], timeout: float | None) -> None:
    """Return when any of ``awaitables`` finished or ``timeout`` passed; cancel the others."""
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


class CreditPool:
    """
    The flow gate's credit, shared by the session receivers.

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
        credit among ``sharers`` (so one session's long idle wait cannot hold all of it)."""
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
        await _first_of((self._wait_available(), wake.wait()), timeout)
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


class SessionReceiver:
    """One accepted session: its receiver, its unsettled messages and its queued settlements."""

    def __init__(self, pool: SessionPool, receiver: ServiceBusReceiver) -> None:
        self.pool = pool
        self.receiver = receiver
        self.session_id: str = receiver.session.session_id
        self.state: SessionState = "open"
        self._unsettled: dict[str, ServiceBusReceivedMessage] = {}
        # Outcomes to carry out, in lane (= session) order; only this receiver's task runs them.
        self._requests: deque[Decided[ServiceBusDelivery]] = deque()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._last_batch_empty = True
        self._renew_not_before = 0.0
        # The entity's lock duration, as the first lock shows it (renewals are timed from it).
        self._lock_seconds = max(1.0, _seconds_until(self._locked_until()) or 0.0)

    def __repr__(self) -> str:
        return f"SessionReceiver({self.session_id!r}, {self.state})"

    # -- called from other tasks (synchronously) -------------------------------------------------
    def accepts(self) -> bool:
        """Whether messages it received may still be broadcast and settled."""
        return self.state == "open"

    def take(self, entry: Decided[ServiceBusDelivery]) -> Decided[ServiceBusDelivery]:
        """Queue one outcome for settlement; return what will actually happen to the message."""
        if self.state != "open":
            return Decided(
                entry.delivery,
                Decision(
                    Disposition.REDELIVER,
                    f"session {self.session_id} was given up before this message was settled ({self.state}); "
                    "the broker redelivers it",
                ),
            )
        if entry.disposition in _HOLDS_SESSION:
            # From here on nothing later of this session is settled on this receiver: the message is
            # abandoned, then the receiver closes, releasing the later ones (see the module doc).
            self.state = "holding"
        self._requests.append(entry)
        self._wake.set()
        return entry

    def forget(self, lock_token: str) -> None:
        self._unsettled.pop(lock_token, None)

    # -- the receiver's own task -----------------------------------------------------------------
    async def run(self) -> None:
        """Serve the session until it is idle, held or lost; then close its receiver.

        On cancellation (the group stops) the receiver stays open: :meth:`finish` settles what the
        manager already resolved on it first. Other errors propagate and fail the group.
        """
        try:
            await self._serve()
        except _LOCK_LOST as exc:
            self._lose(exc)
        await self._close()

    async def finish(self) -> None:
        """The group stops: settle what was already decided, then close (releasing the rest).

        Closing the session receiver releases its unsettled messages without counting a delivery,
        which is why they are not abandoned one by one (that would count one each)."""
        try:
            if self.state in ("open", "holding"):
                try:
                    await asyncio.wait_for(self._run_requests(), timeout=self.pool.close_timeout)
                except _LOCK_LOST as exc:
                    self._lose(exc)
                except Exception:
                    self.pool.log.warning(
                        "%s: could not settle every resolved message of session %s on close; closing the "
                        "session releases them",
                        self.pool.entity_path,
                        self.session_id,
                        exc_info=True,
                    )
        finally:
            await self._close()

    async def _serve(self) -> None:
        settings = self.pool.settings
        while True:
            if self._requests:
                # Settlements first: they keep the session moving and give credit back.
                await self._run_requests()
                continue
            self._wake.clear()  # no request pending: a later take() sets it again
            if self.state == "holding":
                self._end("released", "a message of it was abandoned; the session is served again from it")
                return
            now = self._loop.time()
            renew_in = self._renew_in(now)
            if renew_in is not None and renew_in <= 0:
                await self._renew()
                continue
            idle_in = None if self._unsettled else self._last_activity + settings.session_idle_timeout - now
            if idle_in is not None and idle_in <= 0:
                self._end("released", f"idle for {settings.session_idle_timeout:g} s")
                return
            deadline = _earliest(renew_in, idle_in)
            credit = await self.pool.credit.reserve(
                settings.max_message_count, sharers=self.pool.active(), wake=self._wake, timeout=deadline
            )
            if credit:
                await self._receive(credit, deadline)

    async def _receive(self, credit: int, deadline: float | None) -> None:
        settings = self.pool.settings
        counters = self.pool.counters
        # Wait long only when nothing of this session is unsettled: a settlement may be queued at
        # any moment otherwise, and it waits for this call to return (as in the non-session path).
        busy = bool(self._unsettled) or not self._last_batch_empty
        wait = self.pool.busy_wait if busy else settings.max_wait_time
        if deadline is not None:
            wait = min(wait, deadline)
        batch: list[ServiceBusReceivedMessage] = []
        try:
            batch = await self.receiver.receive_messages(
                max_message_count=credit, max_wait_time=max(MIN_RECEIVE_WAIT, wait)
            )
        finally:
            self.pool.credit.release(credit - len(batch))
        if not busy or settings.prefetch_count == 0 or batch:
            counters.add("api_calls")
        self._last_batch_empty = not batch
        if not batch:
            return
        self._last_activity = self._loop.time()
        counters.add("received", len(batch))
        for raw in batch:
            self._unsettled[str(raw.lock_token)] = raw
        self.pool.deliver(self, batch)

    async def _run_requests(self) -> None:
        """Settle the queued outcomes in order, on this session's receiver."""
        while self._requests:
            entry = self._requests[0]
            delivery = entry.delivery
            if delivery.lock_token in self._unsettled:
                try:
                    await self.pool.settle(self.receiver, entry)
                except MessageAlreadySettled:
                    self.pool.log.warning(
                        "%s: message %s was already settled", self.pool.entity_path, delivery.raw.message_id
                    )
            # Popped only once done: a cancelled settlement stays queued for finish().
            self._requests.popleft()
            self.forget(delivery.lock_token)
            self._last_activity = self._loop.time()

    # -- session lock ------------------------------------------------------------------------
    def _locked_until(self) -> datetime | None:
        return self.receiver.session.locked_until_utc

    def _renew_in(self, now: float) -> float | None:
        """Seconds until the session lock should be renewed (None: never, renew_locks=False)."""
        if not self.pool.settings.renew_locks:
            return None
        left = _seconds_until(self._locked_until())
        if left is None:
            return None
        return max(left - renew_margin(self._lock_seconds), self._renew_not_before - now)

    async def _renew(self) -> None:
        """Renew the session lock; a lost lock propagates (``run`` gives the session up)."""
        counters = self.pool.counters
        counters.add("api_calls")
        try:
            await self.receiver.session.renew_lock()
        except _LOCK_LOST:
            raise
        except ServiceBusError:
            # A failed call is not a lost lock: retry shortly, until the lock really runs out.
            self.pool.log.warning(
                "%s: renewing the lock of session %s failed; retrying",
                self.pool.entity_path,
                self.session_id,
                exc_info=True,
            )
            self._renew_not_before = self._loop.time() + min(1.0, renew_margin(self._lock_seconds) / 2)
            return
        counters.add("leases_renewed")

    # -- ending ------------------------------------------------------------------------------
    def _lose(self, exc: BaseException) -> None:
        lost = len(self._unsettled)
        self.state = "lost"
        self.pool.counters.add("sessions_lost")
        self.pool.counters.add("leases_lost", lost)
        self.pool.log.warning(
            "%s: lock of session %s lost (%s); its %d unsettled message(s) are redelivered by the broker "
            "with delivery_count + 1; the group keeps running",
            self.pool.entity_path,
            self.session_id,
            type(exc).__name__,
            lost,
        )
        # Whatever was queued can no longer be settled: the broker has the messages back.
        self._requests.clear()
        self._unsettled.clear()

    def _end(self, state: SessionState, why: str) -> None:
        self.state = state
        self.pool.counters.add("sessions_released")
        self.pool.log.info("%s: releasing session %s: %s", self.pool.entity_path, self.session_id, why)

    async def _close(self) -> None:
        """Close the receiver: the broker releases whatever of the session it still had locked."""
        if self.state == "open":
            self.state = "released"
        self._requests.clear()
        self._unsettled.clear()
        try:
            await asyncio.wait_for(self.receiver.close(), timeout=self.pool.close_timeout)
        except Exception:
            self.pool.log.warning(
                "%s: error closing the receiver of session %s; its lock expires on its own",
                self.pool.entity_path,
                self.session_id,
                exc_info=True,
            )
        # Not reached when cancelled mid-close: the pool's close() then closes it again (finish).
        self.pool.closed(self)


class SessionPool:
    """Accept up to ``max_concurrent_sessions`` sessions and merge what they receive into one stream."""

    def __init__(
        self,
        *,
        settings: ServiceBusStreamSettings,
        counters: StreamCounters,
        log: logging.Logger,
        entity_path: str,
        open_session: Callable[[], Awaitable[ServiceBusReceiver]],
        settle: Callable[[ServiceBusReceiver, Decided[ServiceBusDelivery]], Awaitable[None]],
        credit: CreditPool,
        busy_wait: float,
        close_timeout: float,
    ) -> None:
        self.settings = settings
        self.counters = counters
        self.log = log
        self.entity_path = entity_path
        self.settle = settle
        self.credit = credit
        self.busy_wait = busy_wait
        self.close_timeout = close_timeout
        self.accept_pause = ACCEPT_PAUSE
        self._open_session = open_session
        self._sessions: set[SessionReceiver] = set()
        self._received: deque[tuple[SessionReceiver, ServiceBusReceivedMessage]] = deque()
        self._ready = asyncio.Event()
        self._failure: BaseException | None = None
        self._slots: list[asyncio.Task[None]] = []
        # While no session is to be had, one slot at a time asks the broker (see _accept).
        self._scarce = True
        self._probe = asyncio.Lock()
        self._accept_errors = 0

    def active(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[SessionReceiver]:
        return list(self._sessions)

    def start(self) -> None:
        self._slots = [
            asyncio.create_task(self._slot(), name=f"servicebus-session-slot[{self.entity_path}#{index}]")
            for index in range(self.settings.max_concurrent_sessions)
        ]

    # -- the stream --------------------------------------------------------------------------
    async def next_message(self) -> tuple[SessionReceiver, ServiceBusReceivedMessage]:
        """
        The next received message to broadcast, with its session receiver.

        Its credit reservation is handed to the gate here: the caller must wrap and yield it with
        no ``await`` in between. Messages whose session was given up meanwhile are dropped (never
        broadcast: the broker redelivers them).
        """
        while True:
            if self._failure is not None:
                raise self._failure
            while self._received:
                session, raw = self._received.popleft()
                if session.accepts():
                    self.credit.consumed()
                    return session, raw
                self.credit.release(1)
                session.forget(str(raw.lock_token))
                self.counters.add("stale_skipped")
            self._ready.clear()
            await self._ready.wait()

    def deliver(self, session: SessionReceiver, batch: Sequence[ServiceBusReceivedMessage]) -> None:
        self._received.extend((session, raw) for raw in batch)
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (the manager then fails the group)."""
        if self._failure is None:
            self._failure = exc
        self._ready.set()

    def closed(self, session: SessionReceiver) -> None:
        self._sessions.discard(session)

    # -- slots -------------------------------------------------------------------------------
    async def _slot(self) -> None:
        """Accept a session, serve it until it is released, and again; fail the group on errors."""
        try:
            while True:
                session = await self._accept()
                if session is not None:
                    await session.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(exc)

    async def _accept(self) -> SessionReceiver | None:
        # Invariant: while the last accept found no session, only the slot holding the lock asks;
        # the others wait and fan out again once a session was found.
        if self._scarce:
            async with self._probe:
                if self._scarce:
                    return await self._try_accept()
        return await self._try_accept()

    async def _try_accept(self) -> SessionReceiver | None:
        try:
            receiver = await self._open_session()
        except SharedStreamConfigError:
            raise
        except (OperationTimeoutError, SessionCannotBeLockedError):
            # No session has a message, or all of them are held (by us or other consumers).
            self.counters.add("api_calls")
            self._scarce = True
            self._accept_errors = 0
            await asyncio.sleep(self.accept_pause)
            return None
        except ServiceBusError as exc:
            self.counters.add("api_calls")
            self._accept_errors += 1
            if self._accept_errors >= MAX_ACCEPT_ERRORS:
                raise
            delay = min(ACCEPT_ERROR_BACKOFF_MAX, ACCEPT_ERROR_BACKOFF * 2 ** (self._accept_errors - 1))
            self.log.warning(
                "%s: accepting a session failed (%s: %s); retrying in %.1f s",
                self.entity_path,
                type(exc).__name__,
                exc,
                delay,
            )
            await asyncio.sleep(delay)
            return None
        self.counters.add("api_calls")
        self._scarce = False
        self._accept_errors = 0
        session = SessionReceiver(self, receiver)
        self._sessions.add(session)
        self.counters.add("sessions_accepted")
        self.log.info("%s: accepted session %s", self.entity_path, session.session_id)
        return session

    # -- close -------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop accepting, settle what was decided on each session, close every session receiver."""
        slots, self._slots = self._slots, []
        for task in slots:
            task.cancel()
        if slots:
            await asyncio.wait(slots, timeout=self.close_timeout + 5.0)
        await self.credit.close()
        sessions = list(self._sessions)
        if sessions:
            await asyncio.gather(*(session.finish() for session in sessions), return_exceptions=True)
        self._received.clear()
