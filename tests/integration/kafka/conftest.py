"""Kafka integration fixtures: Tansu on a free loopback port, or KAFKA_BOOTSTRAP_SERVERS."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from devkit.brokers import start_kafka


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """A real Kafka-protocol broker: the env var's, or Tansu started here (never skipped)."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    broker = start_kafka()
    try:
        yield broker.address
    finally:
        broker.stop()


@pytest.fixture
def kafka_conn(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> str:
    conn_id = "kafka_it"
    extra = {"bootstrap.servers": kafka_bootstrap, "auto.offset.reset": "earliest", "session.timeout.ms": 10000}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "kafka", "extra": extra}))
    return conn_id


async def create_topics(bootstrap: str, *topics: str, partitions: int = 3) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics])
    finally:
        await admin.close()


class KafkaAdapter:
    """BrokerAdapter for the contract suite: a fresh topic, DLQ topic and group per test."""

    broker = "kafka"

    def __init__(self, bootstrap: str, conn_id: str, partitions: int = 3) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.bootstrap = bootstrap
        self.conn_id = conn_id
        self.topic = f"orders-{suffix}"
        self.dlq_topic = f"orders-{suffix}.dlq"
        self.group_id = f"group-{suffix}"
        self.partitions = partitions
        self.published = 0

    def make_trigger(self, **kwargs: Any) -> KafkaSharedStreamTrigger:
        options: dict[str, Any] = {
            "topics": [self.topic],
            "kafka_config_id": self.conn_id,
            "group_id": self.group_id,
            "dlq_topic": self.dlq_topic,
            "poll_timeout": 0.2,
            "partial_assignment_grace": 5.0,
        }
        options.update(kwargs)
        return KafkaSharedStreamTrigger(**options)

    async def publish(
        self,
        bodies: Sequence[bytes | None],
        *,
        attributes: Mapping[str, str] | None = None,
        partition: int | None = None,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes | None]] | None = None,
    ) -> None:
        """Records get ``key`` and headers (``attributes`` UTF-8, then raw ``headers``); a None body is a tombstone."""
        record_headers: list[tuple[str, bytes | None]] = [(k, v.encode()) for k, v in (attributes or {}).items()]
        record_headers.extend(headers or ())
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
        await producer.start()
        try:
            for i, body in enumerate(bodies):
                target = partition if partition is not None else (self.published + i) % self.partitions
                await producer.send_and_wait(
                    self.topic, body, key=key, partition=target, headers=record_headers or None
                )
        finally:
            await producer.stop()
        self.published += len(bodies)

    async def end_offsets(self) -> dict[int, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in range(self.partitions)]
            ends = await consumer.end_offsets(tps)
            return {tp.partition: offset for tp, offset in ends.items()}
        finally:
            await consumer.stop()

    async def committed(self) -> dict[int, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id, enable_auto_commit=False)
        await consumer.start()
        try:
            out = {}
            for p in range(self.partitions):
                out[p] = await consumer.committed(TopicPartition(self.topic, p)) or 0
            return out
        finally:
            await consumer.stop()

    async def unsettled(self) -> int:
        ends = await self.end_offsets()
        committed = await self.committed()
        return sum(ends[p] - committed.get(p, 0) for p in ends)

    async def dead_letter_records(self) -> list[Any]:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            partitions = consumer.partitions_for_topic(self.dlq_topic)
            if not partitions:
                await consumer._client.force_metadata_update()
                partitions = consumer.partitions_for_topic(self.dlq_topic) or set()
            tps = [TopicPartition(self.dlq_topic, p) for p in partitions]
            if not tps:
                return []
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            records: list[Any] = []
            while True:
                positions = {tp: await consumer.position(tp) for tp in tps}
                if all(positions[tp] >= ends[tp] for tp in tps):
                    break
                batch = await consumer.getmany(timeout_ms=500)
                for recs in batch.values():
                    records.extend(recs)
            return records
        finally:
            await consumer.stop()

    async def dead_lettered(self) -> list[bytes]:
        return [r.value for r in await self.dead_letter_records()]


@pytest.fixture
async def adapter(kafka_bootstrap: str, kafka_conn: str) -> AsyncIterator[KafkaAdapter]:
    kafka_adapter = KafkaAdapter(kafka_bootstrap, kafka_conn)
    await create_topics(kafka_bootstrap, kafka_adapter.topic, partitions=3)
    await create_topics(kafka_bootstrap, kafka_adapter.dlq_topic, partitions=1)
    yield kafka_adapter
