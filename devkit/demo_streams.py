"""
The brokers the demo (``python -m devkit.demo --broker kafka|sqs|pubsub|redis|servicebus``) can run on, behind one
shape: each registry broker whose ``harness.demo`` names its :class:`DemoStream`.

A :class:`DemoStream` starts its local broker, creates the source and dead-letter destinations,
names the example Dag files, watchers and Dags of its broker, publishes the scenario's orders and
reports progress as *settled* messages (Kafka: committed offsets; SQS: messages deleted from the
queue; Pub/Sub: messages acknowledged) and dead-lettered ones. Everything is read back through an
independent client, never through the provider.

:class:`SqsOrders` is also the end-to-end test's view of the queue pair (``tests/e2e``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

from airflow_shared_stream_provider.brokers import HarnessTable
from devkit.brokers import BrokerProcess, start_kafka, start_moto, start_pubsub_emulator, stop_moto
from devkit.demo_types import (
    DLQ_TOPIC,
    GROUP_ID,
    KAFKA_DAG_FILES,
    PARTITIONS,
    TOPIC,
    WATCHERS,
    BrokerRestart,
    OrderMessage,
    Settlement,
)

PUBSUB_PROJECT: Final = "shared-stream-demo"
PUBSUB_CONN_ID: Final = "google_cloud_default"
SQS_REGION: Final = "us-east-1"
SQS_QUEUE: Final = "orders"
SQS_DLQ: Final = "orders-dlq"
SQS_CONN_ID: Final = "aws_default"
MOTO_KEY: Final = "testing"  # moto accepts any credentials: this key id and secret everywhere
DEAD_LETTER_REASON: Final = "x-dead-letter-reason"
DEAD_LETTER_MESSAGE_ID: Final = "x-dead-letter-message-id"


def paced_chunks(
    messages: Sequence[OrderMessage], *, size: int, rate: float | None, stop: threading.Event | None
) -> Iterator[Sequence[OrderMessage]]:
    """
    ``messages`` in order, in chunks of ``size`` (one at a time when ``rate`` paces them: message i
    is due ``i / rate`` seconds after the start); ends early once ``stop`` is set.
    """
    if rate:
        size = 1
    started = time.monotonic()
    for start in range(0, len(messages), size):
        if stop is not None and stop.is_set():
            return
        if rate:
            delay = started + start / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        yield messages[start : start + size]


@dataclass
class Published:
    message: OrderMessage
    partition: int
    offset: int

    @property
    def message_id(self) -> str:
        return f"{TOPIC}/{self.partition}/{self.offset}"


@dataclass
class KafkaOrders:
    """Topic admin, publishing and offset inspection for the ``orders`` stream (aiokafka)."""

    bootstrap: str
    topic: str = TOPIC
    dlq_topic: str = DLQ_TOPIC
    group_id: str = GROUP_ID
    published: list[Published] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create_topics(self, partitions: int = PARTITIONS) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        async def create() -> None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                existing = set(await admin.list_topics())
                wanted = [
                    NewTopic(name, count, 1)
                    for name, count in ((self.topic, partitions), (self.dlq_topic, 1))
                    if name not in existing
                ]
                if wanted:
                    await admin.create_topics(wanted)
            finally:
                await admin.close()

        asyncio.run(create())

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> list[Published]:
        """Publish in order (acks=all), at most ``rate`` messages per second; return their coordinates."""
        from aiokafka import AIOKafkaProducer

        async def send() -> list[Published]:
            producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", max_request_size=4 * 1024 * 1024)
            await producer.start()
            out: list[Published] = []
            started = time.monotonic()
            try:
                for index, message in enumerate(messages):
                    if stop is not None and stop.is_set():
                        break
                    if rate:
                        delay = started + index / rate - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)
                    meta = await producer.send_and_wait(self.topic, message.value, key=message.key)
                    record = Published(message, meta.partition, meta.offset)
                    out.append(record)
                    with self._lock:
                        self.published.append(record)
            finally:
                await producer.stop()
            return out

        return asyncio.run(send())

    def end_offsets(self) -> dict[int, int]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def read() -> dict[int, int]:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap)
            await consumer.start()
            try:
                partitions = sorted(consumer.partitions_for_topic(self.topic) or range(PARTITIONS))
                ends = await consumer.end_offsets([TopicPartition(self.topic, p) for p in partitions])
                return {tp.partition: int(offset) for tp, offset in ends.items()}
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
                partitions = sorted(consumer.partitions_for_topic(self.topic) or range(PARTITIONS))
                out: dict[int, int] = {}
                for partition in partitions:
                    offset = await consumer.committed(TopicPartition(self.topic, partition))
                    if offset is not None and offset >= 0:
                        out[partition] = int(offset)
                return out
            finally:
                await consumer.stop()

        return asyncio.run(read())

    def dlq_records(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every record of the DLQ topic: key, value and headers."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def read() -> list[dict[str, Any]]:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
            await consumer.start()
            records: list[dict[str, Any]] = []
            try:
                partitions = [
                    TopicPartition(self.dlq_topic, p)
                    for p in sorted(consumer.partitions_for_topic(self.dlq_topic) or {0})
                ]
                consumer.assign(partitions)
                await consumer.seek_to_beginning(*partitions)
                ends = await consumer.end_offsets(partitions)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    positions = [await consumer.position(tp) for tp in partitions]
                    if all(pos >= ends[tp] for pos, tp in zip(positions, partitions, strict=True)):
                        break
                    batch = await consumer.getmany(*partitions, timeout_ms=500)
                    for tp_records in batch.values():
                        for record in tp_records:
                            records.append(
                                {
                                    "key": record.key,
                                    "value": record.value,
                                    "headers": {k: v.decode("utf-8", "replace") for k, v in record.headers},
                                }
                            )
            finally:
                await consumer.stop()
            return records

        return asyncio.run(read())


def kafka_connection(bootstrap: str) -> dict[str, Any]:
    return {"conn_type": "kafka", "extra": {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}}


class _Orders(Protocol):
    """What the demo needs of a broker's order client (:class:`KafkaOrders`, :class:`SqsOrders`)."""

    @property
    def published(self) -> Sized: ...

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> Any: ...


