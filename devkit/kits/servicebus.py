"""
The Azure Service Bus test kit: the wire-level test broker of ``tests/servicebus_broker`` (AMQP 1.0
as ``azure-servicebus`` speaks it; in this process, or with ``in_subprocess`` in a child process
whose CPU stays off the caller's GIL), or (not ``own``) the namespace ``SERVICEBUS_CONNECTION_STRING``
names, the ``azure_service_bus`` connection, and :class:`ServiceBusOrders`, one queue with its
dead-letter sub-queue. Orders are sent with the synchronous ``azure-servicebus`` client; progress is
read from the test broker's own records, or, on a real namespace or the official emulator, by
peeking with that client.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
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
CONNECTION_STRING_ENV: Final = "SERVICEBUS_CONNECTION_STRING"
# With a namespace that has no administration API (the official emulator): a queue declared in its
# Config.json that every stream uses, drained first.
QUEUE_ENV: Final = "SERVICEBUS_QUEUE"


def servicebus_connection(connection_string: str) -> dict[str, Any]:
    # The upstream azure_service_bus connection type keeps the connection string in ``schema``.
    return {"conn_type": "azure_service_bus", "schema": connection_string}


def body_of(message: Any) -> bytes:
    """A received message's body as bytes (the SDK gives a generator of sections)."""
    body = message.body
    return bytes(body) if isinstance(body, bytes | bytearray) else b"".join(body)


@dataclass
class DeadLetter:
    """A message of a dead-letter sub-queue: its body, reason, description and delivery count."""

    body: bytes
    reason: str | None
    description: str | None
    delivery_count: int


