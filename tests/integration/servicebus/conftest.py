"""
Service Bus integration fixtures: the wire-level test broker, or SERVICEBUS_CONNECTION_STRING.

Without the variable every test gets its own test broker (``tests/servicebus_broker``), a real
AMQP 1.0 endpoint the unmodified ``azure.servicebus.aio`` SDK talks to over loopback. With it, the
same tests run against the official emulator or a real namespace:

* a real namespace: each test creates a fresh queue through ``ServiceBusAdministrationClient``
  (lock duration and max delivery count as the test asks) and deletes it afterwards;
* the emulator (no administration API): set ``SERVICEBUS_QUEUE`` to a queue declared in its
  ``Config.json`` (lock duration 5 s recommended); the queue and its dead-letter queue are drained
  before each test. Tests that need a particular lock duration or max delivery count adapt to what
  the queue reports, or are skipped with the reason when they cannot.

Broker state is always asserted independently of the producer: through the test broker's
inspection API, or by peeking with a separate SDK client.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusReceiveMode, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient

from airflow_shared_stream_provider.producers.servicebus import ServiceBusSharedStreamProducer
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import record_producers
from tests.servicebus_broker.fixtures import servicebus_broker

__all__ = ["servicebus_broker"]

EXTERNAL = os.environ.get("SERVICEBUS_CONNECTION_STRING")
DEFAULT_LOCK = 5.0
DEFAULT_MAX_DELIVERY_COUNT = 10


def body_of(message: ServiceBusReceivedMessage) -> bytes:
    body = message.body
    return bytes(body) if isinstance(body, bytes | bytearray) else b"".join(body)


@dataclass
class DeadLetter:
    body: bytes
    reason: str | None
    description: str | None
    delivery_count: int


class ServiceBusEnv:
    """One namespace for one test: the test broker, or an external one. Owns one SDK client."""

    def __init__(self, connection_string: str, handle: Any | None) -> None:
        self.connection_string = connection_string
        self.handle: Any = handle  # tests.servicebus_broker.broker.BrokerHandle, or None when external
        self.client: ServiceBusClient | None = None
        self._created: list[str] = []

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
        if self._created and not self.local:
            from azure.servicebus.aio.management import ServiceBusAdministrationClient

            async with ServiceBusAdministrationClient.from_connection_string(self.connection_string) as admin:
                for name in self._created:
                    with contextlib.suppress(Exception):
                        await admin.delete_queue(name)

    # -- entities ----------------------------------------------------------------------------
    async def create_queue(
        self,
        prefix: str = "q",
        *,
        lock_duration: float = DEFAULT_LOCK,
        max_delivery_count: int = DEFAULT_MAX_DELIVERY_COUNT,
        requires_session: bool = False,
    ) -> str:
        """A fresh queue (local / real namespace) or the drained SERVICEBUS_QUEUE (emulator)."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if self.local:
            self.handle.create_queue(
                name,
                lock_duration=lock_duration,
                max_delivery_count=max_delivery_count,
                requires_session=requires_session,
            )
            return name
        fixed = os.environ.get("SERVICEBUS_QUEUE")
        if fixed and requires_session:
            pytest.skip("SERVICEBUS_QUEUE is a pre-declared queue; this test needs a session-enabled one")
        if fixed:
            await self.drain(fixed)
            await self.drain(fixed, dead_letter=True)
            return fixed
        from azure.servicebus.aio.management import ServiceBusAdministrationClient

        async with ServiceBusAdministrationClient.from_connection_string(self.connection_string) as admin:
            await admin.create_queue(
                name,
                lock_duration=timedelta(seconds=lock_duration),
                max_delivery_count=max_delivery_count,
                requires_session=requires_session,
            )
        self._created.append(name)
        return name

    # -- publishing --------------------------------------------------------------------------
    async def publish(
        self,
        queue: str,
        bodies: Sequence[bytes | str],
        *,
        attributes: Mapping[str, Any] | None = None,
        **message_kwargs: Any,
    ) -> None:
        assert self.client is not None
        properties: dict[str | bytes, Any] | None = {k: v for k, v in attributes.items()} if attributes else None
        async with self.client.get_queue_sender(queue) as sender:
            for start in range(0, len(bodies), 100):
                batch = await sender.create_message_batch()
                for body in bodies[start : start + 100]:
                    batch.add_message(ServiceBusMessage(body, application_properties=properties, **message_kwargs))
                await sender.send_messages(batch)

    # -- inspection (independent of the producer) --------------------------------------------
    async def unsettled(self, queue: str) -> int:
        """Messages still in the queue: available, locked or deferred."""
        if self.local:
            counts = self.handle.counts(queue)
            return int(counts.active + counts.locked + counts.deferred)
        return len(await self._peek(queue))

    async def dead_letters(self, queue: str) -> list[DeadLetter]:
        if self.local:
            return [
                DeadLetter(
                    body=m.body if isinstance(m.body, bytes) else bytes(m.body),
                    reason=m.dead_letter_reason,
                    description=m.dead_letter_description,
                    delivery_count=m.delivery_count,
                )
                for m in self.handle.dead_letters(queue)
            ]
        return [
            DeadLetter(body_of(m), m.dead_letter_reason, m.dead_letter_error_description, m.delivery_count or 0)
            for m in await self._peek(queue, dead_letter=True)
        ]

    async def delivery_counts(self, queue: str) -> list[int]:
        """delivery_count of every message still in the queue (by sequence number)."""
        if self.local:
            return [m.delivery_count for m in self.handle.messages(queue)]
        return [m.delivery_count or 0 for m in await self._peek(queue)]

    async def _peek(self, queue: str, *, dead_letter: bool = False) -> list[ServiceBusReceivedMessage]:
        assert self.client is not None
        sub_queue = ServiceBusSubQueue.DEAD_LETTER if dead_letter else None
        out: list[ServiceBusReceivedMessage] = []
        async with self.client.get_queue_receiver(queue, sub_queue=sub_queue) as receiver:
            while True:
                page = await receiver.peek_messages(max_message_count=250)
                if not page:
                    return out
                out.extend(page)

    async def drain(self, queue: str, *, dead_letter: bool = False) -> None:
        assert self.client is not None
        sub_queue = ServiceBusSubQueue.DEAD_LETTER if dead_letter else None
        async with self.client.get_queue_receiver(
            queue, sub_queue=sub_queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
        ) as receiver:
            while await receiver.receive_messages(max_message_count=250, max_wait_time=1):
                pass


