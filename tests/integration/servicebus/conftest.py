"""
Service Bus integration fixtures: the wire-level test broker, or SERVICEBUS_CONNECTION_STRING.

Without the variable every test gets its own test broker (``tests/servicebus_broker``), a real
AMQP 1.0 endpoint the unmodified ``azure.servicebus.aio`` SDK talks to over loopback. With it, the
same tests run against the official emulator or a real namespace (the Service Bus kit's,
``devkit.kits.servicebus.ServiceBusKit``):

* a real namespace: each test creates a fresh queue through ``ServiceBusAdministrationClient``
  (lock duration and max delivery count as the test asks) and deletes it afterwards;
* the emulator (no administration API): set ``SERVICEBUS_QUEUE`` to a queue declared in its
  ``Config.json`` (lock duration 5 s recommended); the queue and its dead-letter queue are drained
  before each test. Tests that need a particular lock duration or max delivery count adapt to what
  the queue reports, or are skipped with the reason when they cannot.

Broker state is always asserted independently of the producer, by the kit's queues
(``ServiceBusOrders``): through the test broker's inspection API, or by peeking with a separate
SDK client.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient

from airflow_shared_stream_provider.producers.servicebus import ServiceBusSharedStreamProducer
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.kits.servicebus import (
    CONNECTION_STRING_ENV,
    QUEUE_ENV,
    DeadLetter,
    ServiceBusKit,
    ServiceBusOrders,
    servicebus_connection,
)
from devkit.runner import record_producers
from tests.integration.contract import KitAdapter
from tests.integration.faults_harness import set_connection
from tests.servicebus_broker.fixtures import servicebus_broker

__all__ = ["servicebus_broker"]

EXTERNAL = os.environ.get(CONNECTION_STRING_ENV)
DEFAULT_LOCK = 5.0
DEFAULT_MAX_DELIVERY_COUNT = 10


class ServiceBusEnv:
    """
    One namespace for one test, the kit's (the test broker, or an external one): its queues are kit
    streams, read in worker threads. Owns one async SDK client, for the sends only Service Bus-only
    tests make (topics, senders of their own).
    """

    def __init__(self, kit: ServiceBusKit) -> None:
        self.kit = kit
        self.connection_string = kit.connection_string
        self.handle: Any = kit.handle  # tests.servicebus_broker.broker.BrokerHandle, or None when external
        self.client: ServiceBusClient | None = None
        self.streams: dict[str, ServiceBusOrders] = {}

    @property
    def local(self) -> bool:
        return self.handle is not None

    async def __aenter__(self) -> ServiceBusEnv:
        self.client = ServiceBusClient.from_connection_string(self.connection_string)
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.close()
        for stream in self.streams.values():
            await asyncio.to_thread(stream.close)
            await asyncio.to_thread(stream.delete)

    def stream(self, queue: str) -> ServiceBusOrders:
        """The kit stream of ``queue`` (one this test did not create: taken as it is)."""
        if queue not in self.streams:
            self.streams[queue] = self.kit.stream(queue, create=False)
        return self.streams[queue]

    async def create_queue(
        self,
        prefix: str = "q",
        *,
        lock_duration: float = DEFAULT_LOCK,
        max_delivery_count: int = DEFAULT_MAX_DELIVERY_COUNT,
        requires_session: bool = False,
    ) -> str:
        """A fresh queue (local / real namespace) or the drained SERVICEBUS_QUEUE (emulator)."""
        if not self.local and os.environ.get(QUEUE_ENV) and requires_session:
            pytest.skip("SERVICEBUS_QUEUE is a pre-declared queue; this test needs a session-enabled one")
        stream = await asyncio.to_thread(
            self.kit.stream,
            f"{prefix}-{uuid.uuid4().hex[:8]}",
            lock_duration=lock_duration,
            max_delivery_count=max_delivery_count,
            requires_session=requires_session,
        )
        if (replaced := self.streams.get(stream.queue)) is not None:  # SERVICEBUS_QUEUE again
            await asyncio.to_thread(replaced.close)
        self.streams[stream.queue] = stream
        return stream.queue

    async def publish(
        self,
        queue: str,
        bodies: Sequence[bytes | str],
        *,
        attributes: Mapping[str, Any] | None = None,
        **message_kwargs: Any,
    ) -> None:
        await asyncio.to_thread(self.stream(queue).send, bodies, attributes=attributes, **message_kwargs)

    # -- inspection (independent of the producer) --------------------------------------------
    async def unsettled(self, queue: str) -> int:
        """Messages still in the queue: available, locked or deferred."""
        return await asyncio.to_thread(self.stream(queue).backlog)

    async def dead_letters(self, queue: str) -> list[DeadLetter]:
        return await asyncio.to_thread(self.stream(queue).dead_letter_records)

    async def delivery_counts(self, queue: str) -> list[int]:
        """delivery_count of every message still in the queue (by sequence number)."""
        return await asyncio.to_thread(self.stream(queue).delivery_counts)

    async def _peek(self, queue: str, *, dead_letter: bool = False) -> list[ServiceBusReceivedMessage]:
        return await asyncio.to_thread(self.stream(queue).peek, dead_letter=dead_letter)


@pytest.fixture
async def sb(request: pytest.FixtureRequest) -> AsyncIterator[ServiceBusEnv]:
    """The namespace for this test (never skipped: a test broker that does not start is an error)."""
    # The per-test broker of the servicebus_broker fixture (it fails the test on a broker error),
    # or (own=False) the namespace SERVICEBUS_CONNECTION_STRING names.
    handle = None if EXTERNAL else request.getfixturevalue("servicebus_broker")
    with ServiceBusKit(own=False, handle=handle) as kit:
        async with ServiceBusEnv(kit) as env:
            yield env


@pytest.fixture
def sb_conn(sb: ServiceBusEnv, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``azure_service_bus`` Airflow connection (upstream shape: connection string in schema)."""
    return set_connection(monkeypatch, "servicebus_it", servicebus_connection(sb.connection_string))


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ServiceBusSharedStreamProducer]]:
    """Every producer the manager builds in this test (to read its counters)."""
    yield record_producers(monkeypatch, ServiceBusSharedStreamProducer)


