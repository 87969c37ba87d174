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
failed (REDELIVER)  not done: the lane holds at this offset and the consumer seeks back to it, so it
                    is delivered again in this session (only the held offsets are re-yielded; the
                    ones still in flight or done are skipped, not duplicated).
poison              a failed message whose in-session attempt count reached
                    ``max_delivery_attempts`` is dead-lettered as above instead.
zero-subscriber     like failed, but re-read after ``hold_backoff`` seconds and without counting an
(HOLD)              attempt (nobody saw it).
revoked partition   outcomes arriving for a partition this member no longer owns are dropped: never
                    committed by a consumer that lost the partition; the new owner re-reads them.
advance raises      (DLQ write or commit failed) the manager terminates the group; nothing past the
                    last commit was committed, so the next group re-reads from there.
crash / restart     nothing uncommitted is lost: the group resumes from the last committed offset
                    and re-delivers everything after it (watchers must be idempotent:
                    dedup on ``message_id``).
==================  ===============================================================================

Flow control: when watchers have no credit left, every assigned partition is paused and the
consumer keeps polling (empty fetches), so it stays in the group while ``max.poll.interval.ms`` runs
and resumes as soon as credit returns.

Consumer group: the trigger's ``group_id``, else the connection's ``group.id``, else
``airflow-shared-stream.<conn>.<topics>``; resolved when the stream opens, because the connection
is read in the triggerer (a changed ``group.id`` takes effect when the stream restarts). Each
producer claims its group in :data:`group_claims` for as long as it runs: two streams of one
triggerer in one group on overlapping topics would split the partitions between them, each
believing the other's partitions were lost, so the second one fails instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

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
    missing_dependency,
)
from airflow_shared_stream_provider._core.producer import Decided, SharedStreamProducerBase
from airflow_shared_stream_provider.producers.kafka_config import (
    KafkaClientConfig,
    kafka_client_config,
)
from airflow_shared_stream_provider.producers.kafka_groups import (
    GroupClaim,
    bootstrap_addresses,
    group_claims,
)
from airflow_shared_stream_provider.producers.kafka_lanes import Lane
from airflow_shared_stream_provider.triggers.kafka import KafkaStreamSettings

try:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor
    from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
    from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaConnectionError, KafkaError
    from aiokafka.helpers import create_ssl_context
    from aiokafka.structs import OffsetAndMetadata
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_dependency("kafka", "aiokafka", exc) from exc

_epochs = itertools.count(1)
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
        headers: tuple[tuple[str, bytes], ...],
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


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, producer: KafkaSharedStreamProducer) -> None:
        self._producer = producer

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self._producer._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self._producer._on_assigned(set(assigned))


class KafkaSharedStreamProducer(SharedStreamProducerBase[KafkaStreamSettings, KafkaMessage]):
    """The broker side of :class:`~airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger`."""

    broker = "kafka"

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

    def source_label(self) -> str:
        return ",".join(self.settings.topics)

    @property
    def group_id(self) -> str:
        """The consumer group, resolved when the stream opens (it may come from the connection)."""
        if self._config is None:
            raise BrokerHandleClosedError(f"Kafka shared stream {self.source_label()}: the stream is not open yet")
        return self._config.group.group_id

    # -- connection ----------------------------------------------------------------------------
    async def _load_config(self) -> KafkaClientConfig:
        from airflow.sdk import BaseHook

        conn_id = self.settings.kafka_config_id
        try:
            connection = await BaseHook.aget_connection(conn_id)
        except Exception as exc:
            raise SharedStreamConfigError(f"Kafka connection {conn_id!r} could not be read: {exc}") from exc
        # effective_group_id() is the trigger's group_id when set (which wins over the connection's
        # group.id anyway), else the derived name: the last resort.
        return kafka_client_config(
            conn_id,
            connection.extra_dejson,
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
        consumer.subscribe(topics=list(self.settings.topics), listener=_Rebalance(self))
        try:
            await consumer.start()
        except KafkaConnectionError as exc:
            await consumer.stop()
            raise SharedStreamConfigError(
                f"cannot reach Kafka at {config.consumer['bootstrap_servers']} "
                f"(connection {self.settings.kafka_config_id!r}): {exc}"
            ) from exc
        self._consumer = consumer
        return consumer

    # -- rebalances ----------------------------------------------------------------------------
    def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            # Commits happen eagerly in advance(); what is still in flight for this partition
            # belongs to the next owner now, and its late outcomes are ignored (epoch mismatch).
            self._lanes.pop(tp, None)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            self._lanes[tp] = Lane(epoch=next(_epochs))
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
        poll_ms = int(self.settings.poll_timeout * 1000)
        group_id = self.group_id
        max_payload_bytes = self.max_envelope_bytes
        oversize_policy = self.settings.oversize_policy
        while True:
            credit = await self._credit_or_keepalive(consumer)
            if credit == 0:
                continue
            self._enforce_full_assignment()
            fetched = await consumer.getmany(timeout_ms=poll_ms, max_records=min(credit, self.settings.max_batch_size))
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
                # Popped, not iterated: each ConsumerRecord is released as soon as its message is
                # built, instead of the whole batch living until its last message was yielded.
                # Fewer objects outlive a young-generation GC pass, so fewer full passes.
                records.reverse()
                while records:
                    record = records.pop()
                    offset = record.offset
                    attempt = lane.admit(offset)
                    if not attempt:
                        continue  # in flight or done: a replay after seek-back, not a new message
                    received += 1
                    headers = tuple(record.headers)  # already a tuple: no copy
                    key = record.key
                    timestamp = record.timestamp
                    envelope, forced = build_envelope(
                        broker="kafka",
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
                    yield message, message
            self.counters.add("received", received)

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
                credit = await asyncio.wait_for(self.wait_for_credit(), timeout=self.settings.poll_timeout)
            except TimeoutError:
                if not self._paused:
                    consumer.pause(*consumer.assignment())
                    self._paused = True
                await consumer.getmany(timeout_ms=0)  # paused partitions return nothing
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
        if dead:
            await self._dead_letter(dead)
        replay_now = replay_later = False
        for entry in decided:
            delivery = entry.delivery
            if entry.disposition in (Disposition.COMMIT, Disposition.DEAD_LETTER):
                lane.settle(delivery.offset)
            elif entry.disposition is Disposition.HOLD:
                lane.hold(delivery.offset, attempts=delivery.delivery_attempt - 1)  # nobody saw it
                replay_later = True
            else:
                lane.hold(delivery.offset, attempts=delivery.delivery_attempt)
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
                d = entry.delivery
                self.log.error(
                    "Dead-lettering %s/%d/%d without a dlq_topic: committed past; the record stays in the "
                    "source topic until retention. Reason: %s",
                    d.tp.topic,
                    d.tp.partition,
                    d.offset,
                    entry.decision.reason,
                )
            return
        producer = await self._dlq_producer()
        sends = []
        for entry in entries:
            d = entry.delivery
            headers = [
                *d.headers,
                ("x-dead-letter-reason", entry.decision.reason.encode()),
                ("x-dead-letter-source", f"{d.tp.topic}/{d.tp.partition}/{d.offset}".encode()),
                ("x-dead-letter-attempts", str(d.delivery_attempt).encode()),
                ("x-dead-letter-group", self.group_id.encode()),
            ]
            sends.append(await producer.send(topic, value=d.value, key=d.key, headers=headers))
        self.counters.api_calls += len(sends)
        # Every record acknowledged by the broker (acks=all) before any offset is marked done.
        await asyncio.gather(*sends)

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
