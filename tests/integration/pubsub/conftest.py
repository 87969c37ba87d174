"""
Pub/Sub integration fixtures: Google's official emulator, and a fresh stream per test.

The Pub/Sub kit (``devkit.kits.pubsub.PubSubKit``) starts the emulator once per session on a free
loopback port, unless ``PUBSUB_EMULATOR_HOST`` already points at one (then it is used as is and
never stopped here). A missing emulator fails the session with the install hint; it never skips.

How :meth:`PubSubAdapter.unsettled` counts without touching the watched subscription: the kit
stream's probe (``PubSubOrders.unacked``), a second subscription on the same topic, created before
anything is published, sought to a snapshot of the watched one and pulled dry. The watched
subscription is never pulled, acked or nacked by the observer, so counting neither steals messages
from the producer nor bumps their delivery attempts.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
from devkit.brokers import BrokerStartError
from devkit.kits.pubsub import EMULATOR_ENV, PubSubKit, PubSubOrders
from tests.integration.contract import KitAdapter, cleaned_up

PROJECT = "shared-stream-tests"


@pytest.fixture(scope="session")
def pubsub_emulator() -> Iterator[str]:
    """The emulator's address: PUBSUB_EMULATOR_HOST's, else one the kit starts here (never skipped)."""
    # set_env=False: each test sets the variable (below), the session's environment stays as it was.
    kit = PubSubKit(own=False, project=PROJECT, set_env=False)
    try:
        kit.start()
    except BrokerStartError as exc:
        pytest.fail(
            f"Pub/Sub integration tests need Google's emulator: {exc} "
            "(Debian package google-cloud-cli-pubsub-emulator, or `gcloud components install pubsub-emulator`)",
            pytrace=False,
        )
    try:
        yield kit.address
    finally:
        kit.stop()


@pytest.fixture(autouse=True)
def _emulator_env(pubsub_emulator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The producer (like every Google client) reads PUBSUB_EMULATOR_HOST when it builds its client.
    monkeypatch.setenv(EMULATOR_ENV, pubsub_emulator)


class PubSubAdapter(KitAdapter[PubSubOrders, PubSubSharedStreamTrigger]):
    """
    A topic, its watched subscription, a probe subscription and a dead-letter topic + subscription:
    the kit's stream (creation, publishing, the unacked count, dead letters, deletion). The async
    ``subscriber`` is kept for the pulls only Pub/Sub-only tests make.
    """

    broker = "pubsub"
    trigger_class = PubSubSharedStreamTrigger
    quick: ClassVar[dict[str, Any]] = {"pull_timeout": 1.0}

    def __init__(self, subscriber: Any | None, kit: PubSubOrders) -> None:
        # The triggers name no connection: the producer finds the emulator through PUBSUB_EMULATOR_HOST.
        super().__init__(kit, conn_id="")
        self.subscriber = subscriber
        self.topic = kit.topic
        self.subscription = kit.subscription
        self.dead_letter_topic = kit.dlq_topic

    @classmethod
    def fresh(cls, subscriber: Any | None, emulator: str, *, create: bool = True, **subscription: Any) -> PubSubAdapter:
        """A fresh stream (random names) on ``emulator`` (``subscription``: the watched subscription's fields)."""
        ack_deadline = subscription.pop("ack_deadline_seconds", 10)
        kit = PubSubOrders(
            PROJECT,
            name=f"it-{uuid.uuid4().hex[:12]}",
            ack_deadline=ack_deadline,
            subscription_fields=subscription,
            emulator_host=emulator,
            create=create,
        )
        return cls(subscriber, kit)

    def trigger_options(self) -> dict[str, Any]:
        return {"dead_letter_topic": self.dead_letter_topic}

    async def setup(self) -> None:
        """Create the topics and subscriptions (again: after an emulator restart)."""
        await self.in_thread(self.kit.create)

    async def cleanup(self) -> None:
        """Delete them (best effort) and close the kit stream's clients."""
        await self.in_thread(self.kit.delete)
        await self.in_thread(self.kit.close)

    async def publish(
        self,
        bodies: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> list[str]:
        return await self.in_thread(self.kit.publish_messages, bodies, attributes=attributes, ordering_key=ordering_key)

    async def dead_letters(self) -> list[tuple[bytes, dict[str, str]]]:
        """Every message that reached the dead-letter topic so far: ``(data, attributes)``."""
        return await self.in_thread(self.kit.dead_letter_messages)

    async def dead_lettered(self) -> list[bytes]:
        return [data for data, _ in await self.dead_letters()]


@pytest.fixture
async def pubsub_subscriber(pubsub_emulator: str) -> AsyncIterator[Any]:
    """The async subscriber of the Pub/Sub-only tests' pulls, independent of the producer's."""
    from google.pubsub_v1 import SubscriberAsyncClient

    subscriber = SubscriberAsyncClient()
    try:
        yield subscriber
    finally:
        await subscriber.transport.close()
        await asyncio.sleep(0)


@pytest.fixture
async def make_adapter(pubsub_subscriber: Any, pubsub_emulator: str) -> AsyncIterator[Any]:
    """Factory: ``await make_adapter(**subscription_fields)`` gives a fresh stream, deleted afterwards."""

    async def make(**subscription: Any) -> PubSubAdapter:
        return await asyncio.to_thread(PubSubAdapter.fresh, pubsub_subscriber, pubsub_emulator, **subscription)

    async with cleaned_up(make) as tracked:
        yield tracked


@pytest.fixture
async def adapter(make_adapter: Any) -> PubSubAdapter:
    return await make_adapter()  # type: ignore[no-any-return]
