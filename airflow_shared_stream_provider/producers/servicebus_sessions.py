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
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Final, Literal

from airflow_shared_stream_provider._core.dispositions import Decision, Disposition
from airflow_shared_stream_provider._core.errors import BrokerUnavailableError, SharedStreamConfigError
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.logsafe import log_safe
from airflow_shared_stream_provider._core.producer import Decided
from airflow_shared_stream_provider._core.tasks import best_effort, wait_for
from airflow_shared_stream_provider.producers.servicebus_credit import CreditPool
from airflow_shared_stream_provider.producers.servicebus_types import (
    LOCK_LOST,
    NO_SESSION,
    ServiceBusCounters,
    ServiceBusDelivery,
    ServiceBusReceivedMessage,
    ServiceBusReceiver,
    errors,
    receive_batch,
    renew_margin,
    seconds_until,
)
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusStreamSettings

# CreditPool, ServiceBusCounters and renew_margin are part of what this module offers (they were
# defined here before the shared pieces moved one floor down).
__all__ = ["CreditPool", "ServiceBusCounters", "SessionPool", "SessionReceiver", "renew_margin"]

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
_LOCK_LOST: Final = (*LOCK_LOST, errors.ServiceBusConnectionError)


def _earliest(*delays: float | None) -> float | None:
    known = [delay for delay in delays if delay is not None]
    return max(0.0, min(known)) if known else None


class SessionReceiver:
    """One accepted session: its receiver, its unsettled messages and its queued settlements."""

    def __init__(self, pool: SessionPool, receiver: ServiceBusReceiver) -> None:
        self.pool = pool
        self.receiver = receiver
        self.session_id: str = receiver.session.session_id
        self.state: SessionState = "open"
        # Received on this session and not settled (the session lock covers them: no per-message lease).
        self._unsettled: InFlight[str, ServiceBusReceivedMessage] = InFlight(pool.counters)
        # Outcomes to carry out, in lane (= session) order; only this receiver's task runs them.
        self._requests: deque[Decided[ServiceBusDelivery]] = deque()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._last_batch_empty = True
        self._renew_not_before = 0.0
        # The entity's lock duration, as the first lock shows it (renewals are timed from it).
        self._lock_seconds = max(1.0, seconds_until(self._locked_until()) or 0.0)

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
                    f"session {log_safe(self.session_id)} was given up before this message was settled ({self.state}); "
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
        self._unsettled.settled(lock_token)

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
                    await wait_for(self._run_requests(), timeout=self.pool.close_timeout)
                except _LOCK_LOST as exc:
                    self._lose(exc)
                except Exception:
                    self.pool.log.warning(
                        "%s: could not settle every resolved message of session %s on close; closing the "
                        "session releases them",
                        self.pool.entity_path,
                        log_safe(self.session_id),
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
            batch = await receive_batch(
                self.receiver,
                count=credit,
                wait=max(MIN_RECEIVE_WAIT, wait),
                busy=busy,
                settings=settings,
                counters=counters,
            )
        finally:
            self.pool.credit.release(credit - len(batch))
        self._last_batch_empty = not batch
        if not batch:
            return
        self._last_activity = self._loop.time()
        counters.add("received", len(batch))
        for raw in batch:
            self._unsettled.add(str(raw.lock_token), raw)
        self.pool.deliver(self, batch)

    async def _run_requests(self) -> None:
        """Settle the queued outcomes in order, on this session's receiver."""
        while self._requests:
            entry = self._requests[0]
            delivery = entry.delivery
            if delivery.lock_token in self._unsettled:
                try:
                    await self.pool.settle(self.receiver, entry)
                except errors.MessageAlreadySettled:
                    self.pool.log.warning(
                        "%s: message %s was already settled", self.pool.entity_path, log_safe(delivery.raw.message_id)
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
        left = seconds_until(self._locked_until())
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
        except errors.ServiceBusError:
            # A failed call is not a lost lock: retry shortly, until the lock really runs out.
            self.pool.log.warning(
                "%s: renewing the lock of session %s failed; retrying",
                self.pool.entity_path,
                log_safe(self.session_id),
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
            log_safe(self.session_id),
            type(exc).__name__,
            lost,
        )
        # Whatever was queued can no longer be settled: the broker has the messages back.
        self._requests.clear()
        self._unsettled.drain()

    def _end(self, state: SessionState, why: str) -> None:
        self.state = state
        self.pool.counters.add("sessions_released")
        self.pool.log.info("%s: releasing session %s: %s", self.pool.entity_path, log_safe(self.session_id), why)

    async def _close(self) -> None:
        """Close the receiver: the broker releases whatever of the session it still had locked."""
        if self.state == "open":
            self.state = "released"
        self._requests.clear()
        self._unsettled.drain()
        await best_effort(
            self.receiver.close(),
            self.pool.log,
            "%s: error closing the receiver of session %s; its lock expires on its own",
            self.pool.entity_path,
            log_safe(self.session_id),
            timeout=self.pool.close_timeout,
        )
        # Not reached when cancelled mid-close: the pool's close() then closes it again (finish).
        self.pool.closed(self)


class SessionPool:
    """Accept up to ``max_concurrent_sessions`` sessions and merge what they receive into one stream."""

    def __init__(
        self,
        *,
        settings: ServiceBusStreamSettings,
        counters: ServiceBusCounters,
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
        except NO_SESSION:
            # No session has a message, or all of them are held (by us or other consumers).
            self.counters.add("api_calls")
            self._scarce = True
            self._accept_errors = 0
            await asyncio.sleep(self.accept_pause)
            return None
        except errors.ServiceBusError as exc:
            self.counters.add("api_calls")
            self._accept_errors += 1
            if self._accept_errors >= MAX_ACCEPT_ERRORS:
                if isinstance(exc, errors.ServiceBusConnectionError):
                    raise BrokerUnavailableError(
                        f"Service Bus entity {self.entity_path!r}: {MAX_ACCEPT_ERRORS} session accepts in a row "
                        f"could not reach the broker ({type(exc).__name__}: {exc}); the stream resumes when the "
                        "trigger is re-created and Service Bus answers again"
                    ) from exc
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
        self.log.info("%s: accepted session %s", self.entity_path, log_safe(session.session_id))
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
