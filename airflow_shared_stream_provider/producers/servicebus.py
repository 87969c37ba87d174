"""
Azure Service Bus producer for shared streams: one client per stream, and one peek-lock receiver
(or, for a session-enabled entity, one receiver per accepted session).

``open_stream`` reads the Airflow connection, opens one ``ServiceBusClient`` (azure-servicebus
aio) and one PEEK_LOCK receiver on the queue or topic subscription, and receives in batches
(``receive_messages(max_message_count=...)`` with ``prefetch_count``), never more than the
watchers' flow credit. Every message is settled on the receiver that received it, after the
manager resolved it, according to the shared dispositions:

==================  ===============================================================================
outcome             what happens on Service Bus
==================  ===============================================================================
acked (COMMIT)      ``complete_message``: the message is gone. Only after every watcher's events
                    were confirmed persisted in the metadata DB.
rejected            ``dead_letter_message`` with ``reason="RejectedByWatcher"`` and the watchers'
(DEAD_LETTER)       reasons as ``error_description``: the original message (body, properties)
                    moves to the entity's ``$DeadLetterQueue``. A reject wins over failures.
                    Oversize messages (``oversize_policy="dead_letter"``) go the same way.
failed (REDELIVER)  ``abandon_message``: the lock is released, the broker redelivers it at once
                    with ``delivery_count + 1``.
poison              a failed message whose ``delivery_count + 1`` reached ``max_delivery_attempts``
                    is dead-lettered instead, ``reason="MaxDeliveryAttemptsExceeded"``. The
                    entity's own ``MaxDeliveryCount`` still applies on top (broker-side
                    dead-lettering with ``MaxDeliveryCountExceeded``).
zero-subscriber     ``abandon_message`` (no watcher saw it; Service Bus has no "release without
(HOLD)              counting" for a received message, so this also counts a delivery).
lock lost           (``MessageLockLostError`` on settle or renew: the lock expired, e.g. a watcher
                    held it past the ack timeout) counted in ``leases_lost`` and logged with the
                    message id; the broker has already made the message available again, so it
                    is redelivered (``delivery_count + 1``): at-least-once, never lost. The group
                    keeps running.
advance raises      (any other settle error after the SDK's retries) the manager terminates the
                    group; the unsettled messages come back when their locks expire.
stream closes       buffered messages are released by the SDK (no delivery counted); messages in
                    flight are abandoned (bounded by ``close_timeout``), the rest expire.
crash / restart     nothing unsettled is lost: every lock expires and the broker redelivers with
                    ``delivery_count + 1`` (watchers must be idempotent: dedup on ``message_id``).
==================  ===============================================================================

Lock renewal: the shared :class:`~airflow_shared_stream_provider._core.lease.LeaseKeeper` renews
the lock of every message still in flight shortly before it expires
(``receiver.renew_message_lock``, one ``$management`` call per lock, sequential: concurrent
renewals trip an SDK delivery-id bug), and stops after the triggerer's ack timeout, when the
manager has failed the message anyway. ``AutoLockRenewer`` is not used: it renews until an absolute
``max_lock_renewal_duration`` per message with one task per message and reports failures only
through a callback, while the keeper batches its wake-ups, stops at the ack timeout and reports
lost locks to the producer.

Lanes: a message's ``session_id`` when it has one (messages of a session are settled in order),
else its sequence number (each message its own lane: a slow message never holds back another).

Sessions (``sessions=True``, required for a session-enabled entity, refused on another one with a
:class:`SharedStreamConfigError` that says which way round): up to ``max_concurrent_sessions``
receivers, each on the next available session (``NEXT_AVAILABLE_SESSION``), all under the one
client; see :mod:`~airflow_shared_stream_provider.producers.servicebus_sessions`. What changes:

* order: a session's messages are broadcast in sequence order, and a message is completed only
  after every earlier message of its session (received under the same session lock) was completed
  or dead-lettered. A failed or zero-subscriber message *holds* its session: it is abandoned, the
  session receiver is closed (releasing the later messages without counting a delivery), and the
  broker serves the session again from that message; later messages that watchers already saw
  are broadcast again (at least once). Rejected / poison messages are dead-lettered and do not
  hold the session.
* locks: the session lock covers its messages; it is renewed (``session.renew_lock()``) while the
  session is held, instead of per-message renewals (the SDK refuses those on sessions).
* lock lost (``SessionLockLostError``, or the connection of that receiver failing): counted in
  ``sessions_lost`` and ``leases_lost`` (its unsettled messages), logged; those messages are not
  settled (reported redelivered): the broker redelivers them with ``delivery_count + 1``. The
  group keeps running and accepts sessions again.
* release: a session with nothing unsettled and no new message for ``session_idle_timeout`` is
  released (its receiver closed) so that other sessions get a turn. When no session is available
  the accept times out (``OperationTimeoutError``) and one slot at a time asks again after a
  pause; other accept errors back off, and fail the group after a few in a row.
* close: resolved outcomes are settled, then every session receiver is closed (which releases
  the unsettled messages without counting a delivery, so they are not abandoned one by one).

Prefetch within the byte budget: ``prefetch_count`` is an upper limit. The SDK buffers that many
messages per receiver outside the watchers' credit and fixes the number when the receiver is
created, so the producer sizes it once, for the worst case, when its first receiver attaches: at
most as many messages of the entity's maximum size (announced by the broker on the link) as fit
half of ``max_in_flight_bytes``, shared by the receivers held at once (:meth:`_fit_prefetch`).
When that lowers it, the just-attached receiver (no link credit granted yet, so nothing received,
locked or buffered) is closed and created again with the lower prefetch; a receiver that has
received is never re-created.

Prefetched messages whose lock already expired in the SDK's buffer (watchers were slow to give
credit) are skipped, never broadcast (``stale_skipped``): the broker redelivers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable, Sequence
from datetime import datetime, timezone
from typing import Any, Final

from airflow_shared_stream_provider._core.connections import config_error
from airflow_shared_stream_provider._core.dispositions import Disposition
from airflow_shared_stream_provider._core.envelope import StreamMessage
from airflow_shared_stream_provider._core.errors import (
    BrokerHandleClosedError,
    BrokerUnavailableError,
    SharedStreamConfigError,
    broker_sdk,
)
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.logsafe import log_safe
from airflow_shared_stream_provider._core.producer import HELD_OVERHEAD, UNSENT, Decided, SharedStreamProducerBase
from airflow_shared_stream_provider._core.tasks import best_effort, close_quietly, first_of
from airflow_shared_stream_provider.producers.servicebus_connection import (
    ServiceBusConnectionInfo,
    connection_info,
    load_connection_info,
)
from airflow_shared_stream_provider.producers.servicebus_owner import OwnerQueue
from airflow_shared_stream_provider.producers.servicebus_sessions import CreditPool, SessionPool, SessionReceiver
from airflow_shared_stream_provider.producers.servicebus_types import (
    LOCK_LOST,
    NEXT_AVAILABLE_SESSION,
    NO_SESSION,
    ServiceBusClient,
    ServiceBusCounters,
    ServiceBusDelivery,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
    ServiceBusReceiver,
    announced_max_message_size,
    budget_prefetch,
    envelope_fields,
    errors,
    lock_seconds_left,
    message_body,
    receive_batch,
    renew_margin,
)
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusStreamSettings

# Connection reading and the message -> envelope mapping live one floor down; they stay importable
# from here, where they were first defined.
__all__ = [
    "POISON_REASON",
    "REJECTED_REASON",
    "ServiceBusConnectionInfo",
    "ServiceBusDelivery",
    "ServiceBusSharedStreamProducer",
    "connection_info",
    "envelope_fields",
    "load_connection_info",
    "message_body",
]

REJECTED_REASON: Final = "RejectedByWatcher"
POISON_REASON: Final = "MaxDeliveryAttemptsExceeded"
MAX_DESCRIPTION_CHARS: Final = 1024
CLOSE_TIMEOUT: Final = 5.0
"""Seconds ``aclose`` spends abandoning messages still in flight; the rest wait for lock expiry."""

SETTLE_CONCURRENCY: Final = 1
"""Settlements awaited at once. Measured on the test broker: 16 concurrent completes (each waiting
for its echo) contend for the socket and are slower than one at a time, so the default is 1."""
BUSY_WAIT: Final = 0.05
"""Receive wait (seconds) while messages are in flight, so settlements are not held up."""


class ServiceBusSharedStreamProducer(SharedStreamProducerBase[ServiceBusStreamSettings, ServiceBusDelivery]):
    """The broker side of :class:`~airflow_shared_stream_provider.triggers.servicebus.ServiceBusSharedStreamTrigger`."""

    max_message_bytes = 100 * 1024 * 1024  # Premium; Standard takes 256 KiB

    def __init__(self, settings: ServiceBusStreamSettings, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        self.counters: ServiceBusCounters = ServiceBusCounters(self.broker, self.source_label())
        self.entity_path = settings.entity_path
        self.connection: ServiceBusConnectionInfo | None = None
        self._client: ServiceBusClient | None = None
        self._credential: Any = None
        self._receiver: ServiceBusReceiver | None = None
        self._sessions: SessionPool | None = None
        # Received (without sessions) and not settled, by lock token, with their lock renewals.
        self._unsettled: InFlight[str, ServiceBusReceivedMessage] = InFlight(self.counters)
        # Settlements and renewals for the receive loop, the one task that uses the receiver.
        self._requests = OwnerQueue(
            settle_one=self._settle_one, renew_now=self._renew_now, concurrency=SETTLE_CONCURRENCY
        )
        self._closing = False
        # The prefetch each receiver is created with: ``prefetch_count``, lowered once the entity's
        # maximum message size is known so that the SDK buffers stay within the byte budget
        # (:meth:`_fit_prefetch`).
        self.prefetch: int = settings.prefetch_count
        self._prefetch_fitted = False
        self.close_timeout = CLOSE_TIMEOUT
        self.busy_wait = BUSY_WAIT
        # Without sessions: the base's receive loop, up to max_message_count messages a receive, on
        # the receiver it owns (opened after the cohort); whether the last receive came back empty.
        self.max_receive = settings.max_message_count
        self._owned: ServiceBusReceiver | None = None
        self._idle = False

    def source_label(self) -> str:
        return self.settings.entity_path

    # -- connection ----------------------------------------------------------------------------
    def _make_client(self, info: ServiceBusConnectionInfo) -> ServiceBusClient:
        if info.connection_string is not None:
            try:
                return ServiceBusClient.from_connection_string(info.connection_string)
            except ValueError as exc:
                # The SDK's message may quote the string; never echo it.
                raise SharedStreamConfigError(
                    f"Service Bus connection {info.conn_id!r}: malformed connection string ({type(exc).__name__})"
                ) from None
        with broker_sdk("servicebus"):
            from azure.identity.aio import DefaultAzureCredential
        kwargs: dict[str, str] = {}
        if info.managed_identity_client_id:
            kwargs["managed_identity_client_id"] = info.managed_identity_client_id
        if info.workload_identity_tenant_id:
            kwargs["workload_identity_tenant_id"] = info.workload_identity_tenant_id
        self._credential = DefaultAzureCredential(**kwargs)
        assert info.fully_qualified_namespace is not None
        return ServiceBusClient(info.fully_qualified_namespace, self._credential)

    def _make_receiver(self, client: ServiceBusClient, **options: Any) -> ServiceBusReceiver:
        settings = self.settings
        common: dict[str, Any] = {
            "receive_mode": ServiceBusReceiveMode.PEEK_LOCK,
            "prefetch_count": self.prefetch,
            "max_wait_time": settings.max_wait_time,
            **options,
        }
        if settings.queue_name is not None:
            return client.get_queue_receiver(settings.queue_name, **common)
        assert settings.topic_name is not None and settings.subscription_name is not None
        return client.get_subscription_receiver(settings.topic_name, settings.subscription_name, **common)

    def _make_session_receiver(self, client: ServiceBusClient) -> ServiceBusReceiver:
        """A receiver for the next available session; its ``max_wait_time`` is how long the broker
        waits for a session to have a message and be free (then: ``OperationTimeoutError``)."""
        return self._make_receiver(client, session_id=NEXT_AVAILABLE_SESSION)

    async def _connect(self) -> str:
        """Read the connection and create the group's one client; returns where, for errors."""
        info = self.connection = await load_connection_info(self.settings.azure_service_bus_conn_id)
        where = f"Service Bus entity {self.entity_path!r} on {info.describe()}"
        self.log.info("Opening shared stream on %s", where)
        self._client = self._make_client(info)
        return where

    def _open_error(self, exc: errors.ServiceBusError, where: str) -> Exception | None:
        """What a failure to open a receiver means: a setting, an unreachable broker, or None (raise as is)."""
        error = self._config_error(exc, where)
        if error is None and isinstance(exc, errors.ServiceBusConnectionError):
            # The SDK has retried already (retry_total); nothing was received, so nothing is lost.
            return BrokerUnavailableError(
                f"{where}: the broker could not be reached ({type(exc).__name__}: {exc}); the stream resumes "
                "when the trigger is re-created and Service Bus answers again"
            )
        return error

    def _config_error(self, exc: errors.ServiceBusError, where: str) -> SharedStreamConfigError | None:
        """The configuration error ``exc`` means, if any (else it is the broker's trouble)."""
        if isinstance(
            exc,
            errors.MessagingEntityNotFoundError
            | errors.ServiceBusAuthenticationError
            | errors.ServiceBusAuthorizationError,
        ):
            return config_error(where, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, (*NO_SESSION, errors.SessionLockLostError)):
            return None  # session availability, not configuration
        if "session" not in str(exc).lower():
            return None
        if self.settings.sessions:
            return SharedStreamConfigError(
                f"{where} is not session-enabled (requiresSession is false): drop sessions=True to read it: {exc}"
            )
        return SharedStreamConfigError(
            f"{where} requires sessions (requiresSession is true): pass sessions=True to read it: {exc}"
        )

    async def _open(self) -> ServiceBusReceiver:
        where = await self._connect()
        receiver = await self._open_receiver(where)
        if self._fit_prefetch(receiver):
            # Re-created with the lower prefetch before its first receive call: the SDK issues link
            # credit only on that call (its link attaches with credit 0), so this receiver holds
            # no message, locked or buffered, and closing it settles and releases nothing.
            self._receiver = None
            await close_quietly(receiver, log=self.log, where=self.entity_path)
            receiver = await self._open_receiver(where)
        return receiver

    async def _open_receiver(self, where: str) -> ServiceBusReceiver:
        assert self._client is not None
        receiver = self._receiver = self._make_receiver(self._client)
        try:
            await receiver.__aenter__()
        except errors.ServiceBusError as exc:
            error = self._open_error(exc, where)
            if error is not None:
                raise error from exc
            raise
        self.counters.add("api_calls")
        return receiver

    def _fit_prefetch(self, receiver: ServiceBusReceiver) -> bool:
        """
        Keep the SDK's prefetch within the byte budget; True when ``receiver`` (just attached, not
        received from) must be re-created with the lower :attr:`prefetch`.

        Rule (once per producer, on the first receiver's attach): each of the receivers held at
        once (one, or ``max_concurrent_sessions``) prefetches at most as many maximum-size messages
        as fit half of ``max_in_flight_bytes`` (the share the flow gate reserves for SDK buffers),
        and at most ``prefetch_count``. The maximum is the entity's, as the broker announces it on
        the link's attach, or :attr:`max_message_bytes` (Premium's 100 MB) when it announces none.
        A message can never be larger than that maximum, so the buffers never hold more than their
        share, whatever the message sizes, and a receiver never has to be re-created after it
        received (re-creating would strand the locks of what it holds); the price is a smaller
        prefetch for small messages on an entity with a large maximum.
        """
        if self._prefetch_fitted:
            return False
        self._prefetch_fitted = True
        settings = self.settings
        announced = announced_max_message_size(receiver)
        largest = announced if announced is not None else self.max_message_bytes
        # What the gate counts for one such message (producer.hold: body, envelope copy, overhead).
        held = largest + min(largest, self.max_envelope_bytes) + HELD_OVERHEAD
        receivers = settings.max_concurrent_sessions if settings.sessions else 1
        fitted = budget_prefetch(
            ceiling=settings.prefetch_count,
            budget_bytes=settings.max_in_flight_bytes,
            receivers=receivers,
            message_bytes=held,
        )
        if fitted >= self.prefetch:
            return False
        self.log.info(
            "%s: prefetch_count lowered from %d to %d per receiver: %d receiver(s) x %d prefetched message(s) "
            "of up to %d bytes (%s; %d bytes held each) must fit half of max_in_flight_bytes=%d",
            self.entity_path,
            self.prefetch,
            fitted,
            receivers,
            fitted,
            largest,
            "the entity's maximum message size" if announced is not None else "no maximum announced: Premium's",
            held,
            settings.max_in_flight_bytes,
        )
        self.prefetch = fitted
        gate = self.gate
        gate.buffered_messages = self.sdk_buffered_messages()
        # The first receive is sized at the maximum too (as the gate does for brokers that do not
        # prefetch): with the buffer bounded, what that receive asks for is what it brings.
        gate.expect_size(held)
        return True

    # -- stream: without sessions, the base's receive loop drives these hooks ---------------------
    def _messages(self) -> AsyncIterator[tuple[Any, Any]]:
        if self.settings.sessions:
            return self._session_messages()
        return super()._messages()

    async def _connect_broker(self) -> None:
        """Nothing before the cohort: the connection is read and the receiver opened after it
        (:meth:`_after_cohort`), as with sessions."""

    async def _after_cohort(self) -> None:
        self._owned = await self._open()

    async def _before_receive(self) -> None:
        """
        The receiver's owner at work (see :mod:`.servicebus_owner`): settlements and renewals
        first, they are what keeps locks valid and credit flowing; without credit, wait for it or
        for such a request, whichever comes first.
        """
        receiver = self._owned
        assert receiver is not None
        while True:
            if self._requests:
                await self._requests.run(receiver)
                continue
            if not self._worth_receiving(self.credit(), 0, self.receive_floor()):
                await self._wait_for_credit_or_requests()
                continue
            return

    async def _receive(self, count: int) -> list[ServiceBusReceivedMessage]:
        settings = self.settings
        receiver = self._owned
        assert receiver is not None
        # Wait long only when truly idle. While messages are in flight a settlement may be
        # requested at any moment and it waits for this call to return; and right after a
        # non-empty batch the SDK may hold fewer buffered messages than asked for, in which
        # case it serves them only after the whole wait. A short wait costs no AMQP operation
        # with prefetch (an empty receive sends no frame).
        busy = bool(self._unsettled) or not self._idle
        batch = await receive_batch(
            receiver,
            count=count,
            wait=min(self.busy_wait, settings.max_wait_time) if busy else settings.max_wait_time,
            busy=busy,
            settings=settings,
            counters=self.counters,
        )
        self._idle = not batch
        return batch

    async def _admit(self, received: list[Any]) -> list[Any]:
        """
        Skip the prefetched messages whose lock expired in the SDK's buffer (counted as received,
        never broadcast: the broker already made them available again); the others as
        ``(message, seconds its lock has left, when it expires on the keeper's clock)``.
        """
        if not received:
            return received
        now = datetime.now(timezone.utc)
        loop_now = self._keeper_now()  # the keeper's clock at the same moment
        admitted = []
        for raw in received:
            left = lock_seconds_left(raw, now)
            if left > 0:
                admitted.append((raw, left, loop_now + left))
        stale = len(received) - len(admitted)
        if stale:
            self.counters.add("stale_skipped", stale)
            self.log.warning(
                "%s: skipped %d prefetched message(s) whose lock expired in the buffer (they are "
                "redelivered); lower prefetch_count if this repeats",
                self.entity_path,
                stale,
            )
        return admitted

    def _to_delivery(
        self, item: tuple[ServiceBusReceivedMessage, float, float], received: list[Any]
    ) -> tuple[ServiceBusDelivery, dict[str, Any], str | None, object]:
        raw, left, expires_at = item
        lock_token = str(raw.lock_token)
        if self.settings.renew_locks:
            self._keep_locks(left)
        self._unsettled.add(lock_token, raw, lease_expires_at=expires_at)
        fields = envelope_fields(raw, entity_path=self.entity_path)
        envelope, forced = self.envelope(**fields)
        # The session is the lane; a group-id a sender's encoder wrote as another AMQP type than a
        # string (a list is not even hashable) is no session: the message is its own lane.
        session = raw.session_id
        lane: Hashable = session if isinstance(session, str | bytes) and session else raw.sequence_number
        delivery = ServiceBusDelivery(UNSENT, fields["delivery_attempt"], raw, lock_token, lane)
        return delivery, envelope, forced, fields["body"]

    async def _session_messages(self) -> AsyncIterator[tuple[Any, Any]]:
        """
        ``sessions=True``: the receives are the session receivers' own, each in its slot's task
        (:mod:`.servicebus_sessions`), and each keeps the loop's receive rules there: it reserves
        its credit (a :class:`CreditPool` share of the gate's) before its receive call and counts
        what it received. This loop only broadcasts what they received, with the credit already
        reserved for it, so it must not wait for credit itself.
        """
        await self.cohort_ready()
        pool = await self._open_sessions()
        while True:
            session, raw = await pool.next_message()
            # No await from here to the yield: the credit next_message handed over is used now.
            yield self._session_item(session, raw)

    def sdk_buffered_messages(self) -> int:
        """The SDK's prefetch (:attr:`prefetch`), per receiver: one, or one per session held at once."""
        settings = self.settings
        receivers = settings.max_concurrent_sessions if settings.sessions else 1
        return self.prefetch * receivers

    def lane_of(self, broker_payload: Any) -> Hashable:
        return broker_payload.lane  # type: ignore[no-any-return]

    def batch_lane_of(self, broker_payload: Any) -> Hashable:
        """Batch mode: one batch lane per session; messages without a session share one."""
        session_id = broker_payload.raw.session_id
        return ("session", session_id) if session_id else None

    # -- sessions ------------------------------------------------------------------------------
    async def _open_sessions(self) -> SessionPool:
        """``sessions=True``: the client, and the slots that accept sessions (see servicebus_sessions)."""
        where = await self._connect()
        pool = self._sessions = SessionPool(
            settings=self.settings,
            counters=self.counters,
            log=self.log,
            entity_path=self.entity_path,
            open_session=lambda: self._accept_session(where),
            settle=self._settle,
            credit=CreditPool(self.credit, self.wait_for_credit),
            busy_wait=self.busy_wait,
            close_timeout=self.close_timeout,
        )
        pool.start()
        return pool

    def _session_item(
        self, session: SessionReceiver, raw: ServiceBusReceivedMessage
    ) -> tuple[StreamMessage, ServiceBusDelivery]:
        """The broadcast item of a message received on a session: its lane is the session."""
        fields = envelope_fields(raw, entity_path=self.entity_path)
        envelope, forced = self.envelope(**fields)
        msg = self.stream_message(envelope, forced, fields["body"])
        lock_token = str(raw.lock_token)
        return msg, ServiceBusDelivery(msg, fields["delivery_attempt"], raw, lock_token, session.session_id, session)

    async def _accept_session(self, where: str) -> ServiceBusReceiver:
        """Open a receiver on the next available session; closed again if that fails."""
        receiver = await self._accept_one_session(where)
        if self._fit_prefetch(receiver):
            # As in _open: nothing was received on it yet; closing it releases the session, and the
            # next accept (maybe of another session) gets the lower prefetch. Later session
            # receivers are created with it from the start.
            await close_quietly(receiver, log=self.log, where=self.entity_path)
            receiver = await self._accept_one_session(where)
        return receiver

    async def _accept_one_session(self, where: str) -> ServiceBusReceiver:
        assert self._client is not None
        receiver = self._make_session_receiver(self._client)
        try:
            await receiver.__aenter__()
        except BaseException as exc:
            await best_effort(
                receiver.close(),
                self.log,
                "%s: error closing a receiver that could not accept a session",
                self.entity_path,
                timeout=self.close_timeout,
            )
            # Not _open_error: the session pool retries a connection error (servicebus_sessions).
            error = self._config_error(exc, where) if isinstance(exc, errors.ServiceBusError) else None
            if error is not None:
                raise error from exc
            raise
        return receiver

    async def _wait_for_credit_or_requests(self) -> None:
        """Block until watchers give credit back, or a settlement / renewal is requested."""
        await first_of((self.wait_for_credit(self.receive_floor()), self._requests.ready.wait()), None)

    # -- lock renewal --------------------------------------------------------------------------
    @staticmethod
    def _keeper_now() -> float:
        return asyncio.get_running_loop().time()

    def _keep_locks(self, lock_seconds: float) -> None:
        """Start the keeper on the first message (its lock tells the entity's lock duration)."""
        keeper = self._unsettled.keeper
        if keeper is None:
            lease = max(lock_seconds, 1.0)
            self._unsettled.keep_leases(
                LeaseKeeper(
                    renew=self._renew,
                    lease_seconds=lease,
                    renew_margin=renew_margin(lease),
                    max_hold=self.ack_timeout + min(30.0, lease),
                    batch_size=100,
                    now=self._keeper_now,
                    name=f"servicebus-lock-renewer[{self.entity_path}]",
                )
            )
        elif lock_seconds > keeper.lease_seconds:
            # A buffered first message under-estimated the lock duration; a fresh one corrects it.
            keeper.lease_seconds = lock_seconds
            keeper.renew_margin = renew_margin(lock_seconds)

    async def _renew(self, lock_tokens: Sequence[str], _lease_seconds: float) -> list[str]:
        """The keeper's renew callback: hand the batch to the receiver's owner and wait."""
        if self._receiver is None:
            return list(lock_tokens)
        return await self._requests.renew(lock_tokens)

    async def _renew_now(self, receiver: ServiceBusReceiver, lock_tokens: Sequence[str]) -> list[str]:
        """A lease on Service Bus is the message lock: renew each (one $management call per lock)."""
        lost: list[str] = []
        renewed = 0
        for token in lock_tokens:
            message = self._unsettled.get(token)
            if message is None:
                continue
            self.counters.add("api_calls")
            try:
                await receiver.renew_message_lock(message)
                renewed += 1
            except LOCK_LOST:
                lost.append(token)
                self.log.warning(
                    "%s: lock of message %s lost before renewal; the broker redelivers it",
                    self.entity_path,
                    log_safe(message.message_id),
                )
            except errors.MessageAlreadySettled:
                continue
        self._unsettled.count_renewals(renewed, lost)
        return lost

    # -- advance -------------------------------------------------------------------------------
    async def _apply(
        self, decided: Sequence[Decided[ServiceBusDelivery]]
    ) -> Sequence[Decided[ServiceBusDelivery]] | None:
        """
        Queue the batch's settlements for the receiver's owner, the receive loop (see
        :mod:`.servicebus_owner`), or with sessions, for the session receiver each message came
        from (:meth:`_apply_to_sessions`). The owner settles them before its next receive; an
        error other than a lost lock ends the stream and so the group, like an ``advance`` that
        raises.
        """
        if self._sessions is not None and not self._closing:
            return self._apply_to_sessions(decided)
        if self._receiver is None or self._closing:
            raise BrokerHandleClosedError(f"{self.entity_path}: receiver closed; {len(decided)} message(s) not settled")
        self._requests.settle(decided)
        return None

    @staticmethod
    def _apply_to_sessions(decided: Sequence[Decided[ServiceBusDelivery]]) -> list[Decided[ServiceBusDelivery]]:
        """
        Hand each outcome to the session receiver that received the message, in lane order.

        A session that was given up (idle, held by an earlier failure, lock lost) settles nothing
        any more: those messages are reported as redelivered, which is what the broker does.
        """
        applied = []
        for entry in decided:
            session = entry.delivery.session
            assert session is not None, "a session stream delivery without its session receiver"
            applied.append(session.take(entry))
        return applied

    async def _settle_one(self, receiver: ServiceBusReceiver, entry: Decided[ServiceBusDelivery]) -> None:
        delivery = entry.delivery
        if delivery.lock_token not in self._unsettled:
            return  # settled already (a batch retried after a cancellation)
        try:
            await self._settle(receiver, entry)
        except LOCK_LOST as exc:
            if not self._unsettled.lost_at_renewal(delivery.lock_token):
                self.counters.add("leases_lost")
            self.log.warning(
                "%s: lock of message %s (sequence %s) lost before %s (%s); the broker redelivers it "
                "with delivery_count + 1",
                self.entity_path,
                log_safe(delivery.message.envelope["message_id"]),
                delivery.raw.sequence_number,
                entry.disposition.value,
                type(exc).__name__,
            )
        except errors.MessageAlreadySettled:
            self.log.warning(
                "%s: message %s was already settled",
                self.entity_path,
                log_safe(delivery.message.envelope["message_id"]),
            )
        # Anything else (cancellation included) leaves the message unsettled for aclose.
        self._unsettled.settled(delivery.lock_token)

    async def _settle(self, receiver: ServiceBusReceiver, entry: Decided[ServiceBusDelivery]) -> None:
        message = entry.delivery.raw
        disposition = entry.disposition
        self.counters.add("api_calls")
        if disposition is Disposition.COMMIT:
            await receiver.complete_message(message)
        elif disposition is Disposition.DEAD_LETTER:
            reason = POISON_REASON if entry.decision.reason.startswith("poison") else REJECTED_REASON
            # The broker writes these as the DeadLetterReason / DeadLetterErrorDescription
            # properties, replacing a sender's own (the decision's reason is never empty).
            await receiver.dead_letter_message(
                message, reason=reason, error_description=entry.decision.reason[:MAX_DESCRIPTION_CHARS]
            )
        else:  # REDELIVER and HOLD
            await receiver.abandon_message(message)

    # -- close ---------------------------------------------------------------------------------
    async def _close(self) -> None:
        # Shielded: the manager's stop can cancel the poll task while it awaits aclose (a cancelled
        # caller of ``group.stop()`` propagates into it); an interrupted close would strand settled
        # outcomes and leave buffered messages locked until expiry instead of released.
        task = asyncio.ensure_future(self._close_now())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait({task}, timeout=self.close_timeout + 5.0)
            raise

    async def _close_now(self) -> None:
        self._closing = True
        await self._unsettled.stop()
        pool, self._sessions = self._sessions, None
        if pool is not None:
            await best_effort(
                pool.close(), self.log, "%s: error closing the session receivers", self.entity_path, timeout=None
            )
        receiver, self._receiver = self._receiver, None
        client, self._client = self._client, None
        credential, self._credential = self._credential, None
        try:
            if receiver is not None:
                await best_effort(
                    self._finish(receiver),
                    self.log,
                    "%s: could not settle / abandon every in-flight message on close; the rest return at lock expiry",
                    self.entity_path,
                    timeout=self.close_timeout,
                )
        finally:
            self._requests.cancel()
            self._unsettled.drain()
            await close_quietly(receiver, client, credential, log=self.log, where=self.entity_path)

    async def _finish(self, receiver: ServiceBusReceiver) -> None:
        """Settle what the manager already resolved, then abandon what it did not (prompt redelivery)."""
        await self._requests.run(receiver)
        for message in self._unsettled.items():
            self.counters.add("api_calls")
            try:
                await receiver.abandon_message(message)
            except (*LOCK_LOST, errors.MessageAlreadySettled):
                continue
