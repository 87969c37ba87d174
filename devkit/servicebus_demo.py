"""
The Azure Service Bus side of the demo (``python -m devkit.demo --broker servicebus``): the
wire-level Service Bus test broker (``tests/servicebus_broker``, AMQP 1.0 as ``azure-servicebus``
speaks it), the ``orders`` queue with its dead-letter sub-queue, and the example Dags of
``example_dags/example_servicebus_orders.py``.

The broker runs in this process, on its own event loop in a daemon thread (``start_broker``), and
listens on a free loopback port; the triggerer reaches it through an emulator connection string
(``UseDevelopmentEmulator=true``: plain AMQP on that port). Orders are sent with the synchronous
``azure-servicebus`` client. Progress is read from the broker's own records, never through the
provider:

==================  =========================================================================
settled             the source queue's counters: messages completed + messages the queue moved
                    to its dead-letter sub-queue (both leave the queue for good)
dead-lettered       the messages in ``orders/$DeadLetterQueue``, each with its
                    ``DeadLetterReason`` (the reason property the provider sets)
==================  =========================================================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import MessageSizeExceededError

from devkit.demo_streams import DemoStream, paced_chunks
from devkit.demo_types import OrderMessage, Settlement
from tests.servicebus_broker.broker import BrokerHandle, start_broker

SERVICEBUS_QUEUE: Final = "orders"
SERVICEBUS_DEAD_LETTER_QUEUE: Final = f"{SERVICEBUS_QUEUE}/$DeadLetterQueue"
SERVICEBUS_CONN_ID: Final = "azure_service_bus_default"
# The service's defaults are a 60 s lock and 10 deliveries. 30 s: a message whose triggerer died
# comes back sooner; the provider renews the locks of messages its watchers still work on (up to
# the ack timeout), so the lock never needs to cover a whole Dag run.
LOCK_DURATION: Final = 30.0
MAX_DELIVERY_COUNT: Final = 10


@dataclass
class ServiceBusOrders:
    """The ``orders`` queue on one test broker: a publisher and the broker's record of it."""

    handle: BrokerHandle
    queue: str = SERVICEBUS_QUEUE
    # message_id (the order's key) -> order, filled as sends are confirmed.
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.handle.create_queue(self.queue, lock_duration=LOCK_DURATION, max_delivery_count=MAX_DELIVERY_COUNT)
        self._lock = threading.Lock()

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """
        Send in order, ``message_id`` = the order's key (the envelope's ``message_id``), in batches
        of up to 100 (one message at a time when ``rate`` paces them).
        """
        with (
            ServiceBusClient.from_connection_string(self.handle.connection_string) as client,
            client.get_queue_sender(self.queue) as sender,
        ):
            for chunk in paced_chunks(messages, size=100, rate=rate, stop=stop):
                # One batch is one transfer, bounded by the link's maximum message size: a full
                # batch goes out and the message that did not fit starts the next one.
                batch = sender.create_message_batch()
                pending: list[OrderMessage] = []
                for message in chunk:
                    outgoing = ServiceBusMessage(message.value, message_id=message.key.decode())
                    try:
                        batch.add_message(outgoing)
                    except MessageSizeExceededError:
                        if not pending:  # alone it is too large for the broker: nothing to retry
                            raise
                        self._send(sender, batch, pending)
                        batch, pending = sender.create_message_batch(), []
                        batch.add_message(outgoing)
                    pending.append(message)
                if pending:
                    self._send(sender, batch, pending)

    def _send(self, sender: Any, batch: Any, messages: list[OrderMessage]) -> None:
        # Any: the sync sender and batch types live in azure.servicebus._servicebus_sender.
        sender.send_messages(batch)
        with self._lock:
            self.published.update((m.key.decode(), m) for m in messages)

    def backlog(self) -> int:
        """Messages still on the queue: available, locked by a receiver, or deferred."""
        counts = self.handle.counts(self.queue)
        return int(counts.active + counts.locked + counts.deferred)

    def left_queue(self) -> tuple[int, int]:
        """``(completed, dead-lettered)``: the queue's counters of messages that left it for good."""
        stats = self.handle.entity_stats(self.queue)
        return stats["completed"], stats["dead_lettered"]

    def dead_letters(self) -> dict[str, str]:
        """``message_id -> DeadLetterReason`` of every message in the queue's dead-letter sub-queue."""
        return {
            str(message.message_id): message.dead_letter_reason or ""
            for message in self.handle.dead_letters(self.queue)
        }

    def broker_errors(self) -> int:
        """Errors the test broker hit while serving a client (protocol violations, its own bugs)."""
        return len(self.handle.errors)


class ServiceBusDemoStream(DemoStream[ServiceBusOrders]):
    broker = "servicebus"
    dag_files = ("example_servicebus_orders.py", "order_filters.py", "order_events.py", "orders_spark.py")
    source_label = f"queue {SERVICEBUS_QUEUE}"
    dlq_label = f"queue {SERVICEBUS_DEAD_LETTER_QUEUE}"

    def __init__(self) -> None:
        super().__init__()
        self._handle: BrokerHandle | None = None

    def start(self) -> str:
        # The SDK logs every AMQP state change at INFO (the publisher's, in this process): noise in
        # the progress display. Warnings and errors still show.
        logging.getLogger("azure").setLevel(logging.WARNING)
        self._handle = start_broker()
        self._orders = ServiceBusOrders(self._handle)
        return (
            f"Service Bus test broker (tests/servicebus_broker) {self._handle.host}:{self._handle.port}; "
            f"queue {SERVICEBUS_QUEUE} (lock {LOCK_DURATION:.0f} s, max delivery count {MAX_DELIVERY_COUNT}) "
            "and its dead-letter sub-queue created"
        )

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None

    @property
    def published(self) -> int:
        return len(self.orders.published)

    def connections(self) -> dict[str, Any]:
        assert self._handle is not None
        # The upstream azure_service_bus connection type keeps the connection string in ``schema``.
        return {SERVICEBUS_CONN_ID: {"conn_type": "azure_service_bus", "schema": self._handle.connection_string}}

    def dag_env(self) -> dict[str, str]:
        return {"ORDERS_SERVICEBUS_QUEUE": SERVICEBUS_QUEUE, "ORDERS_SERVICEBUS_CONN_ID": SERVICEBUS_CONN_ID}

    def settlement(self) -> Settlement:
        # A message leaves the queue only when completed (every watcher's events stored) or
        # dead-lettered; what is still there is waiting, locked or to be redelivered.
        completed, dead_lettered = self.orders.left_queue()
        backlog = self.orders.backlog()
        published = self.published
        detail = (
            f"{completed} completed and {dead_lettered} dead-lettered from queue {SERVICEBUS_QUEUE}, "
            f"{backlog} still in it"
        )
        errors = self.orders.broker_errors()
        if errors:  # the broker's own failures must not hide behind a stalled count
            detail += f"; the test broker recorded {errors} error(s)"
        # min: a message can be settled before its send is confirmed here (published lags).
        return Settlement(min(completed + dead_lettered, published), published, detail)

    def dead_lettered(self) -> int:
        return len(self.orders.dead_letters())
