"""
The brokers the demo (``python -m devkit.demo --broker kafka|sqs|pubsub|redis|servicebus``) can run on, behind one
shape: each registry broker whose ``harness.demo`` names its :class:`DemoStream`.

A :class:`DemoStream` is a thin layer over its broker's test kit (``devkit.kits``): it starts the
kit's local broker, creates the source and dead-letter destinations,
names the example Dag files, watchers and Dags of its broker, publishes the scenario's orders and
reports progress as *settled* messages (Kafka: committed offsets; SQS: messages deleted from the
queue; Pub/Sub: messages acknowledged) and dead-lettered ones. Everything is read back through an
independent client, never through the provider.

:class:`SqsOrders` (``devkit.kits.sqs``) is also the end-to-end test's view of the queue pair
(``tests/e2e``); this module re-exports the Kafka, SQS and Pub/Sub kit streams and constants under
their old names.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Mapping, Sequence, Sized
from typing import Any, Final, Generic, Protocol, TypeVar

from airflow_shared_stream_provider.brokers import HarnessTable
from devkit.demo_types import (
    DLQ_TOPIC,
    GROUP_ID,
    PARTITIONS,
    TOPIC,
    WATCHERS,
    BrokerRestart,
    OrderMessage,
    Settlement,
    example_dag_files,
)
from devkit.kits import BrokerKit, paced_chunks
from devkit.kits.kafka import KafkaKit, KafkaOrders, Published, kafka_connection
from devkit.kits.pubsub import PUBSUB_CONN_ID, PUBSUB_PROJECT, PubSubKit, PubSubOrders
from devkit.kits.sqs import (
    DEAD_LETTER_MESSAGE_ID,
    DEAD_LETTER_REASON,
    MOTO_KEY,
    SQS_CONN_ID,
    SQS_DLQ,
    SQS_QUEUE,
    SQS_REGION,
    SqsKit,
    SqsOrders,
)

__all__ = [
    "DEAD_LETTER_MESSAGE_ID",
    "DEAD_LETTER_REASON",
    "MOTO_KEY",
    "PUBSUB_CONN_ID",
    "PUBSUB_PROJECT",
    "SQS_CONN_ID",
    "SQS_DLQ",
    "SQS_QUEUE",
    "SQS_REGION",
    "STREAMS",
    "DemoStream",
    "KafkaDemoStream",
    "KafkaOrders",
    "PubSubDemoStream",
    "PubSubOrders",
    "Published",
    "SqsDemoStream",
    "SqsOrders",
    "kafka_connection",
    "paced_chunks",
]


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
    source_label: str
    dlq_label: str

    def __init__(self) -> None:
        self.kit: BrokerKit | None = None
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
    def dag_files(self) -> tuple[str, ...]:
        """The Dag files the demo copies: the broker's example Dag and what it imports."""
        return example_dag_files(self.broker)

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

    def stop(self) -> None:
        if self.kit is not None:
            self.kit.stop()
            self.kit = None

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
    source_label = f"topic {TOPIC} ({PARTITIONS} partitions)"
    dlq_label = f"topic {DLQ_TOPIC}"
    # Tansu's storage: memory, or S3 on a moto server of the kit's own (DEVKIT_KAFKA_STORAGE=s3,
    # bench.production --kafka-storage s3), where a restart keeps topics, records and committed
    # offsets. ListOffsets lags the records there: the kit reads end offsets by reading past them.
    storage_env: Final = "DEVKIT_KAFKA_STORAGE"

    def __init__(self) -> None:
        super().__init__()
        self.kafka: KafkaKit | None = None

    def start(self) -> str:
        kit = self.kit = self.kafka = KafkaKit(storage=os.environ.get(self.storage_env) or "memory")
        kit.start()
        self._orders = kit.stream(TOPIC, dlq_topic=DLQ_TOPIC, group_id=GROUP_ID, partitions=PARTITIONS)
        return (
            f"Kafka-compatible broker (Tansu, {kit.storage_label}) {kit.bootstrap}; topics {TOPIC} "
            f"({PARTITIONS} partitions) and {DLQ_TOPIC} created"
        )

    def stop(self) -> None:
        super().stop()
        self.kafka = None

    def restart_unsupported(self) -> str | None:
        if self.kafka is None:
            return "the kafka demo stream is not started"
        if self.kafka.process is None:
            return "an external Kafka (KAFKA_BOOTSTRAP_SERVERS) is not this run's to restart"
        if not self.kafka.restartable:
            return (
                f"Tansu runs on its memory engine (restartable with {self.storage_env}=s3 or "
                "--kafka-storage s3: S3 storage on a local moto server)"
            )
        return None

    def restart_keeping_data(self, down_seconds: float = 0.0) -> BrokerRestart:
        reason = self.restart_unsupported()
        if reason is not None:
            raise NotImplementedError(reason)
        assert self.kafka is not None
        return self.kafka.restart_keeping_data(down_seconds, lock=self.orders.server_lock)

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


class SqsDemoStream(DemoStream[SqsOrders]):
    broker = "sqs"
    source_label = f"queue {SQS_QUEUE}"
    dlq_label = f"queue {SQS_DLQ}"
    memory_only_reason = "moto keeps its state in memory (a new server starts empty)"

    def start(self) -> str:
        kit = self.kit = SqsKit()
        kit.start()
        self._orders = kit.stream(SQS_QUEUE, dlq=SQS_DLQ)
        return f"SQS endpoint (moto server) {kit.endpoint}; queues {SQS_QUEUE} and {SQS_DLQ} created"

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


class PubSubDemoStream(DemoStream[PubSubOrders]):
    broker = "pubsub"
    source_label = "subscription orders-airflow of topic orders"
    dlq_label = "topic orders-dlq"
    memory_only_reason = "the Pub/Sub emulator keeps its state in memory"

    def start(self) -> str:
        # The kit sets PUBSUB_EMULATOR_HOST: Google's clients (ours here, the provider's in the
        # triggerer) find the emulator by it.
        kit = self.kit = PubSubKit(project=PUBSUB_PROJECT)
        kit.start()
        self._orders = kit.stream("orders")
        return (
            f"Pub/Sub emulator {kit.address}; topic orders, subscription orders-airflow and "
            "dead-letter topic orders-dlq created"
        )

    def connections(self) -> dict[str, Any]:
        assert self.kit is not None
        return {PUBSUB_CONN_ID: self.kit.connection()}

    def dag_env(self) -> dict[str, str]:
        assert self.kit is not None
        return {
            **self.kit.env(),
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
