"""
The Azure Service Bus test kit: the wire-level test broker of ``tests/servicebus_broker`` (AMQP 1.0
as ``azure-servicebus`` speaks it; in this process, or with ``in_subprocess`` in a child process
whose CPU stays off the caller's GIL), the ``azure_service_bus`` connection (an emulator connection
string), and :class:`ServiceBusOrders`, one queue with its dead-letter sub-queue. Orders are sent
with the synchronous ``azure-servicebus`` client; progress is read from the broker's own records.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from devkit.demo_types import OrderMessage
from devkit.kits import BrokerKit, Item, OrdersById, Sender

SERVICEBUS_QUEUE: Final = "orders"
SERVICEBUS_DEAD_LETTER_QUEUE: Final = f"{SERVICEBUS_QUEUE}/$DeadLetterQueue"
SERVICEBUS_CONN_ID: Final = "azure_service_bus_default"
# The service's defaults are a 60 s lock and 10 deliveries. 30 s: a message whose triggerer died
# comes back sooner; the provider renews the locks of messages its watchers still work on (up to
# the ack timeout), so the lock never needs to cover a whole Dag run.
LOCK_DURATION: Final = 30.0
MAX_DELIVERY_COUNT: Final = 10


def servicebus_connection(connection_string: str) -> dict[str, Any]:
    # The upstream azure_service_bus connection type keeps the connection string in ``schema``.
    return {"conn_type": "azure_service_bus", "schema": connection_string}


@dataclass
class ServiceBusOrders(OrdersById):
    """One queue on a test broker: a publisher and the broker's record of it."""

    source_field = "queue"
    source_arg = "queue_name"

    handle: Any  # tests.servicebus_broker.broker.BrokerHandle (or the child process' proxy)
    queue: str = SERVICEBUS_QUEUE
    lock_duration: float = LOCK_DURATION
    max_delivery_count: int = MAX_DELIVERY_COUNT
    # message_id (the order's key) -> order, filled as sends are confirmed.
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.handle.create_queue(
            self.queue, lock_duration=self.lock_duration, max_delivery_count=self.max_delivery_count
        )
        self._lock = threading.Lock()

    chunk_size = 100

    @contextlib.contextmanager
    def _sender(self, *, paced: bool) -> Iterator[Sender]:
        """
        The synchronous client: ``message_id`` = the key where given (else an empty id). One batch
        is one transfer, bounded by the link's maximum message size: a full batch goes out and
        the message that did not fit starts the next one.
        """
        from azure.servicebus import ServiceBusClient, ServiceBusMessage
        from azure.servicebus.exceptions import MessageSizeExceededError

        def send_chunk(chunk: list[Item]) -> list[str]:
            batch, pending = sender.create_message_batch(), 0
            for body, key in chunk:
                outgoing = ServiceBusMessage(body, message_id=key.decode() if key is not None else None)
                try:
                    batch.add_message(outgoing)
                except MessageSizeExceededError:
                    if not pending:  # alone it is too large for the broker: nothing to retry
                        raise
                    sender.send_messages(batch)
                    batch, pending = sender.create_message_batch(), 0
                    batch.add_message(outgoing)
                pending += 1
            if pending:
                sender.send_messages(batch)
            return [key.decode() if key is not None else "" for _, key in chunk]

        with (
            ServiceBusClient.from_connection_string(self.handle.connection_string) as client,
            client.get_queue_sender(self.queue) as sender,
        ):
            yield send_chunk

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

    def unsettled(self) -> int:
        return self.backlog()

    def diagnostics(self) -> str:
        counts = self.handle.counts(self.queue)
        errors = self.handle.errors
        text = f"queue {counts}; test broker recorded {len(errors)} error(s)"
        if errors:
            text += ": " + "; ".join(repr(error.error)[:200] for error in errors[:5])
        return text


class _ChildBroker:
    """The test broker in a child process (``bench.servicebus_bench.BrokerProcess``), as far as a publisher needs it."""

    def __init__(self) -> None:
        from bench.servicebus_bench import BrokerProcess

        self.child = BrokerProcess()
        self.connection_string = str(self.child.connection_string)

    def create_queue(self, name: str, *, lock_duration: float, max_delivery_count: int) -> None:
        # The child's create_queue takes the lock duration; its max delivery count is the broker's default.
        self.child.call("create_queue", name, lock_duration)

    def stop(self) -> None:
        self.child.stop()


class ServiceBusKit(BrokerKit):
    """The test broker on a free loopback port (this process; ``in_subprocess``: a child process)."""

    name = "servicebus"

    def __init__(self, *, own: bool | None = None, in_subprocess: bool = False) -> None:
        super().__init__(own=own)
        self.in_subprocess = in_subprocess
        self.handle: Any = None

    def start(self) -> str:
        if self.in_subprocess:
            self.handle = _ChildBroker()
            return "Service Bus test broker (tests/servicebus_broker, child process)"
        from tests.servicebus_broker.broker import start_broker

        # The SDK logs every AMQP state change at INFO (the publisher's, in this process): noise in
        # a progress display. Warnings and errors still show.
        logging.getLogger("azure").setLevel(logging.WARNING)
        self.handle = start_broker()
        return f"Service Bus test broker (tests/servicebus_broker) {self.handle.host}:{self.handle.port}"

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()
            self.handle = None

    @property
    def connection_string(self) -> str:
        assert self.handle is not None, "the Service Bus kit is not started"
        return str(self.handle.connection_string)

    def connection(self) -> dict[str, Any]:
        return servicebus_connection(self.connection_string)

    def stream(
        self, name: str, *, lock_duration: float = LOCK_DURATION, max_delivery_count: int = MAX_DELIVERY_COUNT
    ) -> ServiceBusOrders:
        """Queue ``name`` (and its dead-letter sub-queue), created."""
        return ServiceBusOrders(self.handle, name, lock_duration=lock_duration, max_delivery_count=max_delivery_count)
