"""
One broker per test, for the e2e tests on the Dag ``dags/e2e_kill_loop_watchers.py`` (watchers
``kill_loop_w{index}`` on ONE shared stream of the broker ``KILL_LOOP_BROKER`` names).

``loop_broker(name)`` starts one (``kafka``: Tansu, ``sqs``: moto server, ``pubsub``: Google's
emulator, ``servicebus``: the wire-level test broker of ``tests/servicebus_broker``, in this
process) and gives its :class:`LoopBroker`: the Airflow connection (``CONN_ID``), the trigger's
source and arguments (``KILL_LOOP_TRIGGER_KWARGS``), extra environment for the Airflow components,
a publisher and what it accepted. The broker's class is its registry entry's ``harness.kill_loop``
(:mod:`airflow_shared_stream_provider.brokers`), so a new broker's can live in its own module.
:class:`Deliveries` reads what the watchers got from the metadata DB.

Used by ``test_kill_loop.py`` and ``test_queue_triggerers_e2e.py``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from order_events import envelopes_of  # example_dags (on sys.path: tests/e2e/conftest.py)

from airflow_shared_stream_provider.brokers import broker_spec, load
from devkit.airflow_env import AirflowEnv
from devkit.brokers import BrokerProcess, start_kafka, start_moto, start_pubsub_emulator, stop_moto
from devkit.demo_streams import (
    PUBSUB_PROJECT,
    KafkaOrders,
    PubSubOrders,
    SqsOrders,
    kafka_connection,
    paced_chunks,
)
from devkit.demo_types import OrderMessage

CONN_ID = "kill_loop"
KAFKA_TOPIC = "kill-loop"
SERVICEBUS_QUEUE = "kill-loop"


# -- the brokers ------------------------------------------------------------------------------------
class LoopBroker(abc.ABC):
    """One broker's side of a test: its source, the connection, a publisher and what it sent."""

    name: str
    source: str

    @abc.abstractmethod
    def connection(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def trigger_kwargs(self) -> dict[str, Any]:
        """
        The trigger's source and broker-specific arguments in the kill-loop Dag, JSON-safe (the Dag
        adds the connection, as the registry's ``conn_id_arg``, and each watcher's ``match``).
        """

    def component_env(self) -> dict[str, str]:
        return {}

    @abc.abstractmethod
    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        """Publish in order at ``rate`` per second until done or ``stop`` is set (runs in a thread)."""

    @abc.abstractmethod
    def published_ids(self) -> list[str]:
        """The envelope ``message_id`` of every message the broker accepted so far."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def unsettled(self) -> int:
        """Messages the broker still holds for the stream (not committed / deleted / acked / completed)."""

    def diagnostics(self) -> str:
        return ""


class KafkaLoop(LoopBroker):
    name = "kafka"
    source = KAFKA_TOPIC

    def __init__(self) -> None:
        self.process: BrokerProcess = start_kafka()
        self.orders = KafkaOrders(
            self.process.address,
            topic=KAFKA_TOPIC,
            dlq_topic=f"{KAFKA_TOPIC}.dlq",
            group_id=f"airflow-shared-stream.{CONN_ID}.{KAFKA_TOPIC}",
        )
        self.orders.create_topics()

    def connection(self) -> dict[str, Any]:
        return kafka_connection(self.orders.bootstrap)

    def trigger_kwargs(self) -> dict[str, Any]:
        return {"topics": [KAFKA_TOPIC], "dlq_topic": f"{KAFKA_TOPIC}.dlq"}

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        self.orders.publish(messages, rate=rate, stop=stop)

    def published_ids(self) -> list[str]:
        return [f"{KAFKA_TOPIC}/{p.partition}/{p.offset}" for p in list(self.orders.published)]

    def close(self) -> None:
        self.process.stop()

    def unsettled(self) -> int:
        committed = self.orders.committed()
        return sum(end - committed.get(partition, 0) for partition, end in self.orders.end_offsets().items())

    def diagnostics(self) -> str:
        committed = self.orders.committed()
        ends = self.orders.end_offsets()
        return f"committed {committed} / end offsets {ends}"


class _IdList:
    """Ids appended by the publisher thread, read by the test thread."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._lock = threading.Lock()

    def extend(self, ids: Sequence[str]) -> None:
        with self._lock:
            self._ids.extend(ids)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._ids)


class SqsLoop(LoopBroker):
    name = "sqs"

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
        self.handle = start_moto()
        self.orders = SqsOrders(self.handle.address)
        self.source = self.orders.queue_url
        self.ids = _IdList()

    def connection(self) -> dict[str, Any]:
        return self.orders.airflow_connection()

    def trigger_kwargs(self) -> dict[str, Any]:
        return {"queue_url": self.source, "wait_time_seconds": 2}

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        for chunk in paced_chunks(messages, size=1, rate=rate, stop=stop):
            self.ids.extend(list(self.orders.publish(chunk)))

    def published_ids(self) -> list[str]:
        return self.ids.snapshot()

    def close(self) -> None:
        stop_moto(self.handle)

    def unsettled(self) -> int:
        return self.orders.backlog(self.orders.queue_url)

    def diagnostics(self) -> str:
        return f"{self.orders.backlog(self.orders.queue_url)} message(s) still in the queue (visible or in flight)"


