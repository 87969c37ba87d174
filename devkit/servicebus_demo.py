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

from typing import Any

from devkit.demo_streams import DemoStream
from devkit.demo_types import Settlement
from devkit.kits.servicebus import (
    LOCK_DURATION,
    MAX_DELIVERY_COUNT,
    SERVICEBUS_CONN_ID,
    SERVICEBUS_DEAD_LETTER_QUEUE,
    SERVICEBUS_QUEUE,
    ServiceBusKit,
    ServiceBusOrders,
)

__all__ = [
    "LOCK_DURATION",
    "MAX_DELIVERY_COUNT",
    "SERVICEBUS_CONN_ID",
    "SERVICEBUS_DEAD_LETTER_QUEUE",
    "SERVICEBUS_QUEUE",
    "ServiceBusDemoStream",
    "ServiceBusOrders",
]


class ServiceBusDemoStream(DemoStream[ServiceBusOrders]):
    broker = "servicebus"
    source_label = f"queue {SERVICEBUS_QUEUE}"
    dlq_label = f"queue {SERVICEBUS_DEAD_LETTER_QUEUE}"

    def start(self) -> str:
        kit = self.kit = ServiceBusKit()
        kit.start()  # quiets the SDK's INFO logging of every AMQP state change (noise in the display)
        self._orders = kit.stream(SERVICEBUS_QUEUE, lock_duration=LOCK_DURATION, max_delivery_count=MAX_DELIVERY_COUNT)
        return (
            f"Service Bus test broker (tests/servicebus_broker) {kit.handle.host}:{kit.handle.port}; "
            f"queue {SERVICEBUS_QUEUE} (lock {LOCK_DURATION:.0f} s, max delivery count {MAX_DELIVERY_COUNT}) "
            "and its dead-letter sub-queue created"
        )

    def connections(self) -> dict[str, Any]:
        assert self.kit is not None
        return {SERVICEBUS_CONN_ID: self.kit.connection()}

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