OrdersT = TypeVar("OrdersT", bound=_Orders)


class DemoStream(abc.ABC, Generic[OrdersT]):
    """One broker's side of the demo: the local broker, its example Dags and its progress."""

    broker: str
    dag_files: tuple[str, ...]
    source_label: str
    dlq_label: str

    def __init__(self) -> None:
        self._process: BrokerProcess | None = None
        self._orders: OrdersT | None = None

    @property
    def orders(self) -> OrdersT:
        if self._orders is None:
            raise RuntimeError(f"the {self.broker} demo stream is not started")
        return self._orders

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Publish in order, at most ``rate`` per second, until done or ``stop`` is set."""
        self.orders.publish(messages, rate=rate, stop=stop)

    @property
    def published(self) -> int:
        return len(self.orders.published)

    @property
    def watchers(self) -> tuple[str, ...]:
        """The example watchers (asset name == watcher name), in display order."""
        return tuple(name.replace("kafka_", f"{self.broker}_", 1) for name in WATCHERS)

    @property
    def consumer_dags(self) -> tuple[str, ...]:
        *plain, _valid = self.watchers
        return (*(f"{name}_consumer" for name in plain), self.spark_dag)

    @property
    def spark_dag(self) -> str:
        return f"{self.broker}_orders_spark_pipeline"

    def watcher_name(self, kafka_name: str) -> str:
        """The scenario's expectations name the Kafka watchers; this broker's watcher of the same role."""
        return kafka_name.replace("kafka_", f"{self.broker}_", 1)

    @abc.abstractmethod
    def start(self) -> str:
        """Start the broker, create source and DLQ; return a line describing them."""

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def connections(self) -> dict[str, Any]:
        """Airflow connections the example Dags need (besides Spark's)."""

    @abc.abstractmethod
    def dag_env(self) -> dict[str, str]:
        """Environment the example Dag file reads."""

    @abc.abstractmethod
    def settlement(self) -> Settlement: ...

    @abc.abstractmethod
    def dead_lettered(self) -> int: ...

    # -- a restart with the data kept (bench/production.py's restart-broker) -------------------
    # Why the local broker cannot stop and start again with its data; overridden where it can.
    memory_only_reason: str = "its local broker keeps its state in memory"

    def restart_unsupported(self) -> str | None:
        """Why :meth:`restart_keeping_data` cannot run here (None: it can)."""
        return self.memory_only_reason

    def restart_keeping_data(self, down_seconds: float = 0.0) -> BrokerRestart:
        """
        Stop the local broker gracefully (its data kept), wait ``down_seconds``, start it again on
        the same address. Raises ``NotImplementedError`` (with :meth:`restart_unsupported`'s
        reason) where the broker would come back empty: a restart that loses the data is another
        fault, never done in its place.
        """
        raise NotImplementedError(self.restart_unsupported() or f"{self.broker}: no restart implemented")


class KafkaDemoStream(DemoStream[KafkaOrders]):
    broker = "kafka"
    dag_files = KAFKA_DAG_FILES
    source_label = f"topic {TOPIC} ({PARTITIONS} partitions)"
    dlq_label = f"topic {DLQ_TOPIC}"
    # This Tansu build's only persistent engine is s3:// (sqlite:// and postgres:// answer
    # FeatureNotEnabled). On it (moto as the object store) topics, records and committed offsets
    # survive a restart, but ListOffsets answers from a watermark that lags the records (measured:
    # end offset 1 of a partition holding 4), and this stream's settlement and DLQ read go up to
    # the end offsets. So the demo keeps the memory engine, and a restart would come back empty.
    memory_only_reason = (
        "Tansu runs on its memory engine here; this build persists only to s3://, where ListOffsets "
        "lags the records (the settlement and DLQ checks read end offsets)"
    )

    def start(self) -> str:
        self._process = start_kafka()
        self._orders = KafkaOrders(self._process.address)
        self._orders.create_topics()
        return (
            f"Kafka-compatible broker (Tansu) {self._process.address}; topics {TOPIC} ({PARTITIONS} partitions) "
            f"and {DLQ_TOPIC} created"
        )

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def connections(self) -> dict[str, Any]:
        return {"kafka_default": kafka_connection(self.orders.bootstrap)}

    def dag_env(self) -> dict[str, str]:
        return {}

    def settlement(self) -> Settlement:
        committed = self.orders.committed()
        ends = self.orders.end_offsets()
        detail = ", ".join(f"p{p}={committed.get(p, '-')}/{end}" for p, end in sorted(ends.items()))
        settled = sum(min(committed.get(p, 0), end) for p, end in ends.items())
        return Settlement(settled, sum(ends.values()), f"committed offsets {detail} (group {GROUP_ID})")

    def dead_lettered(self) -> int:
        return len(self.orders.dlq_records(timeout=2.0))


@dataclass
class SqsOrders:
    """The ``orders`` / ``orders-dlq`` queue pair on an SQS endpoint, read and written with boto3."""

    endpoint: str
    client: Any = field(init=False)
    queue_url: str = field(init=False)
    dlq_url: str = field(init=False)
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)
    dead: dict[str, str] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        import boto3

        credentials = {"aws_access_key_id": MOTO_KEY, "aws_secret_access_key": MOTO_KEY}
        self.client = boto3.client("sqs", region_name=SQS_REGION, endpoint_url=self.endpoint, **credentials)
        self.queue_url = str(self.client.create_queue(QueueName=SQS_QUEUE)["QueueUrl"])
        self.dlq_url = str(self.client.create_queue(QueueName=SQS_DLQ)["QueueUrl"])

    def airflow_connection(self) -> dict[str, Any]:
        """The Airflow ``aws`` connection that reaches this endpoint (moto takes any credentials)."""
        return {
            "conn_type": "aws",
            "login": MOTO_KEY,
            "password": MOTO_KEY,
            "extra": {"endpoint_url": self.endpoint, "region_name": SQS_REGION},
        }

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> dict[str, OrderMessage]:
        """
        Send in order, in batches of up to 10 (one message at a time when ``rate`` paces them);
        return ``MessageId -> message`` (the envelope's ``message_id``).
        """
        sent: dict[str, OrderMessage] = {}
        for chunk in paced_chunks(messages, size=10, rate=rate, stop=stop):
            entries = [{"Id": str(i), "MessageBody": m.value.decode("utf-8")} for i, m in enumerate(chunk)]
            response = self.client.send_message_batch(QueueUrl=self.queue_url, Entries=entries)
            if response.get("Failed"):
                raise RuntimeError(f"SQS refused messages: {response['Failed']}")
            batch = {str(ok["MessageId"]): chunk[int(ok["Id"])] for ok in response["Successful"]}
            sent.update(batch)
            with self._lock:
                self.published.update(batch)
        return sent

    def backlog(self, queue_url: str) -> int:
        """Visible + in-flight messages of a queue."""
        attributes = self.client.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])

    def dead_letters(self) -> dict[str, str]:
        """``source MessageId -> x-dead-letter-reason``, accumulated over every read of the DLQ queue."""
        while True:
            response = self.client.receive_message(
                QueueUrl=self.dlq_url,
                MaxNumberOfMessages=10,
                MessageAttributeNames=["All"],
                VisibilityTimeout=600,
                WaitTimeSeconds=0,
            )
            batch = response.get("Messages", [])
            if not batch:
                return dict(self.dead)
            for message in batch:
                attributes = message.get("MessageAttributes", {})
                source = attributes.get(DEAD_LETTER_MESSAGE_ID, {}).get("StringValue")
                reason = attributes.get(DEAD_LETTER_REASON, {}).get("StringValue", "")
                self.dead[str(source)] = str(reason)