class PubSubLoop(LoopBroker):
    name = "pubsub"

    def __init__(self) -> None:
        self.process: BrokerProcess = start_pubsub_emulator()
        # Google's clients find the emulator through this variable, read when a client is built.
        self._env = pytest.MonkeyPatch()
        self._env.setenv("PUBSUB_EMULATOR_HOST", self.process.address)
        try:
            self.orders = PubSubOrders()
        except BaseException:
            self.close()
            raise
        self.source = self.orders.subscription
        self.ids = _IdList()

    def connection(self) -> dict[str, Any]:
        return {"conn_type": "google_cloud_platform", "extra": {"project": PUBSUB_PROJECT}}

    def trigger_kwargs(self) -> dict[str, Any]:
        return {"subscription": self.source}

    def component_env(self) -> dict[str, str]:
        return {"PUBSUB_EMULATOR_HOST": self.process.address}

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        for chunk in paced_chunks(messages, size=1, rate=rate, stop=stop):
            self.ids.extend(self.orders.publish(chunk))

    def published_ids(self) -> list[str]:
        return self.ids.snapshot()

    def close(self) -> None:
        self._env.undo()
        self.process.stop()

    def unsettled(self) -> int:
        return self.orders.unacked()

    def diagnostics(self) -> str:
        return f"{self.orders.unacked()} message(s) unacknowledged in {self.orders.subscription}"


class ServiceBusLoop(LoopBroker):
    name = "servicebus"
    source = SERVICEBUS_QUEUE

    def __init__(self) -> None:
        from tests.servicebus_broker.broker import start_broker

        self.handle = start_broker()
        # Service Bus' own defaults would be a 60 s lock and 10 deliveries; 30 s keeps the wait
        # for the locks of a killed triggerer's messages shorter.
        self.handle.create_queue(SERVICEBUS_QUEUE, lock_duration=30.0, max_delivery_count=10)
        self.ids = _IdList()

    def connection(self) -> dict[str, Any]:
        return {"conn_type": "azure_service_bus", "schema": self.handle.connection_string}

    def trigger_kwargs(self) -> dict[str, Any]:
        return {"queue_name": SERVICEBUS_QUEUE, "max_wait_time": 1.0}

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        from azure.servicebus import ServiceBusClient, ServiceBusMessage

        with (
            ServiceBusClient.from_connection_string(self.handle.connection_string) as client,
            client.get_queue_sender(SERVICEBUS_QUEUE) as sender,
        ):
            for chunk in paced_chunks(messages, size=1, rate=rate, stop=stop):
                ids = [message.key.decode() for message in chunk]
                sender.send_messages(
                    [ServiceBusMessage(m.value, message_id=i) for m, i in zip(chunk, ids, strict=True)]
                )
                self.ids.extend(ids)

    def published_ids(self) -> list[str]:
        return self.ids.snapshot()

    def close(self) -> None:
        self.handle.stop()

    def unsettled(self) -> int:
        counts = self.handle.counts(SERVICEBUS_QUEUE)
        return int(counts.active + counts.locked + counts.deferred)

    def diagnostics(self) -> str:
        counts = self.handle.counts(SERVICEBUS_QUEUE)
        errors = self.handle.errors
        text = f"queue {counts}; test broker recorded {len(errors)} error(s)"
        if errors:
            text += ": " + "; ".join(repr(error.error)[:200] for error in errors[:5])
        return text


def loop_broker_class(name: str) -> type[LoopBroker]:
    """The :class:`LoopBroker` of registry broker ``name`` (its ``harness.kill_loop``)."""
    path = broker_spec(name).harness.kill_loop
    if path is None:
        raise KeyError(f"broker {name!r} has no kill-loop harness (harness.kill_loop in its registry entry)")
    loaded = load(path)
    assert isinstance(loaded, type) and issubclass(loaded, LoopBroker), f"{path} is not a LoopBroker"
    return loaded


def dag_env(broker: LoopBroker, watchers: int) -> dict[str, str]:
    """The environment of ``dags/e2e_kill_loop_watchers.py``: ``watchers`` watchers on ``broker``'s stream."""
    return {
        "KILL_LOOP_BROKER": broker.name,
        "KILL_LOOP_WATCHERS": str(watchers),
        "KILL_LOOP_CONN_ID": CONN_ID,
        "KILL_LOOP_TRIGGER_KWARGS": json.dumps(broker.trigger_kwargs()),
        **broker.component_env(),
    }


@contextlib.contextmanager
def loop_broker(name: str) -> Iterator[LoopBroker]:
    broker = loop_broker_class(name)()
    try:
        yield broker
    finally:
        broker.close()


# -- what the watchers got ---------------------------------------------------------------------------
@dataclass
class Deliveries:
    """``(watcher, message_id) -> asset events``, read incrementally from the metadata DB."""

    env: AirflowEnv
    watchers: Sequence[str]  # the watchers (asset names) that should get every message
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    last_event_id: int = 0
    last_event_of: dict[str, int] = field(default_factory=dict)
    duplicate_event_ids: list[int] = field(default_factory=list)

    def refresh(self) -> Deliveries:
        rows = self.env.query_db(
            "SELECT e.id, a.name, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "WHERE e.id > ? ORDER BY e.id",
            (self.last_event_id,),
        )
        for event_id, name, extra in rows:
            watcher = str(name)
            decoded = json.loads(extra) if isinstance(extra, str) else extra
            for envelope in envelopes_of(decoded):
                key = (watcher, str(envelope["message_id"]))
                if self.counts[key]:
                    self.duplicate_event_ids.append(int(event_id))
                self.counts[key] += 1
            self.last_event_of[watcher] = int(event_id)
            self.last_event_id = int(event_id)
        return self

    def all_newer_than(self, event_id: int) -> bool:
        """Every watcher has an asset event stored after ``event_id``."""
        return all(self.last_event_of.get(watcher, 0) > event_id for watcher in self.watchers)

    def missing(self, message_ids: Sequence[str]) -> dict[str, int]:
        """``watcher -> published messages it never got`` (only watchers that miss some)."""
        lost = {w: sum(1 for m in message_ids if not self.counts[w, m]) for w in self.watchers}
        return {w: n for w, n in lost.items() if n}