@dataclass
class ServiceBusOrders(OrdersById):
    """
    One queue: a publisher and what the queue holds. On a test broker (``handle``) from the broker's
    record of it; on an external namespace (``handle`` None, ``connection_string``) by peeking. The
    queue is created (``create=False``: it exists): on the test broker, through the administration
    API (deleted by :meth:`delete`), or, with ``SERVICEBUS_QUEUE`` set, that queue drained instead.
    """

    source_field = "queue"
    source_arg = "queue_name"

    handle: Any  # tests.servicebus_broker.broker.BrokerHandle (or the child process' proxy); None: external
    queue: str = SERVICEBUS_QUEUE
    lock_duration: float = LOCK_DURATION
    max_delivery_count: int = MAX_DELIVERY_COUNT
    requires_session: bool = False
    # The namespace's connection string (a test broker's by default).
    connection_string: str = ""
    create: bool = True
    # message_id (the order's key) -> order, filled as sends are confirmed.
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)
    # Whether :meth:`delete` removes the queue (one this stream created through the administration API).
    created: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sdk_client: Any = None
        # Held for each use of the SDK client: a sync connection serves one thread at a time.
        self._client_lock = threading.RLock()
        if self.handle is not None:
            self.connection_string = self.connection_string or str(self.handle.connection_string)
        if not self.create:
            return
        session = {"requires_session": True} if self.requires_session else {}
        if self.handle is not None:
            self.handle.create_queue(
                self.queue, lock_duration=self.lock_duration, max_delivery_count=self.max_delivery_count, **session
            )
            return
        fixed = os.environ.get(QUEUE_ENV)
        if fixed:
            if self.requires_session:
                raise ValueError(f"{QUEUE_ENV} is a pre-declared queue; a session-enabled one is needed")
            self.queue = fixed
            self.drain()
            self.drain(dead_letter=True)
            return
        from azure.servicebus.management import ServiceBusAdministrationClient

        with ServiceBusAdministrationClient.from_connection_string(self.connection_string) as admin:
            admin.create_queue(
                self.queue,
                lock_duration=timedelta(seconds=self.lock_duration),
                max_delivery_count=self.max_delivery_count,
                requires_session=self.requires_session,
            )
        self.created = True

    @property
    def local(self) -> bool:
        """Whether the queue is on a test broker (else: an external namespace)."""
        return self.handle is not None

    def delete(self) -> None:
        """Delete the queue if this stream created it through the administration API."""
        if not self.created:
            return
        from azure.servicebus.management import ServiceBusAdministrationClient

        with ServiceBusAdministrationClient.from_connection_string(self.connection_string) as admin:
            admin.delete_queue(self.queue)
        self.created = False

    def client(self) -> Any:
        """The stream's sync SDK client (one connection, opened on first use, kept until :meth:`close`)."""
        if self._sdk_client is None:
            from azure.servicebus import ServiceBusClient

            self._sdk_client = ServiceBusClient.from_connection_string(self.connection_string)
        return self._sdk_client

    def close(self) -> None:
        """Close the sync SDK client of :meth:`client`, if open."""
        with self._client_lock:
            client, self._sdk_client = self._sdk_client, None
        if client is not None:
            client.close()

    chunk_size = 100

    def send(
        self, bodies: Sequence[bytes | str], *, attributes: Mapping[str, Any] | None = None, **message_kwargs: Any
    ) -> None:
        """
        Send ``bodies`` in order, each with ``attributes`` as application properties (any AMQP type)
        and ``message_kwargs`` (``ServiceBusMessage``'s own: ids, subject, session id, ...).
        """
        from azure.servicebus import ServiceBusMessage

        properties: dict[str | bytes, Any] | None = {k: v for k, v in attributes.items()} if attributes else None
        with self._client_lock, self.client().get_queue_sender(self.queue) as sender:
            for start in range(0, len(bodies), self.chunk_size):
                chunk = bodies[start : start + self.chunk_size]
                send_batched(
                    sender, (ServiceBusMessage(b, application_properties=properties, **message_kwargs) for b in chunk)
                )

    @contextlib.contextmanager
    def _sender(self, *, paced: bool) -> Iterator[Sender]:
        """
        The synchronous client: ``message_id`` = the key where given (else an empty id). One batch
        is one transfer, bounded by the link's maximum message size: a full batch goes out and
        the message that did not fit starts the next one.
        """
        from azure.servicebus import ServiceBusMessage

        def send_chunk(chunk: list[Item]) -> list[str]:
            ids = [key.decode() if key is not None else None for _, key in chunk]
            send_batched(
                sender, (ServiceBusMessage(body, message_id=i) for (body, _), i in zip(chunk, ids, strict=True))
            )
            return [i or "" for i in ids]

        from azure.servicebus import ServiceBusClient

        with (
            ServiceBusClient.from_connection_string(self.connection_string) as client,
            client.get_queue_sender(self.queue) as sender,
        ):
            yield send_chunk

    def backlog(self) -> int:
        """Messages still on the queue: available, locked by a receiver, or deferred."""
        if not self.local:
            return len(self.peek())
        counts = self.handle.counts(self.queue)
        return int(counts.active + counts.locked + counts.deferred)

    def peek(self, *, dead_letter: bool = False) -> list[Any]:
        """Every message of the queue (or its dead-letter sub-queue), peeked through the SDK."""
        from azure.servicebus import ServiceBusSubQueue

        sub_queue = ServiceBusSubQueue.DEAD_LETTER if dead_letter else None
        out: list[Any] = []
        with self._client_lock, self.client().get_queue_receiver(self.queue, sub_queue=sub_queue) as receiver:
            while page := receiver.peek_messages(max_message_count=250):
                out.extend(page)
        return out

    def drain(self, *, dead_letter: bool = False) -> None:
        """Receive and delete whatever the queue (or its dead-letter sub-queue) holds."""
        from azure.servicebus import ServiceBusReceiveMode, ServiceBusSubQueue

        sub_queue = ServiceBusSubQueue.DEAD_LETTER if dead_letter else None
        mode = ServiceBusReceiveMode.RECEIVE_AND_DELETE
        with (
            self._client_lock,
            self.client().get_queue_receiver(self.queue, sub_queue=sub_queue, receive_mode=mode) as receiver,
        ):
            while receiver.receive_messages(max_message_count=250, max_wait_time=1):
                pass

    def dead_letter_records(self) -> list[DeadLetter]:
        """Every message of the dead-letter sub-queue, in order."""
        if not self.local:
            return [
                DeadLetter(body_of(m), m.dead_letter_reason, m.dead_letter_error_description, m.delivery_count or 0)
                for m in self.peek(dead_letter=True)
            ]
        return [
            DeadLetter(
                body=m.body if isinstance(m.body, bytes) else bytes(m.body),
                reason=m.dead_letter_reason,
                description=m.dead_letter_description,
                delivery_count=m.delivery_count,
            )
            for m in self.handle.dead_letters(self.queue)
        ]

    def delivery_counts(self) -> list[int]:
        """``delivery_count`` of every message still in the queue (by sequence number)."""
        if not self.local:
            return [m.delivery_count or 0 for m in self.peek()]
        return [m.delivery_count for m in self.handle.messages(self.queue)]

    def left_queue(self) -> tuple[int, int]:
        """``(completed, dead-lettered)``: the queue's counters of messages that left it for good."""
        stats = self.handle.entity_stats(self.queue)
        return stats["completed"], stats["dead_lettered"]

    def dead_letters(self) -> dict[str, str]:
        """``message_id -> DeadLetterReason`` of every message in the queue's dead-letter sub-queue."""
        messages = self.handle.dead_letters(self.queue) if self.local else self.peek(dead_letter=True)
        return {str(message.message_id): message.dead_letter_reason or "" for message in messages}

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