class SqsDemoStream(DemoStream[SqsOrders]):
    broker = "sqs"
    dag_files = ("example_sqs_orders.py", "order_filters.py", "order_events.py", "orders_spark.py")
    source_label = f"queue {SQS_QUEUE}"
    dlq_label = f"queue {SQS_DLQ}"
    memory_only_reason = "moto keeps its state in memory (a new server starts empty)"

    def start(self) -> str:
        # moto's HTTP server logs every request through werkzeug: noise in the progress display.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._process = start_moto()
        self._orders = SqsOrders(self._process.address)
        return f"SQS endpoint (moto server) {self._process.address}; queues {SQS_QUEUE} and {SQS_DLQ} created"

    def stop(self) -> None:
        if self._process is not None:
            stop_moto(self._process)
            self._process = None

    def connections(self) -> dict[str, Any]:
        return {SQS_CONN_ID: self.orders.airflow_connection()}

    def dag_env(self) -> dict[str, str]:
        return {
            "ORDERS_SQS_QUEUE_URL": self.orders.queue_url,
            "ORDERS_SQS_DLQ_URL": self.orders.dlq_url,
            "ORDERS_AWS_CONN_ID": SQS_CONN_ID,
        }

    def settlement(self) -> Settlement:
        # A message leaves the queue only when deleted (every watcher's events stored) or moved to
        # the DLQ queue; what is still there is waiting, in flight or to be redelivered.
        backlog = self.orders.backlog(self.orders.queue_url)
        published = self.published
        return Settlement(max(0, published - backlog), published, f"{backlog} still in queue {SQS_QUEUE}")

    def dead_lettered(self) -> int:
        return self.orders.backlog(self.orders.dlq_url)


