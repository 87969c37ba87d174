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

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from order_events import envelopes_of  # example_dags (on sys.path: tests/e2e/conftest.py)

from devkit.airflow_env import AirflowEnv
from devkit.demo_types import OrderMessage
from devkit.kits import BrokerKit, KitStream, harness_class, kit_class

CONN_ID = "kill_loop"
KAFKA_TOPIC = "kill-loop"
SERVICEBUS_QUEUE = "kill-loop"


# -- the brokers ------------------------------------------------------------------------------------
class LoopBroker:
    """
    One broker's side of a test, a thin layer over the broker's test kit (``devkit.kits``, the
    registry's ``harness.kit``): its source, the connection, a publisher and what it sent.
    A broker's subclass names the stream and the kill loop's own trigger options.
    """

    name: ClassVar[str]
    stream_name: ClassVar[str] = "kill-loop"
    stream_options: ClassVar[dict[str, Any]] = {}
    trigger_options: ClassVar[dict[str, Any]] = {}  # beside the kit stream's source arguments
    send_keys: ClassVar[bool] = True  # the orders' keys go with them (record key, message_id, ...)

    def __init__(self) -> None:
        self.kit: BrokerKit = kit_class(self.name)()
        self.kit.start()
        try:
            self.stream: KitStream = self.kit.stream(self.source_name(), **self.stream_options)
        except BaseException:
            self.kit.stop()
            raise
        self._ids: list[str] = []
        self._lock = threading.Lock()

    def source_name(self) -> str:
        return self.stream_name

    @property
    def source(self) -> str:
        return self.stream.source

    def connection(self) -> dict[str, Any]:
        return self.kit.connection()

    def trigger_kwargs(self) -> dict[str, Any]:
        """
        The trigger's source and broker-specific arguments in the kill-loop Dag, JSON-safe (the Dag
        adds the connection, as the registry's ``conn_id_arg``, and each watcher's ``match``).
        """
        return {**self.stream.trigger_kwargs(), **self.trigger_options}

    def component_env(self) -> dict[str, str]:
        return self.kit.env()

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        """Publish in order at ``rate`` per second until done or ``stop`` is set (runs in a thread)."""

        def record(_: Sequence[OrderMessage], ids: list[str]) -> None:
            with self._lock:
                self._ids.extend(ids)

        self.stream.publish_orders(messages, record, rate=rate, stop=stop, keys=self.send_keys)

    def published_ids(self) -> list[str]:
        """The envelope ``message_id`` of every message the broker accepted so far."""
        with self._lock:
            return list(self._ids)

    def close(self) -> None:
        self.kit.stop()

    def unsettled(self) -> int:
        """Messages the broker still holds for the stream (not committed / deleted / acked / completed)."""
        return self.stream.unsettled()

    def diagnostics(self) -> str:
        return self.stream.diagnostics()


class KafkaLoop(LoopBroker):
    name = "kafka"
    stream_name = KAFKA_TOPIC
    # The group the trigger derives from the connection and the topic: its commits are "settled".
    stream_options = {"group_id": f"airflow-shared-stream.{CONN_ID}.{KAFKA_TOPIC}"}

    def trigger_kwargs(self) -> dict[str, Any]:
        return {**super().trigger_kwargs(), "dlq_topic": f"{KAFKA_TOPIC}.dlq"}


class SqsLoop(LoopBroker):
    name = "sqs"
    stream_name = "orders"
    trigger_options = {"wait_time_seconds": 2}


class PubSubLoop(LoopBroker):
    name = "pubsub"
    stream_name = "orders"


class ServiceBusLoop(LoopBroker):
    name = "servicebus"
    stream_name = SERVICEBUS_QUEUE
    # Service Bus' own defaults would be a 60 s lock and 10 deliveries; 30 s keeps the wait for
    # the locks of a killed triggerer's messages shorter.
    stream_options = {"lock_duration": 30.0, "max_delivery_count": 10}
    trigger_options = {"max_wait_time": 1.0}


def loop_broker_class(name: str) -> type[LoopBroker]:
    """The :class:`LoopBroker` of registry broker ``name`` (its ``harness.kill_loop``)."""
    loop: type[LoopBroker] = harness_class(name, "kill_loop", LoopBroker)
    return loop


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