@pytest.fixture
async def sb(request: pytest.FixtureRequest) -> AsyncIterator[ServiceBusEnv]:
    """The namespace for this test (never skipped: a test broker that does not start is an error)."""
    if EXTERNAL:
        env = ServiceBusEnv(EXTERNAL, None)
    else:
        handle = request.getfixturevalue("servicebus_broker")
        env = ServiceBusEnv(handle.connection_string, handle)
    async with env:
        yield env


@pytest.fixture
def sb_conn(sb: ServiceBusEnv, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``azure_service_bus`` Airflow connection (upstream shape: connection string in schema)."""
    conn_id = "servicebus_it"
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}",
        json.dumps({"conn_type": "azure_service_bus", "schema": sb.connection_string}),
    )
    return conn_id


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ServiceBusSharedStreamProducer]]:
    """Every producer the manager builds in this test (to read its counters)."""
    yield record_producers(monkeypatch, ServiceBusSharedStreamProducer)


class ServiceBusAdapter:
    """BrokerAdapter for the contract suite: a fresh queue per test, its $DeadLetterQueue as the DLQ."""

    broker = "servicebus"

    def __init__(self, sb: ServiceBusEnv, conn_id: str, queue: str) -> None:
        self.sb = sb
        self.conn_id = conn_id
        self.queue = queue

    def make_trigger(self, **kwargs: Any) -> ServiceBusSharedStreamTrigger:
        options: dict[str, Any] = {
            "queue_name": self.queue,
            "azure_service_bus_conn_id": self.conn_id,
            "max_wait_time": 0.5,
        }
        options.update(kwargs)
        return ServiceBusSharedStreamTrigger(**options)

    async def publish(
        self, bodies: Sequence[bytes], *, attributes: Mapping[str, Any] | None = None, **message_kwargs: Any
    ) -> None:
        """``attributes``: application properties (any AMQP type); ``message_kwargs``: ServiceBusMessage's own."""
        await self.sb.publish(self.queue, bodies, attributes=attributes, **message_kwargs)

    async def unsettled(self) -> int:
        return await self.sb.unsettled(self.queue)

    async def dead_lettered(self) -> list[bytes]:
        return [d.body for d in await self.sb.dead_letters(self.queue)]


@pytest.fixture
async def adapter(sb: ServiceBusEnv, sb_conn: str) -> ServiceBusAdapter:
    return ServiceBusAdapter(sb, sb_conn, await sb.create_queue("contract"))