def _child_broker_main(pipe: Connection) -> None:
    """
    The child process of :class:`ChildBroker`: start the test broker, send its connection string,
    then answer ``(attribute, args, kwargs)`` requests with the handle's attribute (called when
    callable) until ``stop``. A failure is sent back as the exception, raised in the parent.
    """
    from tests.servicebus_broker.broker import start_broker

    handle = start_broker()
    pipe.send(handle.connection_string)
    while True:
        name, args, kwargs = pipe.recv()
        if name == "stop":
            handle.stop()
            pipe.send(None)
            return
        try:
            attribute = getattr(handle, name)
            result: Any = attribute(*args, **kwargs) if callable(attribute) else attribute
        except Exception as exc:  # raised in the parent by ChildBroker.call
            result = exc
        pipe.send(result)


class ChildBroker:
    """
    The test broker in a spawned child process, whose CPU stays off the caller's GIL (benchmarks
    measure the client process alone). Stands in for a ``BrokerHandle`` where a kit stream reads
    one: each call goes to the handle in the child (arguments and results pickled; one request at
    a time, the pipe is not shared between threads).
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_child_broker_main, args=(child,), daemon=True)
        self._process.start()
        self.connection_string = str(self._pipe.recv())
        self._lock = threading.Lock()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The child handle's ``name`` (a method called with the arguments, or an attribute's value)."""
        with self._lock:
            self._pipe.send((name, args, kwargs))
            result = self._pipe.recv()
        if isinstance(result, Exception):
            raise result
        return result

    def create_queue(self, name: str, **options: Any) -> None:
        self.call("create_queue", name, **options)

    def counts(self, path: str) -> Any:
        return self.call("counts", path)

    def messages(self, path: str) -> Any:
        return self.call("messages", path)

    def dead_letters(self, path: str) -> Any:
        return self.call("dead_letters", path)

    def entity_stats(self, path: str) -> dict[str, int]:
        return dict(self.call("entity_stats", path))

    def operations(self) -> Any:
        """The broker's ``OperationStats``: every frame and management request clients sent it."""
        return self.call("operations")

    @property
    def errors(self) -> list[Any]:
        return list(self.call("errors"))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call("stop")
        self._process.join(10)


class ServiceBusKit(BrokerKit):
    """
    The test broker on a free loopback port (this process; ``in_subprocess``: a child process), or,
    when not ``own``, the namespace ``SERVICEBUS_CONNECTION_STRING`` names. ``handle``: a test
    broker started elsewhere (the integration tests' per-test broker), used as it is and never
    stopped here.
    """

    name = "servicebus"
    address_env = CONNECTION_STRING_ENV

    def __init__(self, *, own: bool | None = None, in_subprocess: bool = False, handle: Any = None) -> None:
        super().__init__(own=own)
        self.in_subprocess = in_subprocess
        self.handle: Any = handle
        self._stops = handle is None

    def start(self) -> str:
        if self.handle is not None:
            return f"Service Bus test broker {self.handle.host}:{self.handle.port} (given)"
        return super().start()

    def _start_own(self) -> str:
        if self.in_subprocess:
            self.handle = ChildBroker()
            return "Service Bus test broker (tests/servicebus_broker, child process)"
        from tests.servicebus_broker.broker import start_broker

        # The SDK logs every AMQP state change at INFO (the publisher's, in this process): noise in
        # a progress display. Warnings and errors still show.
        logging.getLogger("azure").setLevel(logging.WARNING)
        self.handle = start_broker()
        return f"Service Bus test broker (tests/servicebus_broker) {self.handle.host}:{self.handle.port}"

    def stop(self) -> None:
        if self.handle is not None and self._stops:
            self.handle.stop()
            self.handle = None

    @property
    def connection_string(self) -> str:
        """The test broker's connection string, or the external namespace's."""
        if self.handle is not None:
            return str(self.handle.connection_string)
        assert self.address, "the Service Bus kit is not started"
        return self.address

    def connection(self) -> dict[str, Any]:
        return servicebus_connection(self.connection_string)

    def stream(
        self,
        name: str,
        *,
        lock_duration: float = LOCK_DURATION,
        max_delivery_count: int = MAX_DELIVERY_COUNT,
        requires_session: bool = False,
        create: bool = True,
    ) -> ServiceBusOrders:
        """Queue ``name`` (and its dead-letter sub-queue), created unless ``create`` is false (ServiceBusOrders')."""
        return ServiceBusOrders(
            self.handle,
            name,
            lock_duration=lock_duration,
            max_delivery_count=max_delivery_count,
            requires_session=requires_session,
            connection_string=self.connection_string,
            create=create,
        )


def send_batched(sender: Any, messages: Iterable[Any]) -> None:
    """
    Send ``messages`` in order through a sync sender, as few batches as the link's maximum message
    size allows: a full batch goes out and the message that did not fit starts the next one (a
    message too large alone raises the SDK's ``MessageSizeExceededError``).
    """
    from azure.servicebus.exceptions import MessageSizeExceededError

    batch, pending = sender.create_message_batch(), 0
    for outgoing in messages:
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