class PubSubOrders:
    """
    The ``orders`` topic, its watched subscription and the dead-letter topic on a Pub/Sub endpoint
    (the emulator: ``PUBSUB_EMULATOR_HOST`` must be set before this is built).

    How :meth:`unacked` counts without touching the watched subscription: a *probe* subscription
    on the same topic, created before anything is published, is sought to a snapshot of the
    watched one (a snapshot holds exactly its unacknowledged messages, leased ones included) and
    pulled dry. The watched subscription is never pulled, so counting neither steals messages from
    the triggerer nor bumps their delivery attempts.
    """

    def __init__(self, project: str = PUBSUB_PROJECT) -> None:
        from google.pubsub_v1 import PublisherClient, SubscriberClient

        self.publisher = PublisherClient()
        self.subscriber = SubscriberClient()
        self.topic = f"projects/{project}/topics/orders"
        self.subscription = f"projects/{project}/subscriptions/orders-airflow"
        self.probe = f"projects/{project}/subscriptions/orders-probe"
        self.dlq_topic = f"projects/{project}/topics/orders-dlq"
        self.dlq_subscription = f"projects/{project}/subscriptions/orders-dlq-reader"
        self._snapshot_base = f"projects/{project}/snapshots/orders"
        self._snapshots = 0
        self.published: list[str] = []
        self.dead: dict[str, str] = {}
        self._lock = threading.Lock()
        for topic in (self.topic, self.dlq_topic):
            self.publisher.create_topic(request={"name": topic})
        for name, topic, deadline in (
            (self.subscription, self.topic, 30),
            (self.probe, self.topic, 600),
            (self.dlq_subscription, self.dlq_topic, 600),
        ):
            self.subscriber.create_subscription(
                request={"name": name, "topic": topic, "ack_deadline_seconds": deadline}
            )

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> list[str]:
        """Publish in order (one request per message when ``rate`` paces them); return the message ids."""
        ids: list[str] = []
        for messages_chunk in paced_chunks(messages, size=500, rate=rate, stop=stop):
            chunk = [{"data": m.value} for m in messages_chunk]
            response = self.publisher.publish(request={"topic": self.topic, "messages": chunk}, timeout=30)
            ids.extend(response.message_ids)
            with self._lock:
                self.published.extend(response.message_ids)
        return ids

    def _pull_all(self, subscription: str) -> list[Any]:
        from google.api_core import exceptions as gexc

        received: list[Any] = []
        while True:
            try:
                response = self.subscriber.pull(
                    request={"subscription": subscription, "max_messages": 1000}, timeout=0.5
                )
            except gexc.DeadlineExceeded:
                return received
            if not response.received_messages:
                return received
            received.extend(response.received_messages)

    def unacked(self) -> int:
        """Unacknowledged messages of the watched subscription (see the class doc)."""
        self._snapshots += 1
        snapshot = f"{self._snapshot_base}-{self._snapshots}"
        self.subscriber.create_snapshot(request={"name": snapshot, "subscription": self.subscription})
        try:
            self.subscriber.seek(request={"subscription": self.probe, "snapshot": snapshot})
        finally:
            self.subscriber.delete_snapshot(request={"snapshot": snapshot})
        # The probe's messages stay unacked (its deadline is long): the next seek resets it anyway.
        return len({r.message.message_id for r in self._pull_all(self.probe)})

    def dead_letters(self) -> dict[str, str]:
        """``source message id -> x-dead-letter-reason``, accumulated over every read of the DLQ."""
        received = self._pull_all(self.dlq_subscription)
        for r in received:
            attributes = dict(r.message.attributes)
            self.dead[attributes.get(DEAD_LETTER_MESSAGE_ID, r.message.message_id)] = attributes.get(
                DEAD_LETTER_REASON, ""
            )
        if received:
            self.subscriber.acknowledge(
                request={"subscription": self.dlq_subscription, "ack_ids": [r.ack_id for r in received]}
            )
        return dict(self.dead)


