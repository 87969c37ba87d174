"""
The Pub/Sub test kit: Google's emulator (``devkit.brokers.start_pubsub_emulator``), or the one
``PUBSUB_EMULATOR_HOST`` names, the ``google_cloud_platform`` connection, and :class:`PubSubOrders`,
one topic with its watched subscription and a dead-letter topic.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

from devkit.brokers import BrokerProcess, start_pubsub_emulator
from devkit.demo_types import OrderMessage
from devkit.kits import BrokerKit, Item, KitStream

PUBSUB_PROJECT: Final = "shared-stream-demo"
PUBSUB_CONN_ID: Final = "google_cloud_default"
EMULATOR_ENV: Final = "PUBSUB_EMULATOR_HOST"
DEAD_LETTER_REASON: Final = "x-dead-letter-reason"
DEAD_LETTER_MESSAGE_ID: Final = "x-dead-letter-message-id"


def pubsub_connection(project: str = PUBSUB_PROJECT) -> dict[str, Any]:
    return {"conn_type": "google_cloud_platform", "extra": {"project": project}}


def pubsub_clients(emulator_host: str | None = None) -> tuple[Any, Any]:
    """
    A sync publisher and subscriber of the emulator at ``emulator_host`` (None: the one
    ``PUBSUB_EMULATOR_HOST`` names, if any), on channels without gRPC's 4 MiB receive limit, as
    the producer's (``producers/pubsub_client.py``): a probe pulls a 10 MB message too. Without
    an emulator, Google's default clients.
    """
    from google.pubsub_v1 import PublisherClient, SubscriberClient

    host = emulator_host or os.environ.get(EMULATOR_ENV)
    if not host:
        return PublisherClient(), SubscriberClient()
    import grpc
    from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
    from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    return (
        PublisherClient(transport=PublisherGrpcTransport(channel=grpc.insecure_channel(host, options=options))),
        SubscriberClient(transport=SubscriberGrpcTransport(channel=grpc.insecure_channel(host, options=options))),
    )


class PubSubOrders(KitStream):
    """
    A topic, its watched subscription and the dead-letter topic on a Pub/Sub endpoint (the
    emulator at ``emulator_host``, by default the one ``PUBSUB_EMULATOR_HOST`` names when this is
    built), created (``create=False``: later, :meth:`create`) and read with sync clients (the
    integration tests call them from a worker thread). ``subscription_fields``: further fields of
    the watched subscription (message ordering, a dead-letter policy, ...).

    How :meth:`unacked` counts without touching the watched subscription: a *probe* subscription
    on the same topic, created before anything is published, is sought to a snapshot of the
    watched one (a snapshot holds exactly its unacknowledged messages, leased ones included) and
    pulled dry. The watched subscription is never pulled, so counting neither steals messages from
    the triggerer nor bumps their delivery attempts. ``probe=False`` leaves it out (and
    :meth:`unacked` with it): a benchmark's emulator then keeps one copy of each message.
    """

    source_field = "subscription"
    source_arg = "subscription"

    def __init__(
        self,
        project: str = PUBSUB_PROJECT,
        *,
        name: str = "orders",
        subscription: str | None = None,
        ack_deadline: int = 30,
        probe: bool = True,
        subscription_fields: Mapping[str, Any] | None = None,
        emulator_host: str | None = None,
        create: bool = True,
    ) -> None:
        self.publisher, self.subscriber = pubsub_clients(emulator_host)
        self.ack_deadline = ack_deadline
        self.subscription_fields = dict(subscription_fields or {})
        self.topic = f"projects/{project}/topics/{name}"
        self.subscription = f"projects/{project}/subscriptions/{subscription or f'{name}-airflow'}"
        self.probe = f"projects/{project}/subscriptions/{name}-probe" if probe else None
        self.dlq_topic = f"projects/{project}/topics/{name}-dlq"
        self.dlq_subscription = f"projects/{project}/subscriptions/{name}-dlq-reader"
        self._snapshot_base = f"projects/{project}/snapshots/{name}"
        self._snapshots = 0
        self.published: list[str] = []
        self.dead: dict[str, str] = {}
        # Every message the dead-letter topic received, as (data, attributes), in the order read.
        self.dead_messages: list[tuple[bytes, dict[str, str]]] = []
        self._lock = threading.Lock()
        if create:
            self.create()

    def create(self) -> None:
        """Create the topics and subscriptions (the probe before anything is published)."""
        for topic in (self.topic, self.dlq_topic):
            self.publisher.create_topic(request={"name": topic})
        for sub, topic, fields in (
            (self.subscription, self.topic, {"ack_deadline_seconds": self.ack_deadline, **self.subscription_fields}),
            (self.probe, self.topic, {"ack_deadline_seconds": 600}),
            (self.dlq_subscription, self.dlq_topic, {"ack_deadline_seconds": 600}),
        ):
            if sub is not None:
                self.subscriber.create_subscription(request={"name": sub, "topic": topic, **fields})

    def delete(self) -> None:
        """Delete the subscriptions and topics (best effort: a throwaway emulator)."""
        deletions = [
            *((self.subscriber.delete_subscription, {"subscription": s}) for s in self._subscriptions()),
            *((self.publisher.delete_topic, {"topic": t}) for t in (self.dlq_topic, self.topic)),
        ]
        for delete, request in deletions:
            with contextlib.suppress(Exception):
                delete(request=request, timeout=10)

    def close(self) -> None:
        """Close the clients' channels."""
        self.publisher.transport.close()
        self.subscriber.transport.close()

    def _subscriptions(self) -> list[str]:
        return [s for s in (self.dlq_subscription, self.probe, self.subscription) if s is not None]

    chunk_size = 500

    def _send(self, chunk: list[Item]) -> list[str]:
        """One publish request (Pub/Sub has no key here); the message ids."""
        request = {"topic": self.topic, "messages": [{"data": body} for body, _ in chunk]}
        return list(self.publisher.publish(request=request, timeout=60).message_ids)

    def publish_messages(
        self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None, ordering_key: str | None = None
    ) -> list[str]:
        """
        Publish ``bodies`` in order, each with ``attributes`` and ``ordering_key``, :attr:`chunk_size`
        per request, each tried once (a failure raises: the caller decides on a retry); the message ids.
        """
        ids: list[str] = []
        for start in range(0, len(bodies), self.chunk_size):
            messages = [
                {"data": body, "attributes": dict(attributes or {}), "ordering_key": ordering_key or ""}
                for body in bodies[start : start + self.chunk_size]
            ]
            response = self.publisher.publish(
                request={"topic": self.topic, "messages": messages}, timeout=30, retry=None
            )
            ids.extend(response.message_ids)
        return ids

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> list[str]:
        """Publish in order (one request per message when ``rate`` paces them); return the message ids."""
        ids: list[str] = []

        def record(_: Sequence[OrderMessage], sent: list[str]) -> None:
            ids.extend(sent)
            with self._lock:
                self.published.extend(sent)

        self.publish_orders(messages, record, rate=rate, stop=stop, keys=False)
        return ids

    def _pull_all(self, subscription: str) -> list[Any]:
        from google.api_core import exceptions as gexc

        received: list[Any] = []
        while True:
            try:
                response = self.subscriber.pull(
                    request={"subscription": subscription, "max_messages": 1000}, timeout=0.5
                )
            except gexc.DeadlineExceeded:
                return received
            if not response.received_messages:
                return received
            received.extend(response.received_messages)

    def unacked(self) -> int:
        """Unacknowledged messages of the watched subscription (see the class doc)."""
        return len(self.unacked_ids())

    def unacked_ids(self) -> set[str]:
        """The message ids of :meth:`unacked`'s messages."""
        if self.probe is None:
            raise RuntimeError(f"{self.subscription}: built without a probe subscription (probe=False)")
        self._snapshots += 1
        snapshot = f"{self._snapshot_base}-{self._snapshots}"
        self.subscriber.create_snapshot(request={"name": snapshot, "subscription": self.subscription})
        try:
            self.subscriber.seek(request={"subscription": self.probe, "snapshot": snapshot})
        finally:
            self.subscriber.delete_snapshot(request={"snapshot": snapshot})
        # The probe's messages stay unacked (its deadline is long): the next seek resets it anyway.
        return {r.message.message_id for r in self._pull_all(self.probe)}

    def dead_letter_messages(self) -> list[tuple[bytes, dict[str, str]]]:
        """Every message the dead-letter topic received so far, ``(data, attributes)`` (read and acked once)."""
        received = self._pull_all(self.dlq_subscription)
        for r in received:
            attributes = dict(r.message.attributes)
            self.dead_messages.append((bytes(r.message.data), attributes))
            self.dead[attributes.get(DEAD_LETTER_MESSAGE_ID, r.message.message_id)] = attributes.get(
                DEAD_LETTER_REASON, ""
            )
        if received:
            self.subscriber.acknowledge(
                request={"subscription": self.dlq_subscription, "ack_ids": [r.ack_id for r in received]}
            )
        return list(self.dead_messages)

    def dead_letters(self) -> dict[str, str]:
        """``source message id -> x-dead-letter-reason``, accumulated over every read of the DLQ."""
        self.dead_letter_messages()
        return dict(self.dead)

    def unsettled(self) -> int:
        return self.unacked()

    def diagnostics(self) -> str:
        return f"{self.unacked()} message(s) unacknowledged in {self.subscription}"


