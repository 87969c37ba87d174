"""
Pub/Sub integration fixtures: Google's official emulator, and a fresh stream per test.

The emulator is started once per session on a free loopback port, unless ``PUBSUB_EMULATOR_HOST``
already points at one (then it is used as is and never stopped here). A missing emulator fails
the session with the install hint; it never skips.

How :meth:`PubSubAdapter.unsettled` counts without touching the watched subscription: every test
gets, next to the watched subscription, a *probe* subscription on the same topic, created before
anything is published (so it holds every message). To count, the adapter snapshots the watched
subscription (a snapshot holds exactly its unacknowledged messages, leased ones included), seeks
the probe to that snapshot (the probe's acked/unacked state becomes the watched one's) and pulls
the probe dry. The watched subscription is never pulled, acked or nacked by the observer, so
counting neither steals messages from the producer nor bumps their delivery attempts.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import pytest

from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
from devkit.brokers import BrokerStartError, start_pubsub_emulator

PROJECT = "shared-stream-tests"


@pytest.fixture(scope="session")
def pubsub_emulator() -> Iterator[str]:
    existing = os.environ.get("PUBSUB_EMULATOR_HOST")
    if existing:
        yield existing
        return
    try:
        handle = start_pubsub_emulator()
    except BrokerStartError as exc:
        pytest.fail(
            f"Pub/Sub integration tests need Google's emulator: {exc} "
            "(Debian package google-cloud-cli-pubsub-emulator, or `gcloud components install pubsub-emulator`)",
            pytrace=False,
        )
    try:
        yield handle.address
    finally:
        handle.stop()


@pytest.fixture(autouse=True)
def _emulator_env(pubsub_emulator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The producer (like every Google client) reads PUBSUB_EMULATOR_HOST when it builds its client.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_emulator)


class PubSubAdapter:
    """A topic, its watched subscription, a probe subscription and a dead-letter topic + subscription."""

    broker = "pubsub"

    def __init__(self, publisher: Any, subscriber: Any, *, suffix: str) -> None:
        self.publisher = publisher
        self.subscriber = subscriber
        self.topic = f"projects/{PROJECT}/topics/t-{suffix}"
        self.subscription = f"projects/{PROJECT}/subscriptions/s-{suffix}"
        self.probe = f"projects/{PROJECT}/subscriptions/probe-{suffix}"
        self.dead_letter_topic = f"projects/{PROJECT}/topics/dlt-{suffix}"
        self.dead_letter_subscription = f"projects/{PROJECT}/subscriptions/dls-{suffix}"
        self.suffix = suffix
        self._dead: list[tuple[bytes, dict[str, str]]] = []
        self._snapshots = 0
        self.created: list[tuple[str, str]] = []

    async def setup(self, **subscription: Any) -> None:
        await self.publisher.create_topic(request={"name": self.topic})
        self.created.append(("topic", self.topic))
        await self.publisher.create_topic(request={"name": self.dead_letter_topic})
        self.created.append(("topic", self.dead_letter_topic))
        await self.create_subscription(self.subscription, **{"ack_deadline_seconds": 10, **subscription})
        await self.create_subscription(self.probe, ack_deadline_seconds=600)
        await self.create_subscription(
            self.dead_letter_subscription, topic=self.dead_letter_topic, ack_deadline_seconds=600
        )

    async def create_subscription(self, name: str, *, topic: str | None = None, **fields: Any) -> None:
        await self.subscriber.create_subscription(request={"name": name, "topic": topic or self.topic, **fields})
        self.created.append(("subscription", name))

    async def teardown(self) -> None:
        for kind, name in reversed(self.created):
            try:
                if kind == "subscription":
                    await self.subscriber.delete_subscription(request={"subscription": name}, timeout=10)
                else:
                    await self.publisher.delete_topic(request={"topic": name}, timeout=10)
            except Exception:
                pass  # best-effort cleanup on a throwaway emulator

    # -- BrokerAdapter -------------------------------------------------------------------------
    def make_trigger(self, **kwargs: Any) -> PubSubSharedStreamTrigger:
        kwargs.setdefault("dead_letter_topic", self.dead_letter_topic)
        kwargs.setdefault("pull_timeout", 1.0)
        return PubSubSharedStreamTrigger(subscription=self.subscription, **kwargs)

    async def publish(
        self,
        bodies: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> list[str]:
        ids: list[str] = []
        for start in range(0, len(bodies), 500):
            messages = [
                {"data": body, "attributes": dict(attributes or {}), "ordering_key": ordering_key or ""}
                for body in bodies[start : start + 500]
            ]
            response = await self.publisher.publish(
                request={"topic": self.topic, "messages": messages}, timeout=30, retry=None
            )
            ids.extend(response.message_ids)
        return ids

    async def unsettled(self) -> int:
        """Unacked messages of the watched subscription, counted on the probe (see module doc)."""
        from google.api_core import exceptions as gexc

        self._snapshots += 1
        snapshot = f"projects/{PROJECT}/snapshots/snap-{self.suffix}-{self._snapshots}"
        await self.subscriber.create_snapshot(request={"name": snapshot, "subscription": self.subscription})
        try:
            await self.subscriber.seek(request={"subscription": self.probe, "snapshot": snapshot})
        finally:
            await self.subscriber.delete_snapshot(request={"snapshot": snapshot})
        count = 0
        while True:
            try:
                response = await self.subscriber.pull(
                    request={"subscription": self.probe, "max_messages": 1000}, timeout=0.5, retry=None
                )
            except gexc.DeadlineExceeded:
                break
            if not response.received_messages:
                break
            count += len(response.received_messages)
        return count

    async def dead_letters(self) -> list[tuple[bytes, dict[str, str]]]:
        """Every message that reached the dead-letter topic so far: ``(data, attributes)``."""
        from google.api_core import exceptions as gexc

        while True:
            try:
                response = await self.subscriber.pull(
                    request={"subscription": self.dead_letter_subscription, "max_messages": 1000},
                    timeout=0.5,
                    retry=None,
                )
            except gexc.DeadlineExceeded:
                break
            received = response.received_messages
            if not received:
                break
            self._dead.extend((bytes(r.message.data), dict(r.message.attributes)) for r in received)
            await self.subscriber.acknowledge(
                request={"subscription": self.dead_letter_subscription, "ack_ids": [r.ack_id for r in received]}
            )
        return list(self._dead)

    async def dead_lettered(self) -> list[bytes]:
        return [data for data, _ in await self.dead_letters()]


@pytest.fixture
async def pubsub_clients(pubsub_emulator: str) -> AsyncIterator[tuple[Any, Any]]:
    """Publisher and subscriber clients of the observer, independent of the producer's."""
    from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient

    publisher = PublisherAsyncClient()
    subscriber = SubscriberAsyncClient()
    try:
        yield publisher, subscriber
    finally:
        await publisher.transport.close()
        await subscriber.transport.close()
        await asyncio.sleep(0)


@pytest.fixture
async def make_adapter(pubsub_clients: tuple[Any, Any]) -> AsyncIterator[Any]:
    """Factory: ``await make_adapter(**subscription_fields)`` gives a fresh stream."""
    adapters: list[PubSubAdapter] = []

    async def make(**subscription: Any) -> PubSubAdapter:
        adapter = PubSubAdapter(*pubsub_clients, suffix=uuid.uuid4().hex[:12])
        adapters.append(adapter)
        await adapter.setup(**subscription)
        return adapter

    yield make
    for adapter in adapters:
        await adapter.teardown()


@pytest.fixture
async def adapter(make_adapter: Any) -> PubSubAdapter:
    return await make_adapter()  # type: ignore[no-any-return]