class PubSubDemoStream(DemoStream[PubSubOrders]):
    broker = "pubsub"
    dag_files = ("example_pubsub_orders.py", "order_filters.py", "order_events.py", "orders_spark.py")
    source_label = "subscription orders-airflow of topic orders"
    dlq_label = "topic orders-dlq"
    memory_only_reason = "the Pub/Sub emulator keeps its state in memory"

    def start(self) -> str:
        self._process = start_pubsub_emulator()
        # Google's clients (ours here, the provider's in the triggerer) find the emulator by this.
        os.environ["PUBSUB_EMULATOR_HOST"] = self._process.address
        self._orders = PubSubOrders()
        return (
            f"Pub/Sub emulator {self._process.address}; topic orders, subscription orders-airflow and "
            "dead-letter topic orders-dlq created"
        )

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def connections(self) -> dict[str, Any]:
        return {PUBSUB_CONN_ID: {"conn_type": "google_cloud_platform", "extra": {"project": PUBSUB_PROJECT}}}

    def dag_env(self) -> dict[str, str]:
        assert self._process is not None
        return {
            "PUBSUB_EMULATOR_HOST": self._process.address,
            "ORDERS_PUBSUB_SUBSCRIPTION": self.orders.subscription,
            "ORDERS_PUBSUB_DLQ_TOPIC": self.orders.dlq_topic,
            "ORDERS_GCP_CONN_ID": PUBSUB_CONN_ID,
        }

    def settlement(self) -> Settlement:
        # A message stops being unacked only when acked (every watcher's events stored, or
        # published to the dead-letter topic first).
        unacked = self.orders.unacked()
        published = self.published
        return Settlement(max(0, published - unacked), published, f"{unacked} unacked in orders-airflow")

    def dead_lettered(self) -> int:
        return len(self.orders.dead_letters())


# name -> DemoStream of every registry broker with a demo (harness.demo in
# airflow_shared_stream_provider/brokers.py), loaded on lookup: a new broker's may live in its own module.
STREAMS: Final[Mapping[str, type[DemoStream[Any]]]] = HarnessTable("demo")
