"""
Google Pub/Sub shared-stream producer: one asyncio GAPIC subscriber for every watcher of a stream.

Features: unary ``Pull`` in batches (``max_messages``, short ``pull_timeout``) on
``google.pubsub_v1.SubscriberAsyncClient`` built inside the triggerer's event loop and closed in
``aclose``; acks and nacks gathered across advance calls into batched ``Acknowledge`` /
``ModifyAckDeadline`` calls; lease keeping (batched ``ModifyAckDeadline``) for messages still being
worked on, up to the triggerer's ack timeout; exactly-once-delivery subscriptions; ordering keys as
advance lanes.

Connection (``gcp_conn_id``, the upstream ``google_cloud_platform`` shape), credentials, the emulator
and the subscription's own settings: :mod:`.pubsub_client`.

Dispositions (see :mod:`airflow_shared_stream_provider._core.dispositions`):

==================  ===============================================================================
outcome             what happens on Pub/Sub
==================  ===============================================================================
COMMIT (acked)      ``Acknowledge`` (batched, flushed every ``ack_flush_interval``)
DEAD_LETTER         with ``dead_letter_topic``: ``Publish`` the original data and attributes (a
(rejected, poison,  sender's own ``x-dead-letter-*`` renamed ``x-original-*``) plus the producer's
oversize)           ``x-dead-letter-*`` attributes (awaited), then ``Acknowledge``; without it:
                    ``ModifyAckDeadline(0)`` so the subscription's own dead-letter policy moves it
                    (without such a policy the message is redelivered until it expires)
REDELIVER (failed)  ``ModifyAckDeadline(0)``: prompt redelivery; ``delivery_attempt`` grows
HOLD (no watcher)   ``ModifyAckDeadline(0)``: prompt redelivery, not counted as an attempt by us
==================  ===============================================================================

Lanes: a message's ordering key, else the message alone (nothing orders unkeyed messages on
Pub/Sub, so one slow message never delays the acks of others). When a keyed message is nacked,
later messages of that key delivered before the nack are nacked too (Pub/Sub redelivers the key
from the nacked message), so a key's events never skip ahead of a redelivered message. That
barrier is forgotten once its key has nothing in flight from the pulls it covers, so the memory it
takes is bounded by the messages in flight, not by how many keys senders use.

Exactly-once delivery: on such subscriptions ``Acknowledge`` can fail per ack id. Transient
failures are retried; ``PERMANENT_FAILURE_INVALID_ACK_ID`` (the lease expired) is counted in
``leases_lost`` and logged: Pub/Sub redelivers the message, so its events may fire twice (never
zero times). A call that keeps failing for every id is surfaced: the pull loop raises it and the
group terminates (every watcher sees the error, unacked messages are redelivered).

Closing (a stop, or the group failing): the messages the producer holds unfinished and those of a
pull still travelling (waited for up to ``pull_timeout`` + 0.5 s) are handed back with
``ModifyAckDeadline(0)``, also after the acks failed for good, so they are redelivered at once
rather than when their ack deadline lapses. Only a pull that does not answer in time is cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider._core.attempts import MessageCounts
from airflow_shared_stream_provider._core.dead_letter import (
    add_within_limit,
    cut_utf8,
    dead_letter_fields,
    disown_dead_letter_names,
)
from airflow_shared_stream_provider._core.dispositions import Disposition
from airflow_shared_stream_provider._core.errors import BrokerHandleClosedError
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.logsafe import REASON_LOG_LIMIT, log_safe
from airflow_shared_stream_provider._core.producer import UNSENT, Decided, Delivery, Received, SharedStreamProducerBase
from airflow_shared_stream_provider._core.retry import Backoff, Retry, retry_call, retry_entries
from airflow_shared_stream_provider._core.tasks import best_effort, cancel_and_wait, close_quietly
from airflow_shared_stream_provider.producers.pubsub_ack_buffer import AckBuffer
from airflow_shared_stream_provider.producers.pubsub_client import (
    DEFAULT_SUBSCRIPTION_DEADLINE,
    TRANSIENT,
    PublisherAsyncClient,
    Pulled,
    SubscriberAsyncClient,
    ack_failures,
    gexc,
    inspect_subscription,
    load_connection,
    publisher_client,
    pull,
    subscriber_client,
)
from airflow_shared_stream_provider.triggers.pubsub import PubSubStreamSettings

# Connection reading and ack-failure parsing live in pubsub_client; they stay importable from here.
__all__ = ["PubSubDelivery", "PubSubSharedStreamProducer", "ack_failures", "load_connection"]

ACK_BATCH: Final = 1000  # ack ids per Acknowledge / ModifyAckDeadline call (request size < 512 KiB)
PUBLISH_BATCH: Final = 100  # dead-letter messages per Publish call
PUBLISH_BATCH_BYTES: Final = 8 * 1024 * 1024
MAX_ATTRIBUTES: Final = 100
MAX_ATTRIBUTE_VALUE: Final = 1024
MAX_ATTRIBUTE_KEY: Final = 256  # bytes
RPC_RETRIES: Final = 5
_ACK_BACKOFF: Final = Backoff(0.1)
_PUBLISH_BACKOFF: Final = Backoff(0.2)
ATTEMPTS_MEMORY: Final = 100_000
CLOSING_PULL_GRACE: Final = 0.5
"""Seconds past ``pull_timeout`` a closing producer waits for the pull still travelling (its leases)."""


@dataclass(slots=True)
class PubSubDelivery(Delivery):
    """What ``advance`` needs of one Pub/Sub message."""

    ack_id: str
    message_id: str
    ordering_key: str
    pull_index: int
    data: bytes
    attributes: Mapping[str, str]
    published_at: str | None


class PubSubSharedStreamProducer(SharedStreamProducerBase[PubSubStreamSettings, PubSubDelivery]):
    """One subscriber client, one pull loop, for every watcher of a subscription (see module doc)."""

    max_message_bytes = 10 * 1000 * 1000
    # A pull's bodies are in memory three times at its peak: gRPC's receive buffer, the parsed
    # protobuf, and our copy (pubsub_client.unpack). Measured with 10 MB messages (docs/performance.md).
    receive_copies = 3
    receive_ahead = True

    def __init__(self, settings: PubSubStreamSettings, *, stream_key: Hashable) -> None:
        self.subscription_path: str | None = None  # resolved in open_stream (project may come from the connection)
        super().__init__(settings, stream_key=stream_key)
        self._subscriber: SubscriberAsyncClient | None = None
        self._publisher: PublisherAsyncClient | None = None
        self.dead_letter_topic_path: str | None = None
        self.exactly_once = False
        self.has_dead_letter_policy = False
        self.subscription_ack_deadline = DEFAULT_SUBSCRIPTION_DEADLINE
        # COMMIT and REDELIVER / HOLD: acks and nacks gathered across advance calls, sent in batches.
        self._buffer = AckBuffer(
            send_acks=functools.partial(self._send, "ack"),
            send_nacks=functools.partial(self._send, "modify"),
            batch_size=ACK_BATCH,
            interval=settings.ack_flush_interval,
            log=self.log,
        )
        # Ack ids yielded and not yet advanced (nacked on close so Pub/Sub redelivers them at once),
        # with their leases (ack deadlines).
        self._unsettled: InFlight[str, None] = InFlight(self.counters)
        self._pulls_started = 0
        # ordering key -> pulls started when a message of that key was last nacked: messages of
        # the key from pulls up to that one were delivered before the nack and must follow it.
        self._key_barriers: dict[str, int] = {}
        # Both bounded by what is in flight, not by how many keys senders ever used: a barrier is
        # dropped once its key has nothing in flight from the pulls it covers (see _drop_barriers).
        # ordering key -> its messages received and not yet advanced (counted for a whole pull
        # before the first of them is yielded).
        self._key_in_flight: Counter[str] = Counter()
        # Keys with nothing in flight whose barrier covers a pull not received yet.
        self._barriers_waiting: set[str] = set()
        self._pulls_received = 0
        # The base's receive loop: one pull travelling, the next started while one is broadcast
        # (none for a trickle of credit while the watchers have a backlog: receive_floor).
        self.max_receive = settings.max_messages
        self.concurrent_receives = 1
        self._idle_wait = 0.0  # the pause before polling a server that answered empty at once
        # message id -> deliveries seen by this producer, for the poison cap when the subscription
        # has no dead-letter policy (Pub/Sub only counts attempts when it has one).
        self._attempts: MessageCounts[str] = MessageCounts(ATTEMPTS_MEMORY)
        self.pull_calls = 0
        self.ack_calls = 0
        self.modify_calls = 0
        self.publish_calls = 0

    # -- identity ------------------------------------------------------------------------------
    def source_label(self) -> str:
        return self.subscription_path or self.settings.subscription

    def lane_of(self, broker_payload: Any) -> Hashable:
        delivery: PubSubDelivery = broker_payload
        if delivery.ordering_key:
            return ("ordering_key", delivery.ordering_key)
        return delivery.ack_id

    def batch_lane_of(self, broker_payload: Any) -> Hashable:
        """Batch mode: one batch lane per ordering key, one for every unordered message."""
        delivery: PubSubDelivery = broker_payload
        return ("ordering_key", delivery.ordering_key) if delivery.ordering_key else None

    # -- connecting ----------------------------------------------------------------------------
    async def _connect(self) -> SubscriberAsyncClient:
        settings = self.settings
        connection = await load_connection(settings.gcp_conn_id)
        self.subscription_path = settings.subscription_path(connection.project)
        self.dead_letter_topic_path = settings.dead_letter_topic_path(self.subscription_path)
        self.counters.retag(self.subscription_path)  # metrics carry the full path from here on
        self._subscriber = subscriber_client(connection)
        if self.dead_letter_topic_path:
            self._publisher = publisher_client(connection)
        info = await inspect_subscription(
            self._subscriber,
            self.subscription_path,
            dead_letter_topic=self.dead_letter_topic_path,
            counters=self.counters,
            log=self.log,
            where=f"gcp_conn_id={settings.gcp_conn_id!r}; "
            + (f"emulator {connection.emulator_host}" if connection.emulator_host else "pubsub.googleapis.com"),
        )
        self.subscription_ack_deadline = info.ack_deadline_seconds
        self.exactly_once = info.exactly_once
        self.has_dead_letter_policy = info.has_dead_letter_policy
        return self._subscriber

    def _make_lease_keeper(self) -> LeaseKeeper[str]:
        lease = float(self.settings.ack_deadline_seconds)
        first = float(self.subscription_ack_deadline)
        margin = max(1.0, min(lease, first) / 3)
        return LeaseKeeper(
            renew=self._renew_leases,
            lease_seconds=lease,
            renew_margin=margin,
            max_hold=self.ack_timeout + lease,
            batch_size=ACK_BATCH,
            name=f"pubsub-leases[{self.subscription_path}]",
        )

    # -- the pull loop (the base's receive loop: these are its hooks) --------------------------
    async def _connect_broker(self) -> None:
        await self._connect()

    def _receiving(self) -> None:
        self._unsettled.keep_leases(self._make_lease_keeper())
        self._buffer.start(f"pubsub-acks[{self.subscription_path}]", where=self.source_label())

    def _check_stream(self) -> None:
        if self._buffer.fatal is not None:
            raise self._buffer.fatal

    def _receive(self, count: int) -> Awaitable[Received]:
        # Numbered when started, not when the task runs: _apply's key barriers cover every pull
        # started before a nack, including one whose task has not run yet.
        self._pulls_started += 1
        return self._pull(self._pulls_started, count)

    async def _admit(self, received: list[Any]) -> list[Any]:
        if self._buffer.fatal is not None:
            # The acks failed for good while this pull was out (an outage): the stream ends.
            # Hand these back instead of broadcasting them (their acks could not be sent,
            # so the watchers would fire for them now and again on the redelivery): the
            # final flush in _close nacks them with everything else still held.
            self._buffer.nacks.extend(item.ack_id for item in received)
            raise self._buffer.fatal
        assert isinstance(received, Received)
        self._pull_received(received.number, received)
        if received:
            self._idle_wait = 0.0
        return received

    async def _after_empty(self, received: list[Any]) -> None:
        # Real Pub/Sub holds an empty pull open until pull_timeout; a server that answers empty at
        # once (the emulator) is polled with a growing pause, at most 1 s.
        assert isinstance(received, Received)
        timeout = self.settings.pull_timeout
        if time.monotonic() - received.started < timeout / 2:
            self._idle_wait = min(max(self._idle_wait * 2, 0.05), 1.0, timeout)
            await asyncio.sleep(self._idle_wait)

    def _to_delivery(
        self, raw: Pulled, received: list[Any]
    ) -> tuple[PubSubDelivery, dict[str, Any], str | None, object]:
        assert isinstance(received, Received)
        message_id = raw.message_id
        ordering_key = raw.ordering_key
        attempt = self._attempt_of(message_id, raw.delivery_attempt)
        attributes = raw.attributes
        published_at = raw.published_at
        data = raw.data
        envelope, forced = self.envelope(
            source=self.source_label(),
            message_id=message_id,
            body=data,
            attributes=attributes,
            published_at=published_at,
            delivery_attempt=attempt,
            metadata={"ordering_key": ordering_key or None},
        )
        # The server started each lease when it answered; the request start is a lower bound.
        self._unsettled.add(raw.ack_id, None, lease_expires_at=received.started + self.subscription_ack_deadline)
        delivery = PubSubDelivery(
            UNSENT,
            attempt,
            ack_id=raw.ack_id,
            message_id=message_id,
            ordering_key=ordering_key,
            pull_index=received.number,
            data=data,
            attributes=attributes,
            published_at=published_at,
        )
        return delivery, envelope, forced, data

    async def _end_receives(self) -> None:
        """
        Closing: wait briefly for the pull still travelling and hand back what it brings.

        The server leases messages when it answers a pull, so cancelling a pull that was answered
        (the pipelined one, or one in flight when the stream stops) leaves its messages leased to
        nobody until their ack deadline lapses: late, not lost. Waiting up to ``pull_timeout`` +
        :data:`CLOSING_PULL_GRACE` and queueing its ack ids as nacks (sent by the final flush in
        :meth:`_close`) makes them deliverable again at once. A pull that does not answer in time
        is cancelled (an outage: what it may have leased waits out the deadline).
        """
        tasks = list(self._receives)
        self._receives.clear()
        for task in tasks:
            try:
                if not task.done():
                    await asyncio.wait({task}, timeout=self.settings.pull_timeout + CLOSING_PULL_GRACE)
            finally:
                if not task.done():
                    await cancel_and_wait(task)
            if task.cancelled() or task.exception() is not None:
                continue
            self._buffer.nacks.extend(item.ack_id for item in task.result())

    def _pull_received(self, pull_index: int, received: Sequence[Pulled]) -> None:
        """Count a pull's keyed messages as in flight (all of them, before any is yielded)."""
        for item in received:
            key = item.ordering_key
            if key:
                self._key_in_flight[key] += 1
        self._pulls_received = pull_index  # pulls are received one at a time, in order
        if self._barriers_waiting:
            waiting, self._barriers_waiting = self._barriers_waiting, set()
            self._drop_barriers(waiting)

    def _drop_barriers(self, keys: set[str]) -> None:
        """
        Drop the barrier of each of ``keys`` that has nothing left to hold back.

        A barrier covers the messages of its key from pulls up to its index. Once every such pull
        was received and none of the key's messages is in flight, no message it covers can still be
        advanced; any later one comes from a later pull, which the barrier lets through anyway. A
        key whose barrier covers a pull still travelling waits for that pull (``_pull_received``).
        """
        for key in keys:
            barrier = self._key_barriers.get(key)
            if barrier is None or self._key_in_flight.get(key):
                continue
            if barrier <= self._pulls_received:
                del self._key_barriers[key]
            else:
                self._barriers_waiting.add(key)

    async def _pull(self, pull_index: int, max_messages: int) -> Received:
        """One ``Pull``: the messages (empty on timeout), with its index and monotonic start."""
        client = self._subscriber
        if client is None:
            raise BrokerHandleClosedError(f"Pub/Sub producer for {self.source_label()} is closed")
        started, received = await pull(
            client, self.subscription_path, max_messages, timeout=self.settings.pull_timeout, log=self.log
        )
        self.pull_calls += 1
        self.counters.add("api_calls")
        return Received(received, started=started, number=pull_index)

    def _attempt_of(self, message_id: str, server_attempt: int) -> int:
        """Pub/Sub's ``delivery_attempt`` when it counts (dead-letter policy), else ours."""
        if server_attempt > 0:
            return server_attempt
        return self._attempts.increment(message_id)

    # -- advancing -------------------------------------------------------------------------------
    async def _apply(self, decided: Sequence[Decided[PubSubDelivery]]) -> None:
        if self._subscriber is None or self._closed:
            raise BrokerHandleClosedError(f"Pub/Sub producer for {self.source_label()} is closed")
        acks: list[str] = []
        nacks: list[str] = []
        ordered_nacks: list[PubSubDelivery] = []
        dead: list[Decided[PubSubDelivery]] = []
        for entry in decided:
            delivery = entry.delivery
            disposition = entry.disposition
            key = delivery.ordering_key
            if key and disposition is Disposition.COMMIT:
                barrier = self._key_barriers.get(key)
                if barrier is not None:
                    if delivery.pull_index <= barrier:
                        # Delivered before an earlier message of its key was nacked: Pub/Sub will
                        # redeliver the key from that message, so this one must follow it again.
                        disposition = Disposition.REDELIVER
                    else:
                        del self._key_barriers[key]
            if disposition is Disposition.COMMIT:
                acks.append(delivery.ack_id)
                self._attempts.forget(delivery.message_id)
            elif disposition is Disposition.DEAD_LETTER:
                dead.append(entry)
                self._attempts.forget(delivery.message_id)
            else:
                if disposition is Disposition.HOLD:
                    self._attempts.decrement(delivery.message_id)  # a hold is not a delivery attempt
                if key:
                    ordered_nacks.append(delivery)
                    # Later messages of the key in this very batch follow it too.
                    self._key_barriers[key] = max(self._key_barriers.get(key, 0), self._pulls_started)
                else:
                    nacks.append(delivery.ack_id)
        if dead:
            if self.dead_letter_topic_path is not None:
                await self._publish_dead_letters(dead)
                acks.extend(entry.delivery.ack_id for entry in dead)
            else:
                nacks.extend(entry.delivery.ack_id for entry in dead)
                for entry in dead:
                    self.log.warning(
                        "Message %s from %s nacked for the subscription's dead-letter policy: %s",
                        log_safe(entry.delivery.message_id),
                        self.source_label(),
                        log_safe(entry.decision.reason, REASON_LOG_LIMIT),
                    )
        for entry in decided:
            self._unsettled.settled(entry.delivery.ack_id)
        if ordered_nacks:
            # Sent now, not buffered: the barrier must cover every pull that could still hand out
            # later messages of the key before Pub/Sub saw the nack.
            await self._send("modify", [d.ack_id for d in ordered_nacks])
            for delivery in ordered_nacks:
                self._key_barriers[delivery.ordering_key] = self._pulls_started
        if acks or nacks:
            self._buffer.add(acks, nacks)
        idle: set[str] = set()
        for entry in decided:
            key = entry.delivery.ordering_key
            if key:
                left = self._key_in_flight[key] - 1
                if left > 0:
                    self._key_in_flight[key] = left
                else:
                    del self._key_in_flight[key]
                    idle.add(key)
        if idle:
            self._drop_barriers(idle)

    async def _publish_dead_letters(self, dead: Sequence[Decided[PubSubDelivery]]) -> None:
        publisher = self._publisher
        topic = self.dead_letter_topic_path
        assert publisher is not None and topic is not None
        batch: list[dict[str, Any]] = []
        size = 0
        for entry in dead:
            message = self._dead_letter_message(entry)
            message_size = len(message["data"]) + sum(len(k) + len(v) for k, v in message["attributes"].items())
            if batch and (len(batch) >= PUBLISH_BATCH or size + message_size > PUBLISH_BATCH_BYTES):
                await self._publish(publisher, topic, batch)
                batch, size = [], 0
            batch.append(message)
            size += message_size
        if batch:
            await self._publish(publisher, topic, batch)

    def _dead_letter_message(self, entry: Decided[PubSubDelivery]) -> dict[str, Any]:
        """
        The original data and attributes (a sender's ``x-dead-letter-*`` renamed ``x-original-*``),
        plus the non-empty ``x-dead-letter-*`` ones while 100 attributes allow.
        """
        delivery = entry.delivery
        fields = dead_letter_fields(
            reason=cut_utf8(entry.decision.reason, MAX_ATTRIBUTE_VALUE),  # the limit is in bytes
            source=self.source_label(),
            message_id=delivery.message_id,
            delivery_attempt=str(delivery.delivery_attempt),
            published_at=delivery.published_at or "",
            ordering_key=delivery.ordering_key,
        )
        extra = {name: value for name, value in fields.items() if value}
        # The sender's own x-dead-letter-* attributes are renamed x-original-*: on the dead-letter
        # copy those names are only ever the producer's (see _core/dead_letter.py).
        original = disown_dead_letter_names(delivery.attributes, max_name_bytes=MAX_ATTRIBUTE_KEY)
        attributes = add_within_limit(original, extra, limit=MAX_ATTRIBUTES, overwrite=True)
        return {"data": delivery.data, "attributes": attributes}

    async def _publish(self, publisher: PublisherAsyncClient, topic: str, messages: list[dict[str, Any]]) -> None:
        async def publish() -> None:
            try:
                await publisher.publish(request={"topic": topic, "messages": messages}, timeout=30, retry=None)
            except gexc.NotFound:
                raise SharedStreamConfigError(f"dead_letter_topic {topic!r} does not exist") from None
            finally:
                self.publish_calls += 1
                self.counters.add("api_calls")

        await retry_call(
            publish, attempts=RPC_RETRIES, backoff=_PUBLISH_BACKOFF, retriable=lambda exc: isinstance(exc, TRANSIENT)
        )

    # -- acks and nacks ----------------------------------------------------------------------------
    async def flush(self) -> None:
        """Send every buffered ack and nack now."""
        await self._buffer.flush()

    async def _send(self, kind: str, ack_ids: Sequence[str], deadline: int = 0) -> list[str]:
        """
        ``Acknowledge`` (``kind="ack"``) or ``ModifyAckDeadline`` a batch; return the ids that failed for good.

        Transient errors are retried (for exactly-once subscriptions only the ids Pub/Sub reported
        as transient). A permanent per-id failure (exactly-once: the ack id expired) is returned and
        counted, never reported as done. An error for the whole call that outlasts the retries is
        raised.
        """
        client = self._subscriber
        if client is None:
            raise BrokerHandleClosedError(f"Pub/Sub producer for {self.source_label()} is closed")
        lost: list[str] = []
        call_error: BaseException | None = None  # the last attempt's error, when it failed as a whole

        async def send(pending: list[str]) -> Retry[str]:
            nonlocal call_error
            call_error = None
            try:
                if kind == "ack":
                    self.ack_calls += 1
                    await client.acknowledge(
                        request={"subscription": self.subscription_path, "ack_ids": pending}, timeout=30, retry=None
                    )
                else:
                    self.modify_calls += 1
                    await client.modify_ack_deadline(
                        request={
                            "subscription": self.subscription_path,
                            "ack_ids": pending,
                            "ack_deadline_seconds": deadline,
                        },
                        timeout=30,
                        retry=None,
                    )
            except gexc.GoogleAPICallError as exc:
                self.counters.add("api_calls")
                failures = ack_failures(exc)
                if failures is not None:
                    lost.extend(ack_id for ack_id in pending if failures.get(ack_id, "").startswith("PERMANENT"))
                    transient = [a for a in pending if a in failures and not failures[a].startswith("PERMANENT")]
                    return transient, str(exc)
                if isinstance(exc, gexc.InvalidArgument):
                    if len(pending) > 1:
                        # One bad id fails the whole call (the emulator does this): isolate it.
                        for ack_id in pending:
                            lost.extend(await self._send(kind, [ack_id], deadline))
                    else:
                        lost.extend(pending)
                    return [], ""
                if not isinstance(exc, TRANSIENT):
                    raise
                call_error = exc
                return pending, str(exc)
            self.counters.add("api_calls")
            return [], ""

        left, _ = await retry_entries(ack_ids, send, attempts=RPC_RETRIES, backoff=_ACK_BACKOFF)
        if left and call_error is not None:
            raise call_error
        lost.extend(left)  # exactly-once: ids still transiently failing after the retries
        if lost:
            self.counters.add("leases_lost", len(lost))
            if kind == "ack":
                self.log.warning(
                    "%d ack(s) on %s were refused (lease expired); Pub/Sub redelivers those messages",
                    len(lost),
                    self.source_label(),
                )
        return lost

    async def _renew_leases(self, ack_ids: Sequence[str], lease_seconds: float) -> Sequence[str]:
        """A lease on Pub/Sub is the ack deadline: extend it (``_send`` counts the ids it lost)."""
        lost = await self._send("modify", ack_ids, int(lease_seconds))
        self._unsettled.count_renewals(len(ack_ids) - len(lost))
        return lost

    # -- closing ---------------------------------------------------------------------------------
    async def _close(self) -> None:
        await self._end_receives()
        await self._unsettled.stop()
        await self._buffer.stop()
        try:
            if self._subscriber is not None:
                # Acks already decided are sent before the channel closes (fewer duplicates), and
                # messages nobody finished are handed back now instead of when their lease lapses.
                # Also after the acks failed for good (``fatal``): an outage that outlasted the ack
                # retries is often over by the time the group closes, and messages pulled since it
                # healed would otherwise wait out their ack deadline before anyone sees them again.
                self._buffer.nacks.extend(self._unsettled.drain())
                await best_effort(
                    self.flush(),
                    self.log,
                    "Final ack flush on %s failed; Pub/Sub redelivers",
                    self.source_label(),
                    timeout=10,
                )
        finally:
            clients = (self._subscriber, self._publisher)
            self._subscriber = self._publisher = None
            await close_quietly(
                *(client.transport for client in clients if client is not None), log=self.log, where=self.source_label()
            )