class ServiceBusAdapter(KitAdapter[ServiceBusOrders, ServiceBusSharedStreamTrigger]):
    """
    BrokerAdapter for the contract suite over a kit stream: a fresh queue per test, its
    $DeadLetterQueue as the DLQ. ``sb``: the test's namespace (its async client), where there is one.
    """

    broker = "servicebus"
    trigger_class = ServiceBusSharedStreamTrigger
    quick: ClassVar[dict[str, Any]] = {"max_wait_time": 0.5}

    def __init__(self, kit: ServiceBusOrders, conn_id: str, sb: ServiceBusEnv | None = None) -> None:
        super().__init__(kit, conn_id)
        self.sb = sb
        self.queue = kit.queue

    @classmethod
    def on(cls, sb: ServiceBusEnv, conn_id: str, queue: str) -> ServiceBusAdapter:
        """The adapter of ``queue`` in the test's namespace."""
        return cls(sb.stream(queue), conn_id, sb)

    def trigger_options(self) -> dict[str, Any]:
        return {"azure_service_bus_conn_id": self.conn_id}

    async def publish(
        self, bodies: Sequence[bytes], *, attributes: Mapping[str, Any] | None = None, **message_kwargs: Any
    ) -> None:
        """``attributes``: application properties (any AMQP type); ``message_kwargs``: ServiceBusMessage's own."""
        await self.in_thread(self.kit.send, bodies, attributes=attributes, **message_kwargs)

    async def dead_letters(self) -> list[DeadLetter]:
        """Every message of the queue's dead-letter sub-queue."""
        return await self.in_thread(self.kit.dead_letter_records)

    async def dead_lettered(self) -> list[bytes]:
        return [d.body for d in await self.dead_letters()]


@pytest.fixture
async def adapter(sb: ServiceBusEnv, sb_conn: str) -> ServiceBusAdapter:
    return ServiceBusAdapter.on(sb, sb_conn, await sb.create_queue("contract"))
