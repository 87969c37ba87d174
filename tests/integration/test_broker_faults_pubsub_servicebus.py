"""
Broker faults for Pub/Sub (Google's emulator, gRPC) and Service Bus (the wire-level test broker, AMQP).

The same scenario as ``test_broker_faults.py`` (Kafka, SQS), from ``faults_harness``: a steady
stream into the real ``SharedStreamManager`` with three watchers, one fault mid-stream through a
loopback :class:`~tests.faultproxy.FaultProxy` (reset, 5 s stall, 5 s refusal), then the checks:
delivery resumes (by itself, or after the triggerer re-creates the failed watchers), nothing lost
per watcher, the broker ends settled, duplicates counted and printed.

* **Pub/Sub**: a dedicated emulator; the producer reaches it through the proxy
  (``PUBSUB_EMULATOR_HOST`` is the proxy), the test's publisher and observer talk to it directly.
* **Service Bus**: a dedicated test broker; the producer's connection string names the proxy
  (``UseDevelopmentEmulator=true``: plain AMQP on that port), the publisher talks to the broker.

Broker restarts (``restart``): the broker is stopped and started again on the same port mid-stream.

* The **Service Bus** test broker closes its listener and every connection and listens again,
  keeping entities, messages and locks (``BrokerHandle.restart_listener``): lost 0 is checked for
  everything published.
* The **Pub/Sub emulator keeps no data**: it has no persistence option (``--help``: host, port,
  iam_host, iam_port, projects; the ``--data-dir`` the devkit passes is ignored), so after a restart
  it is empty. The test re-creates the topic and subscriptions (as a deployment would) and checks
  what can be checked: the producer recovers, and every message published after the re-creation
  reaches every watcher; the messages the emulator dropped are counted in the report line.

And a stream that cannot connect fails with one error after a bounded number of attempts.

Run with ``-s`` to see the ``FAULT pubsub/...`` and ``FAULT servicebus/...`` lines.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

# Imported now, not by the hypothesis plugin's terminal summary: that late import is rewritten by
# pytest (ast.parse), and on CPython 3.11.7 it sometimes failed after this module's runs with
# "SystemError: AST constructor recursion depth mismatch" (a parse nested in another by a
# finalizer; tests/ast_guard.py now retries such a parse test-wide), turning a green run red after the last test.
import hypothesis  # noqa: F401
import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender
from google.api_core import exceptions as gexc

from airflow_shared_stream_provider._core.errors import BrokerUnavailableError, SharedStreamConfigError
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from devkit.brokers import BrokerProcess, start_pubsub_emulator
from devkit.kits.servicebus import ServiceBusKit, servicebus_connection
from devkit.ports import free_port
from tests.faultproxy import FaultProxy
from tests.integration import faults_harness as harness
from tests.integration.faults_harness import _slow_opt_in, print_fault_reports
from tests.integration.pubsub.conftest import PubSubAdapter
from tests.integration.servicebus.conftest import ServiceBusAdapter
from tests.servicebus_broker.broker import BrokerHandle, start_broker

__all__ = ["_slow_opt_in", "print_fault_reports"]  # fixtures used by this module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# -- Pub/Sub: a dedicated emulator behind the proxy ------------------------------------------------
@dataclass
class PubSubFaults:
    proxy: FaultProxy
    emulator: BrokerProcess
    port: int
    """The emulator's port: fixed, so that it can be restarted behind the same proxy."""

    @property
    def direct(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def pubsub_faults() -> Iterator[PubSubFaults]:
    port = free_port()
    faults = PubSubFaults(FaultProxy(port).start(), start_pubsub_emulator(port=port), port)
    try:
        yield faults
    finally:
        faults.proxy.stop()
        faults.emulator.stop()  # the current process: a restart replaced it


@contextlib.asynccontextmanager
async def pubsub_adapter(faults: PubSubFaults) -> AsyncIterator[PubSubAdapter]:
    """
    An adapter with fresh topic and subscription names (not created yet), its kit stream's clients
    straight to the emulator, never through the proxy (closed after).
    """
    adapter = PubSubAdapter.fresh(None, faults.direct, create=False)
    try:
        yield adapter
    finally:
        await adapter.in_thread(adapter.kit.close)


class PubSubTarget(harness.FaultTargetBase):
    broker = "pubsub"

    def __init__(self, faults: PubSubFaults, adapter: PubSubAdapter) -> None:
        super().__init__(faults.proxy)
        self.faults = faults
        self.adapter = adapter
        self.sent_before_restart: set[str] = set()
        self._ready = asyncio.Event()
        self._ready.set()
        self._emulator_generation = 0  # +1 at each restart: which emulator a publish went to

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        async def send() -> list[str]:
            await self._ready.wait()
            generation = self._emulator_generation
            ids = await self.adapter.publish([harness.order(index)])
            if generation != self._emulator_generation:
                # Sent to the emulator that was killed meanwhile: acked by it, gone with it (the
                # restart's snapshot of what was sent was taken before this coroutine resumed).
                # Not checked, like everything published before the restart.
                self.sent_before_restart.update(f"{message_id}:{index}" for message_id in ids)
                self.broker_forgot = len(self.sent_before_restart)
            return ids

        # Failures: the emulator restarting, or its topic not re-created yet.
        ids = await self.publish_retrying(send, (gexc.GoogleAPICallError, gexc.RetryError, TimeoutError))
        self.sent.update(f"{message_id}:{index}" for message_id in ids)

    async def expected_ids(self) -> set[str]:
        """What the emulator holds: everything, or after a restart what was published since."""
        return self.sent - self.sent_before_restart

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    def identity(self, payload: dict[str, Any]) -> str:
        """The emulator numbers messages from 1 again after a restart: the order id tells them apart."""
        return f"{payload['message_id']}:{payload['body']['order_id']}"

    async def restart(self, down: float) -> None:
        """Kill the emulator, start a new one on the same port, re-create the (lost) topics and subscriptions."""
        self._ready.clear()
        self._emulator_generation += 1
        self.sent_before_restart = set(self.sent)
        self.broker_forgot = len(self.sent_before_restart)
        self.faults.emulator.stop()
        await asyncio.sleep(down)
        self.faults.emulator = await asyncio.to_thread(start_pubsub_emulator, port=self.faults.port)
        await self.adapter.setup()
        self.restarts += 1
        self._ready.set()

    def note(self) -> str:
        if not self.restarts:
            return ""
        return (
            f"the emulator keeps no data: topic and subscriptions re-created; {len(self.sent_before_restart)} "
            "messages published before the restart are not checked (unacked ones died with the emulator)"
        )


@pytest.fixture
async def pubsub_target(pubsub_faults: PubSubFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[PubSubTarget]:
    # The producer reads PUBSUB_EMULATOR_HOST when it builds its client: it goes through the proxy.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_faults.proxy.address)
    async with pubsub_adapter(pubsub_faults) as adapter:
        await adapter.setup()
        try:
            yield PubSubTarget(pubsub_faults, adapter)
        finally:
            await adapter.in_thread(adapter.kit.delete)


@pytest.mark.pubsub
@harness.fault_variants
async def test_pubsub_resumes_after_fault_and_loses_nothing(pubsub_target: PubSubTarget, fault: harness.Fault) -> None:
    await harness.assert_fault_loses_nothing(pubsub_target, fault)


@pytest.mark.pubsub
@harness.long_fault_variants
async def test_pubsub_long_faults(pubsub_target: PubSubTarget, fault: harness.Fault) -> None:
    await harness.assert_fault_loses_nothing(pubsub_target, fault)


@pytest.mark.pubsub
@pytest.mark.timeout(180)
async def test_pubsub_emulator_restart_recovers(pubsub_target: PubSubTarget) -> None:
    # Nothing lost of what the emulator holds: what was published after the restart.
    await harness.assert_fault_loses_nothing(pubsub_target, harness.RESTART)
    assert pubsub_target.restarts


@pytest.mark.pubsub
@pytest.mark.timeout(180)
async def test_pubsub_unreachable_gives_one_clear_error(
    pubsub_faults: PubSubFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    with harness.unreachable(pubsub_faults.port) as dead:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", dead.address)
        async with pubsub_adapter(pubsub_faults) as adapter:
            # The subscription check retries for CONNECT_TIMEOUT (20 s), then fails the group with
            # a BrokerUnavailableError that names the subscription and the endpoint.
            await harness.assert_one_clear_error(
                "pubsub/unreachable",
                dead,
                adapter.make_trigger,
                mentions=(adapter.subscription, f"emulator {dead.address}", "did not answer"),
                error_type=BrokerUnavailableError,
                error_timeout=PUBSUB_ERROR_TIMEOUT,
                max_attempts=PUBSUB_MAX_CONNECT_ATTEMPTS,
            )


PUBSUB_ERROR_TIMEOUT = 60.0
"""The producer's subscription check gives an unreachable endpoint 20 s (CONNECT_TIMEOUT), retries included."""
PUBSUB_MAX_CONNECT_ATTEMPTS = 16
"""gRPC reconnects with its own backoff (1 s, x1.6, jittered): 8 attempts measured in 60 s."""


# -- Service Bus: the test broker behind the proxy -------------------------------------------------
SAS_KEY_NAME = "RootManageSharedAccessKey"
SAS_KEY = "SAS_KEY_VALUE"  # the key of BrokerHandle.connection_string


def sb_connection_string(port: int, key: str = SAS_KEY) -> str:
    return (
        f"Endpoint=sb://127.0.0.1:{port};SharedAccessKeyName={SAS_KEY_NAME};SharedAccessKey={key};"
        "UseDevelopmentEmulator=true;"
    )


def sb_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, port: int, key: str = SAS_KEY) -> str:
    return harness.set_connection(monkeypatch, conn_id, servicebus_connection(sb_connection_string(port, key)))


@dataclass
class ServiceBusFaults:
    proxy: FaultProxy
    broker: BrokerHandle

    def new_queue(self, conn_id: str, **options: Any) -> ServiceBusAdapter:
        """
        A fresh queue on the test broker, made by the Service Bus kit (``options``: its lock duration,
        max delivery count...), and its adapter; the triggers use ``conn_id``.
        """
        kit = ServiceBusKit(handle=self.broker).stream(f"faults-{uuid.uuid4().hex[:8]}", **options)
        return ServiceBusAdapter(kit, conn_id)


@pytest.fixture(scope="module")
def servicebus_faults() -> Iterator[ServiceBusFaults]:
    broker = start_broker(sas_keys={SAS_KEY_NAME: SAS_KEY})  # checks every SAS token, as the service does
    try:
        with FaultProxy(broker.port) as proxy:
            yield ServiceBusFaults(proxy, broker)
    finally:
        broker.stop()


class ServiceBusTarget(harness.FaultTargetBase):
    broker = "servicebus"
    kept_on_restart = "the test broker kept its entities, messages and locks"

    def __init__(self, faults: ServiceBusFaults, adapter: ServiceBusAdapter) -> None:
        super().__init__(faults.proxy)
        self.faults = faults
        self.adapter = adapter
        self.queue = adapter.queue
        self._client: ServiceBusClient | None = None
        self._sender: ServiceBusSender | None = None

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        message_id = f"order-{index}"

        async def send() -> None:
            if self._sender is None:
                self._client = ServiceBusClient.from_connection_string(self.faults.broker.connection_string)
                self._sender = self._client.get_queue_sender(self.queue)
                await asyncio.wait_for(self._sender.__aenter__(), timeout=10)
            await asyncio.wait_for(
                self._sender.send_messages(ServiceBusMessage(harness.order(index), message_id=message_id)), timeout=10
            )

        # Any failure: the broker restarting (the SDK's errors, or a timeout).
        await self.publish_retrying(send, (Exception,), before_retry=self._drop_sender)
        self.sent.add(message_id)

    async def _drop_sender(self) -> None:
        sender, client, self._sender, self._client = self._sender, self._client, None, None
        for closable in (sender, client):
            if closable is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(closable.close(), timeout=5)

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    async def restart(self, down: float) -> None:
        await asyncio.to_thread(self.faults.broker.restart_listener, down)
        self.restarts += 1

    async def close(self) -> None:
        await self._drop_sender()


@pytest.fixture
async def servicebus_target(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ServiceBusTarget]:
    conn_id = sb_connection(monkeypatch, "servicebus_faults", servicebus_faults.proxy.port)
    target = ServiceBusTarget(servicebus_faults, servicebus_faults.new_queue(conn_id, lock_duration=5.0))
    try:
        yield target
    finally:
        await target.close()
        errors = servicebus_faults.broker.clear_errors()
        assert not errors, "the test broker recorded errors:\n" + "\n".join(map(str, errors))


@pytest.mark.servicebus
@harness.fault_variants
async def test_servicebus_resumes_after_fault_and_loses_nothing(
    servicebus_target: ServiceBusTarget, fault: harness.Fault
) -> None:
    await harness.assert_fault_loses_nothing(servicebus_target, fault)


@pytest.mark.servicebus
@harness.long_fault_variants
async def test_servicebus_long_faults(servicebus_target: ServiceBusTarget, fault: harness.Fault) -> None:
    await harness.assert_fault_loses_nothing(servicebus_target, fault)


@pytest.mark.servicebus
async def test_servicebus_broker_restart_keeps_its_data_and_loses_nothing(
    servicebus_target: ServiceBusTarget,
) -> None:
    await harness.assert_fault_loses_nothing(servicebus_target, harness.RESTART)


@pytest.mark.servicebus
async def test_servicebus_unreachable_gives_one_clear_error(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    with harness.unreachable(servicebus_faults.broker.port) as dead:
        conn_id = sb_connection(monkeypatch, "servicebus_faults_dead", dead.port)
        target = ServiceBusTarget(servicebus_faults, servicebus_faults.new_queue(conn_id))
        queue = target.queue
        # The SDK's ServiceBusConnectionError (after its own retries), as a BrokerUnavailableError
        # that names the entity and the connection.
        await harness.assert_one_clear_error(
            "servicebus/unreachable",
            dead,
            target.make_trigger,
            mentions=("ServiceBusConnectionError", queue, conn_id, "could not be reached"),
            error_type=BrokerUnavailableError,
        )


@pytest.mark.servicebus
async def test_servicebus_bad_sas_key_gives_one_clear_error(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn_id = sb_connection(monkeypatch, "servicebus_faults_badkey", servicebus_faults.proxy.port, key="wrong")
    target = ServiceBusTarget(servicebus_faults, servicebus_faults.new_queue(conn_id))
    queue = target.queue
    await harness.assert_one_clear_error(
        "servicebus/bad-sas-key",
        servicebus_faults.proxy,
        target.make_trigger,
        mentions=("ServiceBusAuthenticationError", queue, conn_id),
        error_type=SharedStreamConfigError,
    )