class PubSubKit(BrokerKit):
    """
    Google's emulator on a free loopback port, or the one ``PUBSUB_EMULATOR_HOST`` names when not
    ``own``. Google's clients find the emulator through that variable, read when a client is
    built: :meth:`start` sets it in this process and :meth:`stop` restores it.
    """

    name = "pubsub"
    address_env = EMULATOR_ENV

    def __init__(self, *, own: bool | None = None, project: str = PUBSUB_PROJECT, set_env: bool = True) -> None:
        super().__init__(own=own)
        self.project = project
        # False: the process environment is left alone (the caller sets the variable where its
        # clients need it, as the integration tests do per test; the kit's streams are given the address).
        self.set_env = set_env
        self.process: BrokerProcess | None = None
        self._saved_env: str | None = None
        self._env_set = False

    def _start_own(self) -> str:
        self.process = start_pubsub_emulator()
        self.address = self.process.address
        if self.set_env:
            self._saved_env, self._env_set = os.environ.get(EMULATOR_ENV), True
            os.environ[EMULATOR_ENV] = self.address
        return f"Pub/Sub emulator {self.address}"

    def stop(self) -> None:
        if self._env_set:
            if self._saved_env is None:
                os.environ.pop(EMULATOR_ENV, None)
            else:
                os.environ[EMULATOR_ENV] = self._saved_env
            self._env_set = False
        if self.process is not None:
            self.process.stop()
            self.process = None

    def connection(self) -> dict[str, Any]:
        return pubsub_connection(self.project)

    def env(self) -> dict[str, str]:
        return {EMULATOR_ENV: self.address}

    def stream(self, name: str, **options: Any) -> PubSubOrders:
        """
        Topic ``name``, its subscription (``<name>-airflow`` by default) and dead-letter topic, created
        on the kit's emulator; ``options``: :class:`PubSubOrders`' (``subscription``, ``ack_deadline``,
        ``probe``, ``subscription_fields``).
        """
        return PubSubOrders(self.project, name=name, emulator_host=self.address, **options)
