"""
Kafka producer for shared streams: one aiokafka consumer-group member per stream, native asyncio.

Lanes are ``(topic, partition)``. Within a lane the manager hands ``advance`` resolved messages in
fan-out order; the producer commits a partition only through its **contiguous prefix of terminally
handled offsets** (committed or dead-lettered), so a commit never passes a message that still has
to come back.

==================  ===============================================================================
outcome             what happens on Kafka
==================  ===============================================================================
acked (COMMIT)      offset marked done; committed as soon as everything before it is done
rejected            produced to ``dlq_topic`` (original key, value, headers + ``x-dead-letter-*``
(DEAD_LETTER)       headers) and awaited (acks=all) **before** the offset is marked done. Without a
                    ``dlq_topic`` it is logged with its coordinates and committed past; the record
                    stays in the source topic until retention (Kafka never deletes on commit).
                    A record the added headers push over the size limit (``max_request_size``, or
                    the broker's ``message.max.bytes``) is dead-lettered with an empty value and
                    without its headers, ``x-dead-letter-omitted`` saying so, and logged: the original
                    stays in the source topic until retention, and the partition moves on.
                    The record's own ``x-dead-letter-*`` headers go as ``x-original-x-dead-letter-*``
                    (:func:`original_headers`): the provider's are the only ones of that name.
failed (REDELIVER)  not done: the lane holds at this offset and the consumer seeks back to it, so it
                    is delivered again in this session (only the held offsets are re-yielded; the
                    ones still in flight or done are skipped, not duplicated). With watcher
                    positions it counts as an attempt only if a watcher failed *on* it or it is
                    the lowest failed offset of its partition (a watcher that left fails what it
                    had queued behind too; it replays those from its position).
poison              a failed message whose in-session attempt count reached
                    ``max_delivery_attempts`` is dead-lettered as above instead.
undecodable         a batch aiokafka cannot read is read again by kafka_records: header names that
                    are not UTF-8 are delivered (``base64:`` names); what cannot be read at all (one
                    record, or the rest of a batch) is a delivery every watcher rejects, so it is
                    dead-lettered as above (raw bytes; its offset or range) and counted as poison.
zero-subscriber     like failed, but re-read after ``hold_backoff`` seconds and without counting an
(HOLD)              attempt (nobody saw it).
revoked partition   outcomes arriving for a partition this member no longer owns are dropped: never
                    committed by a consumer that lost the partition; the new owner re-reads them.
advance raises      (DLQ write or commit failed) the manager terminates the group; nothing past the
                    last commit was committed, so the next group re-reads from there.
crash / restart     nothing unpersisted is lost: each partition resumes at the lowest stored position
                    of the stream's watchers (``position_store="group"``: the committed offset) and
                    each watcher re-receives what follows its own position (idempotent watchers:
                    dedup on ``message_id``).
late watcher        (``position_store="watchers"``) a watcher whose stored position is behind the
                    running stream: the partition is rewound to it under a new epoch (outcomes of
                    the old epoch still in flight are dropped, never committed, and read again);
                    the watchers that had those messages skip them (``skip_for``). Commits never
                    go backwards.
==================  ===============================================================================

Assignment: with ``position_store="watchers"`` (default) the consumer assigns itself every partition
(no group membership: siblings on several triggerers each read everything, see _core/positions.py);
with ``"group"`` the group assigns partitions and a partial assignment is detected below.

Flow control: when watchers have no credit left, every assigned partition is paused and the
consumer keeps polling (empty fetches), so a group member stays in the group while
``max.poll.interval.ms`` runs, and resumes as soon as credit returns.

Consumer group: the trigger's ``group_id``, else the connection's ``group.id``, else
``airflow-shared-stream.<conn>.<topics>``; resolved when the stream opens, because the connection
is read in the triggerer (a changed ``group.id`` takes effect when the stream restarts). Each
producer claims its group in :data:`group_claims` for as long as it runs: two streams of one
triggerer in one group on overlapping topics would split the partitions between them, each
believing the other's partitions were lost, so the second one fails instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any, cast

from airflow_shared_stream_provider._core.dispositions import Disposition
from airflow_shared_stream_provider._core.envelope import (
    StreamMessage,
    build_envelope,
    iso_from_epoch_ms,
    text_attributes,
    text_value,
)
from airflow_shared_stream_provider._core.errors import (
    BrokerHandleClosedError,
    PartialAssignmentError,
    SharedStreamConfigError,
    broker_sdk,
)
from airflow_shared_stream_provider._core.positions import late_join_lookback, position_interval
from airflow_shared_stream_provider._core.producer import Decided, SharedStreamProducerBase
from airflow_shared_stream_provider._core.tasks import call_keeping_cancellation, wait_for
from airflow_shared_stream_provider.producers.kafka_config import (
    KafkaClientConfig,
    load_kafka_client_config,
)
from airflow_shared_stream_provider.producers.kafka_groups import (
    GroupClaim,
    bootstrap_addresses,
    group_claims,
)
from airflow_shared_stream_provider.producers.kafka_lanes import Lane, next_epoch
from airflow_shared_stream_provider.producers.kafka_placement import WatcherPlacement
from airflow_shared_stream_provider.triggers.kafka import KafkaStreamSettings

with broker_sdk("kafka"):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor
    from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
    from aiokafka.errors import (
        CommitFailedError,
        IllegalStateError,
        KafkaConnectionError,
        KafkaError,
        MessageSizeTooLargeError,
        RecordListTooLargeError,
    )
    from aiokafka.helpers import create_ssl_context
    from aiokafka.structs import OffsetAndMetadata

    from airflow_shared_stream_provider.producers.kafka_records import TolerantReader, Undecodable

# A record too large for the dead-letter topic: refused by the client (max_request_size) or the broker.
TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)
# Watcher positions: how long a graceful stop tries to store them (the rest: kafka_placement).
POSITION_FLUSH_TIMEOUT = 3.0
_log = logging.getLogger(__name__)


class KafkaMessage(StreamMessage):
    """
    One record as broadcast to the watchers *and* as the broker payload ``advance`` gets back: its
    coordinates, and the bytes a DLQ write re-sends.

    One object instead of a message plus a separate delivery: every message in flight survives
    several young GC passes and is promoted, so each object per message is one more for every
    full pass to walk (measured at N=10: full passes are half of the run time on this machine).
    """

    __slots__ = ("delivery_attempt", "epoch", "headers", "key", "offset", "tp", "value")

    def __init__(
        self,
        envelope: dict[str, Any],
        seq: int,
        forced_rejection: str | None,
        *,
        delivery_attempt: int,
        tp: TopicPartition,
        offset: int,
        epoch: int,
        key: bytes | None,
        value: bytes | None,
        headers: tuple[tuple[str | bytes, bytes | None], ...],
    ) -> None:
        super().__init__(envelope, seq, forced_rejection)
        self.delivery_attempt = delivery_attempt
        self.tp = tp
        self.offset = offset
        self.epoch = epoch
        self.key = key
        self.value = value
        self.headers = headers

    @property
    def message(self) -> StreamMessage:
        return self

    def source(self) -> str:
        """Where the record is: ``topic/partition/offset`` (the ``x-dead-letter-source`` header)."""
        return f"{self.tp.topic}/{self.tp.partition}/{self.offset}"


DEAD_LETTER_PREFIX = "x-dead-letter-"
ORIGINAL_PREFIX = "x-original-"


def original_headers(headers: Sequence[tuple[str | bytes, bytes | None]]) -> list[tuple[str, bytes | None]]:
    """
    A record's own headers as its dead-letter record carries them, before the provider's
    ``x-dead-letter-*`` ones.

    * The provider's ``x-dead-letter-*`` headers are authoritative: a header of the record whose
      name starts with ``x-dead-letter-`` (any case) is renamed ``x-original-<name>``. A sender
      cannot forge where a dead letter came from or why (a reader taking the first header of a
      name would otherwise get the sender's), and a record dead-lettered twice (replayed from the
      DLQ) keeps the earlier verdict under the new name instead of losing it.
    * A key that is not UTF-8 (bytes, see kafka_records) goes as its ``base64:...`` text, as the
      envelope shows it: aiokafka's producer writes header keys as UTF-8 text only.
    """
    out: list[tuple[str, bytes | None]] = []
    for name, value in headers:
        text = name if isinstance(name, str) else text_value(name)
        if text[: len(DEAD_LETTER_PREFIX)].lower() == DEAD_LETTER_PREFIX:
            text = ORIGINAL_PREFIX + text
        out.append((text, value))
    return out


def _dead_letter_location(delivery: KafkaMessage) -> str:
    """``topic/partition/offset`` for logs, with the range of an undecodable batch rest."""
    source = delivery.source()
    if isinstance(delivery, UndecodableKafkaMessage) and delivery.first_offset != delivery.offset:
        return f"{source} (to offset {delivery.offset})"
    return source


class UndecodableKafkaMessage(KafkaMessage):
    """
    What could not be read as records (kafka_records.Undecodable): ``first_offset`` to ``offset``
    (one record, or the rest of a batch). The lane tracks ``offset``, the last one, so the commit
    after its dead-letter passes all of them; the dead-letter record names ``first_offset``.
    """

    __slots__ = ("first_offset",)

    def __init__(
        self,
        envelope: dict[str, Any],
        seq: int,
        forced_rejection: str,
        *,
        delivery_attempt: int,
        tp: TopicPartition,
        offset: int,
        first_offset: int,
        epoch: int,
        value: bytes,
    ) -> None:
        super().__init__(
            envelope,
            seq,
            forced_rejection,
            delivery_attempt=delivery_attempt,
            tp=tp,
            offset=offset,
            epoch=epoch,
            key=None,
            value=value,
            headers=(),
        )
        self.first_offset = first_offset

    def source(self) -> str:
        return f"{self.tp.topic}/{self.tp.partition}/{self.first_offset}"


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, producer: KafkaSharedStreamProducer) -> None:
        self._producer = producer

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self._producer._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self._producer._on_assigned(set(assigned))


class KafkaSharedStreamProducer(SharedStreamProducerBase[KafkaStreamSettings, KafkaMessage]):
    """The broker side of :class:`~airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger`."""

    max_message_bytes = 1024 * 1024  # the broker's default message.max.bytes
    # Kafka counts attempts itself (kafka_lanes, kept in the committed offset's metadata): with
    # watcher positions only the culprit, the suspect or the lowest failed offset counts (_apply).
    forgives_collateral_failures = False
    # A returning watcher replays what it missed from its stored position (_core/positions.py).
    gives_back_missed_messages = False

    def __init__(self, settings: KafkaStreamSettings, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        self._consumer: AIOKafkaConsumer | None = None
        self._group_claim: GroupClaim | None = None
        self._dlq: AIOKafkaProducer | None = None
        self._config: KafkaClientConfig | None = None
        self._lanes: dict[TopicPartition, Lane] = {}
        self._partial_since: float | None = None
        self._partial_detail = ""
        self._last_partial_warning = 0.0
        self._paused = False
        self._timers: set[asyncio.TimerHandle] = set()
        self._watcher_positions = settings.position_store == "watchers"
        self._committed: dict[TopicPartition, int] = {}
        self._placement: WatcherPlacement | None = None  # watcher positions: set when the stream opens

    def source_label(self) -> str:
        return ",".join(self.settings.topics)

    def competing_consumers(self) -> bool:
        # With watcher positions every stream reads every partition: a split loses nothing.
        # Group mode has its own, sharper check (the partial assignment).
        return False

    @property
    def group_id(self) -> str:
        """The consumer group, resolved when the stream opens (it may come from the connection)."""
        if self._config is None:
            raise BrokerHandleClosedError(f"Kafka shared stream {self.source_label()}: the stream is not open yet")
        return self._config.group.group_id

    # -- connection ----------------------------------------------------------------------------
    async def _load_config(self) -> KafkaClientConfig:
        # effective_group_id() is the trigger's group_id when set (which wins over the connection's
        # group.id anyway), else the derived name: the last resort.
        return await load_kafka_client_config(
            self.settings.kafka_config_id,
            trigger_group_id=self.settings.group_id,
            derived_group_id=self.settings.effective_group_id(),
        )

    def _ssl_context(self, config: KafkaClientConfig) -> Any:
        if not config.consumer["security_protocol"].endswith("SSL"):
            return None
        context = create_ssl_context(**config.ssl)
        context.check_hostname = config.check_hostname
        return context

    async def _start_consumer(self) -> AIOKafkaConsumer:
        config = self._config = await self._load_config()
        claim = GroupClaim(
            group=config.group,
            stream_key=self.stream_key,
            settings=self.settings,
            bootstrap=bootstrap_addresses(config.consumer["bootstrap_servers"]),
        )
        if not self._watcher_positions:
            # Group mode only: there the group splits partitions between its members. With watcher
            # positions each stream assigns itself every partition, and streams sharing a group
            # only share where the committed offsets (lag, and the start without positions) go.
            # Recorded before claiming: _close releases it even when the claim lost (a no-op then).
            self._group_claim = claim
            await group_claims.claim(claim)
        self.log.info(
            "Opening Kafka shared stream %s for group %s (%s): %s",
            self.source_label(),
            config.group.group_id,
            config.group.origin(),
            config.redacted(),
        )
        consumer = AIOKafkaConsumer(
            **config.consumer,
            enable_auto_commit=False,
            ssl_context=self._ssl_context(config),
            # aiokafka offers only roundrobin by default; librdkafka (the upstream provider's
            # client) offers range first. A broker that keeps a group's protocol after its last
            # member left (Tansu does) then refuses a roundrobin-only join with
            # InconsistentGroupProtocol: offering both lets a migrated group be joined. A stream is
            # meant to be the only member of its group on its topics (group_claims, the
            # partial-assignment check), so which assignor wins changes nothing.
            partition_assignment_strategy=(RoundRobinPartitionAssignor, RangePartitionAssignor),
        )
        # A record aiokafka cannot decode (a non-UTF-8 header key, a malformed record) must not stop
        # the partition forever: read such batches tolerantly, for this consumer only (kafka_records).
        reader = TolerantReader.install(consumer)
        if not self._watcher_positions:
            consumer.subscribe(topics=list(self.settings.topics), listener=_Rebalance(self))
        try:
            await consumer.start()
        except KafkaConnectionError as exc:
            await consumer.stop()
            raise SharedStreamConfigError(
                f"cannot reach Kafka at {config.consumer['bootstrap_servers']} "
                f"(connection {self.settings.kafka_config_id!r}): {exc}"
            ) from exc
        reader.attach()
        self._consumer = consumer
        if self._watcher_positions:
            # Every partition, assigned by this stream itself: no group membership, so no split
            # between triggerers and no rebalance (the group only stores committed offsets).
            partitions = await self._all_partitions(consumer)
            consumer.assign(partitions)
            for tp in partitions:
                self._lanes[tp] = Lane(epoch=next_epoch())
        return consumer

    async def _all_partitions(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        """Every partition of every topic; waits ``partial_assignment_grace`` for a topic to appear."""
        deadline = time.monotonic() + self.settings.partial_assignment_grace
        while True:
            await consumer.topics()  # a metadata refresh for all topics
            missing = [topic for topic in self.settings.topics if not consumer.partitions_for_topic(topic)]
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise SharedStreamConfigError(
                    f"Kafka shared stream {self.source_label()}: topic(s) {missing} do not exist "
                    f"(waited {self.settings.partial_assignment_grace:.0f}s)"
                )
            await asyncio.sleep(min(1.0, self.settings.poll_timeout))
        return [
            TopicPartition(topic, partition)
            for topic in self.settings.topics
            for partition in sorted(consumer.partitions_for_topic(topic))
        ]

    # -- rebalances ----------------------------------------------------------------------------
    def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            # Commits happen eagerly in advance(); what is still in flight for this partition
            # belongs to the next owner now, and its late outcomes are ignored (epoch mismatch).
            self._lanes.pop(tp, None)
            if self._placement is not None:
                self._placement.forget(tp)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            self._lanes[tp] = Lane(epoch=next_epoch())
        self._check_assignment(assigned)
        if assigned and self._consumer is not None:
            # Attempt counts of held messages, stored with the last commit (see kafka_lanes).
            try:
                committed = await self._consumer._coordinator.fetch_committed_offsets(list(assigned))
            except KafkaError:
                self.log.warning("Could not read committed offsets' metadata; attempt counts restart", exc_info=True)
                return
            for tp, offset_and_metadata in committed.items():
                lane = self._lanes.get(tp)
                if lane is not None and offset_and_metadata is not None:
                    lane.restore_attempts(offset_and_metadata.metadata)

    def _check_assignment(self, assigned: set[TopicPartition]) -> None:
        """Detect a partial assignment: this member must read every partition of every topic."""
        consumer = self._consumer
        missing: list[str] = []
        for topic in self.settings.topics:
            partitions = consumer.partitions_for_topic(topic) if consumer is not None else None
            if not partitions:
                missing.append(f"{topic}: no partitions known (does the topic exist?)")
                continue
            owned = {tp.partition for tp in assigned if tp.topic == topic}
            if owned != set(partitions):
                missing.append(f"{topic}: assigned {sorted(owned)} of {sorted(partitions)}")
        if missing:
            self._partial_detail = "; ".join(missing)
            if self._partial_since is None:
                self._partial_since = time.monotonic()
        else:
            self._partial_since = None
            self._partial_detail = ""

    def _enforce_full_assignment(self) -> None:
        if self._partial_since is None:
            return
        if self._consumer is not None:
            # Metadata may have arrived since the assignment: re-check before judging.
            self._check_assignment(set(self._consumer.assignment()))
            if self._partial_since is None:
                return
        held_for = time.monotonic() - self._partial_since
        if held_for < self.settings.partial_assignment_grace:
            return
        message = (
            f"Kafka shared stream {self.source_label()!r} (group {self.group_id!r}) does not own all "
            f"partitions for {held_for:.0f}s: {self._partial_detail}. Another consumer in the same group "
            "(most likely sibling watchers on another triggerer) reads the rest, so these watchers "
            "would silently see only part of the topic. See docs/kafka.md, 'Several triggerers'."
        )
        self.counters.gauge("partial_assignment", 1)
        if self.settings.on_partial_assignment == "fail":
            raise PartialAssignmentError(message)
        now = time.monotonic()
        if now - self._last_partial_warning >= 60:
            self._last_partial_warning = now
            self.log.error(message)

    # -- the stream ----------------------------------------------------------------------------
    async def _messages(self) -> AsyncIterator[tuple[Any, Any]]:
        consumer = await self._start_consumer()
        await self.cohort_ready()
        positions = self.gate.positions
        keep_positions = self._watcher_positions
        write_interval = position_interval()
        placement: WatcherPlacement | None = None
        if keep_positions:
            lookback = positions.recreated_lookback = late_join_lookback()
            placement = self._placement = WatcherPlacement(
                lanes=self._lanes,
                positions=positions,
                counters=self.counters,
                log=self.log,
                source_label=self.source_label(),
                in_flight=lambda: self._in_flight,
                lookback=lookback,
                batching=self.batching,
            )
            # Client calls on this task: a cancellation one loses still ends it (see _core/tasks.py).
            await call_keeping_cancellation(placement.place_at_start(consumer), self.source_label())
        poll_ms = int(self.settings.poll_timeout * 1000)
        group_id = self.group_id
        max_payload_bytes = self.max_envelope_bytes
        oversize_policy = self.settings.oversize_policy
        while True:
            if placement is not None:
                if positions.unplaced:
                    await call_keeping_cancellation(placement.place_late(consumer), self.source_label())
                if positions.write_due(write_interval):
                    positions.schedule_write(placement.positions_of)
                elif positions.departed and positions.departed_write_due():
                    positions.schedule_write(placement.positions_of, departed_only=True)
                now = time.monotonic()
                if placement.sample_due(now):
                    placement.sample_positions(now)
            credit = await self._credit_or_keepalive(consumer)
            if credit == 0:
                continue
            if not keep_positions:
                self._enforce_full_assignment()
            fetched = await call_keeping_cancellation(
                consumer.getmany(timeout_ms=poll_ms, max_records=min(credit, self.settings.max_batch_size)),
                self.source_label(),
            )
            if not fetched:
                self.deferred.release_all()  # quiet stream: hold nothing (see _core/release.py)
            received = 0
            for tp, records in fetched.items():
                lane = self._lanes.get(tp)
                if lane is None:
                    continue  # revoked while the fetch was in flight
                topic = tp.topic
                partition = tp.partition
                id_prefix = f"{topic}/{partition}/"
                epoch = lane.epoch
                floor = lane.floor
                # Popped, not iterated: each ConsumerRecord is released as soon as its message is
                # built, instead of the whole batch living until its last message was yielded.
                # Fewer objects outlive a young-generation GC pass, so fewer full passes.
                records.reverse()
                while records:
                    record = records.pop()
                    # An undecodable record (or the rest of a batch, see kafka_records): the lane
                    # tracks its last offset, so the commit after its dead-letter passes all of it.
                    undecodable = record.__class__ is Undecodable
                    offset = record.last_offset if undecodable else record.offset
                    # A re-read of a held offset (a redelivery) goes to every watcher, as in group
                    # mode; only what a rewind re-reads for a late watcher is skipped by the others.
                    first_read = offset > lane.high_yielded
                    attempt = lane.admit(offset)
                    if not attempt:
                        continue  # in flight or done: a replay after seek-back, not a new message
                    if lane.dead and offset in lane.dead:
                        # Re-read by a rewind, but already in the DLQ: done without a delivery. The
                        # done prefix is dropped now, so positions pass it even if nothing follows
                        # (the group commit catches up with the next advance).
                        lane.settle(offset)
                        lane.commit_point()
                        continue
                    received += 1
                    if undecodable:
                        unreadable = self._undecodable_message(record, tp, epoch, attempt, group_id)
                        if offset < floor and first_read:
                            unreadable.skip_for = lane.skip_for(offset)
                        yield self.hold(unreadable, record.raw), unreadable
                        continue
                    headers = tuple(record.headers)  # already a tuple: no copy
                    key = record.key
                    timestamp = record.timestamp
                    try:
                        # The hot path builds the envelope itself (no method call per record); the
                        # base's guard answers when it raises: forced-rejected, never the group's end.
                        envelope, forced = build_envelope(
                            broker=self.broker,
                            source=topic,
                            message_id=id_prefix + str(offset),
                            body=record.value,
                            attributes=text_attributes(headers) if headers else {},
                            published_at=iso_from_epoch_ms(timestamp) if timestamp and timestamp > 0 else None,
                            delivery_attempt=attempt,
                            metadata={
                                "topic": topic,
                                "partition": partition,
                                "offset": offset,
                                "key": text_value(key) if key is not None else None,
                                "timestamp_type": "log_append" if record.timestamp_type == 1 else "create",
                                "group_id": group_id,
                            },
                            max_payload_bytes=max_payload_bytes,
                            oversize_policy=oversize_policy,
                        )
                    except Exception as exc:
                        envelope, forced = self.failed_envelope(
                            source=topic,
                            message_id=id_prefix + str(offset),
                            body=record.value,
                            published_at=None,
                            delivery_attempt=attempt,
                            error=exc,
                        )
                    message = KafkaMessage(
                        envelope,
                        self.take_seq(),
                        forced,
                        delivery_attempt=attempt,
                        tp=tp,
                        offset=offset,
                        epoch=epoch,
                        key=key,
                        value=record.value,
                        headers=headers,
                    )
                    if offset < floor and first_read:
                        message.skip_for = lane.skip_for(offset)
                    yield self.hold(message, record.value), message
            self.counters.add("received", received)

    def _undecodable_message(
        self, record: Undecodable, tp: TopicPartition, epoch: int, attempt: int, group_id: str
    ) -> UndecodableKafkaMessage:
        """
        A delivery every watcher rejects (``forced_rejection``) for what could not be read: the
        dead-letter path writes it with where it was and why, then its offsets are committed past.
        """
        location = record.location()
        reason = f"undecodable Kafka record at {location}: {record.reason}"
        self.log.warning("%s; every watcher rejects it, so it is dead-lettered", reason)
        envelope, _ = build_envelope(
            broker=self.broker,
            source=tp.topic,
            message_id=f"{tp.topic}/{tp.partition}/{record.offset}",
            body=None,
            attributes={},
            published_at=None,
            delivery_attempt=attempt,
            metadata={
                "topic": tp.topic,
                "partition": tp.partition,
                "offset": record.offset,
                "last_offset": record.last_offset,
                "key": None,
                "timestamp_type": None,
                "group_id": group_id,
                "undecodable": record.reason,
            },
            max_payload_bytes=self.max_envelope_bytes,
            oversize_policy="truncate",
        )
        return UndecodableKafkaMessage(
            envelope,
            self.take_seq(),
            reason,
            delivery_attempt=attempt,
            tp=tp,
            offset=record.last_offset,
            first_offset=record.offset,
            epoch=epoch,
            value=record.raw,
        )

    async def _credit_or_keepalive(self, consumer: AIOKafkaConsumer) -> int:
        """
        Credit for the next fetch. Running out of credit is normal (a fetch yields a whole batch
        before watchers run): wait for it first. Only a stall longer than ``poll_timeout`` pauses
        the partitions and polls empty fetches, which keeps this member in the group while
        ``max.poll.interval.ms`` runs. Pausing is not the fast path because aiokafka drops the
        prefetched records of a paused partition and must fetch them again on resume.
        """
        credit = self.credit()
        if credit == 0:
            try:
                credit = await wait_for(self.wait_for_credit(), timeout=self.settings.poll_timeout)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                if not self._paused:
                    consumer.pause(*consumer.assignment())
                    self._paused = True
                # Paused partitions return nothing; a cancellation this loses still ends us.
                await call_keeping_cancellation(consumer.getmany(timeout_ms=0), self.source_label())
                return 0
        if self._paused:
            consumer.resume(*consumer.assignment())
            self._paused = False
        return credit

    def lane_of(self, broker_payload: KafkaMessage) -> Hashable:
        tp: Hashable = broker_payload.tp
        return tp

    # -- advance -------------------------------------------------------------------------------
    async def _apply(self, decided: Sequence[Decided[KafkaMessage]]) -> None:
        consumer = self._consumer
        if consumer is None:
            raise BrokerHandleClosedError(f"Kafka consumer for {self.source_label()} is closed; batch not advanced")
        first = decided[0].delivery
        tp = first.tp
        lane = self._lanes.get(tp)
        if lane is None or lane.epoch != first.epoch:
            self.counters.add("stale_skipped", len(decided))
            self.log.info("Dropping %d outcomes for %s: partition reassigned since they were read", len(decided), tp)
            return
        dead = [entry for entry in decided if entry.disposition is Disposition.DEAD_LETTER]
        # Re-read by a rewind for a late watcher and rejected again: in the DLQ already (Lane.judged).
        written = [entry for entry in dead if entry.delivery.offset not in lane.judged]
        if written:
            await self._dead_letter(written)
            # Watchers rejected these (forced), so the base counts them as rejected, not as
            # poison; a record nobody could read is poison all the same (docs/kafka.md).
            unreadable = sum(1 for entry in written if isinstance(entry.delivery, UndecodableKafkaMessage))
            if unreadable:
                self.counters.add("poison", unreadable)
        replay_now = replay_later = False
        for entry in decided:
            delivery = entry.delivery
            if entry.disposition is Disposition.COMMIT:
                lane.settle(delivery.offset)
            elif entry.disposition is Disposition.DEAD_LETTER:
                lane.settle(delivery.offset)
                message = delivery.message
                lane.dead_lettered(
                    delivery.offset, judged=message.forced_rejection is None and bool(message.rejections)
                )
            elif entry.disposition is Disposition.HOLD:
                lane.hold(delivery.offset, attempts=delivery.delivery_attempt - 1)  # nobody saw it
                replay_later = True
            else:
                # With watcher positions a failure counts toward the poison cap when a watcher failed
                # *on* this message, or when it is the lowest failed offset of its lane (an ack
                # timeout marks no culprit: the head is the suspect). A watcher that fails leaves,
                # the messages still queued behind it come back as failed too, and it replays them
                # from its position when it returns: counting those would dead-letter innocent
                # messages after a few comebacks.
                counted = (
                    not self._watcher_positions
                    or delivery.message.culprit
                    or delivery.message.suspect
                    or not any(held < delivery.offset for held in lane.redeliver)
                )
                lane.hold(delivery.offset, attempts=delivery.delivery_attempt - (0 if counted else 1))
                replay_now = True
        await self._commit(consumer, tp, lane, attempts_changed=replay_now or replay_later)
        if replay_now:
            self._seek_to_redeliveries(tp, lane.epoch)
        elif replay_later:
            loop = asyncio.get_running_loop()
            handle = loop.call_later(self.settings.hold_backoff, self._seek_to_redeliveries, tp, lane.epoch)
            self._timers.add(handle)

    async def _commit(
        self, consumer: AIOKafkaConsumer, tp: TopicPartition, lane: Lane, *, attempts_changed: bool
    ) -> None:
        """Commit the done prefix; also when only the attempt counts changed (they ride along)."""
        target = lane.commit_point()
        if target is None:
            if not attempts_changed:
                return
            target = lane.position()
            if target is None:
                return
        if target < self._committed.get(tp, -1):
            return  # a rewound lane re-reads below its last commit: the group offset never goes back
        self._committed[tp] = target
        self.counters.api_calls += 1
        try:
            await consumer.commit({tp: OffsetAndMetadata(target, lane.commit_metadata())})
        except (CommitFailedError, IllegalStateError) as exc:
            if tp not in consumer.assignment():
                self.counters.add("stale_skipped")
                self.log.warning("Commit of %s@%d dropped: partition no longer assigned (%s)", tp, target, exc)
                return
            raise
        highwater = consumer.highwater(tp)
        if highwater is not None:
            self.counters.gauge("consumer_lag", highwater - target, topic=tp.topic, partition=str(tp.partition))

    def _seek_to_redeliveries(self, tp: TopicPartition, epoch: int) -> None:
        lane = self._lanes.get(tp)
        consumer = self._consumer
        if lane is None or lane.epoch != epoch or consumer is None or tp not in consumer.assignment():
            return
        target = lane.replay_from()
        if target is not None:
            consumer.seek(tp, target)

    async def _dead_letter(self, entries: Sequence[Decided[KafkaMessage]]) -> None:
        topic = self.settings.dlq_topic
        if topic is None:
            for entry in entries:
                self.log.error(
                    "Dead-lettering %s without a dlq_topic: committed past; the record stays in the "
                    "source topic until retention. Reason: %s",
                    _dead_letter_location(entry.delivery),
                    entry.decision.reason,
                )
            return
        producer = await self._dlq_producer()
        sends = [await self._send_dead_letter(producer, topic, entry) for entry in entries]
        self.counters.api_calls += len(sends)
        # Every record acknowledged by the broker (acks=all) before any offset is marked done.
        results = await asyncio.gather(*sends, return_exceptions=True)
        for entry, result in zip(entries, results, strict=True):
            if isinstance(result, TOO_LARGE):
                # The broker refused the batch that held it: again on its own, then cut if need be.
                try:
                    await (await self._send_dead_letter(producer, topic, entry))
                except TOO_LARGE as exc:
                    await (await self._send_dead_letter(producer, topic, entry, refused=exc))
                self.counters.api_calls += 1
            elif isinstance(result, BaseException):
                raise result

    async def _send_dead_letter(
        self, producer: AIOKafkaProducer, topic: str, entry: Decided[KafkaMessage], *, refused: Exception | None = None
    ) -> asyncio.Future[Any]:
        """
        Queue one dead-letter record; return the future of its acknowledgement.

        The original key, value and headers (see :func:`original_headers`) plus the
        ``x-dead-letter-*`` headers. When that is over the size limit (the client's check, or
        ``refused`` by the broker), the record goes with an empty value and without the original
        headers: the original stays in the source topic until retention, where
        ``x-dead-letter-source`` points. An undecodable record's value is its raw bytes, and
        ``x-dead-letter-last-offset`` ends the range when it covers more than one offset.
        """
        d = entry.delivery
        source = d.source()
        fields = [
            ("x-dead-letter-reason", entry.decision.reason.encode()),
            ("x-dead-letter-source", source.encode()),
            ("x-dead-letter-attempts", str(d.delivery_attempt).encode()),
            ("x-dead-letter-group", self.group_id.encode()),
        ]
        if isinstance(d, UndecodableKafkaMessage) and d.first_offset != d.offset:
            fields.append(("x-dead-letter-last-offset", str(d.offset).encode()))
        if refused is None:
            # aiokafka refuses a record with neither key nor value: a keyless tombstone goes as b"".
            value = d.value if d.value is not None or d.key is not None else b""
            try:
                return cast(
                    "asyncio.Future[Any]",
                    await producer.send(topic, value=value, key=d.key, headers=[*original_headers(d.headers), *fields]),
                )
            except TOO_LARGE as exc:
                refused = exc
        size = len(d.value or b"") + sum(len(name) + len(header or b"") for name, header in d.headers)
        self.log.error(
            "Dead-lettering %s to %s without its value and headers (%d bytes): too large with the "
            "dead-letter headers (%s). The original stays in the source topic until retention. Reason: %s",
            source,
            topic,
            size,
            refused,
            entry.decision.reason,
        )
        omitted = f"value and headers ({size} bytes): over the size limit; the original is at {source}"
        headers = [*fields, ("x-dead-letter-omitted", omitted.encode())]
        return cast("asyncio.Future[Any]", await producer.send(topic, value=b"", key=d.key, headers=headers))

    async def _dlq_producer(self) -> AIOKafkaProducer:
        if self._dlq is None:
            config = self._config
            if config is None:
                raise BrokerHandleClosedError("Kafka configuration not loaded")
            producer = AIOKafkaProducer(**config.common, acks="all", ssl_context=self._ssl_context(config))
            await producer.start()
            self._dlq = producer
        return self._dlq

    async def _close(self) -> None:
        gate = self._gate
        placement = self._placement
        if placement is not None and gate is not None and self._lanes:
            # A graceful stop: store how far the watchers got (a crash skips this; positions then
            # lag by up to position_interval, which costs duplicates, never loss).
            await gate.positions.flush(placement.positions_of, timeout=POSITION_FLUSH_TIMEOUT)
            gate.positions.positions_of = None
            gate.positions.departures = None
            gate.positions.departed.clear()  # their lanes are gone: what was written stays
        try:
            await self._close_clients()
        finally:
            self._lanes.clear()
            # Released once the consumer left the group (so a stream waiting for the group never
            # overlaps with this member), and also when closing failed: a claim that outlived
            # its producer would refuse the group to every other stream of this process.
            claim, self._group_claim = self._group_claim, None
            if claim is not None:
                group_claims.release(claim)

    async def _close_clients(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        dlq, self._dlq = self._dlq, None
        consumer, self._consumer = self._consumer, None
        if dlq is not None:
            try:
                await dlq.stop()
            except KafkaError:
                self.log.warning("Closing the Kafka DLQ producer failed", exc_info=True)
        if consumer is not None:
            try:
                await consumer.stop()
            except KafkaError:
                self.log.warning("Closing the Kafka consumer failed", exc_info=True)
