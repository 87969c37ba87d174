"""
Kafka integration fixtures: Tansu on a free loopback port, or KAFKA_BOOTSTRAP_SERVERS (the Kafka
kit's, ``devkit.kits.kafka.KafkaKit``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
from aiokafka import AIOKafkaProducer

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from devkit.kits.kafka import KafkaKit, KafkaOrders, kafka_connection
from tests.integration.contract import KitAdapter


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """A real Kafka-protocol broker: the env var's, or Tansu started here (never skipped)."""
    # own=False: KAFKA_BOOTSTRAP_SERVERS, where set, names the broker (the kit starts none then).
    with KafkaKit(own=False) as kit:
        yield kit.bootstrap


def kafka_it_connection(bootstrap: str) -> dict[str, Any]:
    """The kit's ``kafka`` connection, with a short session timeout (a stopped watcher's partitions move on soon)."""
    connection = kafka_connection(bootstrap)
    connection["extra"]["session.timeout.ms"] = 10000
    return connection


@pytest.fixture
def kafka_conn(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> str:
    conn_id = "kafka_it"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(kafka_it_connection(kafka_bootstrap)))
    return conn_id


class KafkaAdapter(KitAdapter[KafkaOrders, KafkaSharedStreamTrigger]):
    """
    BrokerAdapter for the contract suite over the kit's stream: a fresh topic, DLQ topic and group
    per test. Topics, offsets and dead letters are the kit's; publishing stays here (partitions,
    keys, headers and tombstones are Kafka-only tests' own).
    """

    broker = "kafka"
    trigger_class = KafkaSharedStreamTrigger
    quick: ClassVar[dict[str, Any]] = {"poll_timeout": 0.2, "partial_assignment_grace": 5.0}

    def __init__(self, bootstrap: str, conn_id: str, partitions: int = 3) -> None:
        suffix = uuid.uuid4().hex[:8]
        topic = f"orders-{suffix}"
        orders = KafkaOrders(
            bootstrap, topic=topic, dlq_topic=f"{topic}.dlq", group_id=f"group-{suffix}", partitions=partitions
        )
        super().__init__(orders, conn_id)
        self.bootstrap = bootstrap
        self.topic = orders.topic
        self.dlq_topic = orders.dlq_topic
        self.partitions = partitions
        self.published = 0

    @property
    def group_id(self) -> str:
        """The group the triggers commit in and :meth:`committed` reads (the kit's: a test may point both elsewhere)."""
        return self.kit.group_id

    @group_id.setter
    def group_id(self, group_id: str) -> None:
        self.kit.group_id = group_id

    async def create_topics(self) -> None:
        """The topic (``partitions`` partitions) and its DLQ topic (one partition)."""
        await self.in_thread(self.kit.create_topics)

    def trigger_options(self) -> dict[str, Any]:
        return {"kafka_config_id": self.conn_id, "group_id": self.group_id, "dlq_topic": self.dlq_topic}

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
        return await self.in_thread(self.kit.end_offsets)

    async def committed(self) -> dict[int, int]:
        """The group's committed offset of every partition (0 where it has none)."""
        committed = await self.in_thread(self.kit.committed)
        return {p: committed.get(p, 0) for p in range(self.partitions)}

    async def dead_letter_records(self) -> list[Any]:
        """Every record of the DLQ topic (aiokafka's ``ConsumerRecord``), read to its end offsets."""
        return await self.in_thread(self.kit.dlq_raw_records, None)

    async def dead_lettered(self) -> list[bytes]:
        return [r.value for r in await self.dead_letter_records()]


@pytest.fixture
async def adapter(kafka_bootstrap: str, kafka_conn: str) -> AsyncIterator[KafkaAdapter]:
    kafka_adapter = KafkaAdapter(kafka_bootstrap, kafka_conn)
    await kafka_adapter.create_topics()
    yield kafka_adapter
