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
import json
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Imported now, not by the hypothesis plugin's terminal summary: that late import is rewritten by
# pytest (ast.parse), and on CPython 3.11.7 it sometimes failed after this module's runs with
# "SystemError: AST constructor recursion depth mismatch" (the AST recursion counter is not
# thread-safe in 3.11.7), turning a green run red after the last test.
import hypothesis  # noqa: F401
import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender
from google.api_core import exceptions as gexc

from airflow_shared_stream_provider._core.errors import BrokerUnavailableError, SharedStreamConfigError
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.brokers import BrokerProcess, BrokerStartError, pubsub_emulator_launcher
from devkit.ports import free_port, wait_for_port
from tests.faultproxy import FaultProxy
from tests.integration.faults_harness import (
    FAULTS,
    RESTART,
    SLOW_FAULTS,
    Fault,
    _slow_opt_in,
    assert_nothing_lost,
    assert_one_clear_error,
    order,
    print_fault_reports,
    run_fault,
)
from tests.integration.pubsub.conftest import PubSubAdapter
from tests.servicebus_broker.broker import BrokerHandle, start_broker

__all__ = ["_slow_opt_in", "print_fault_reports"]  # fixtures used by this module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# -- Pub/Sub: a dedicated emulator behind the proxy ------------------------------------------------
def start_emulator_on(port: int, *, timeout: float = 90.0) -> BrokerProcess:
    """Google's Pub/Sub emulator on ``127.0.0.1:port`` (a fixed port, so it can be restarted on it)."""
    log_path = Path(tempfile.mkstemp(prefix="pubsub-faults-", suffix=".log")[1])
    argv = [str(pubsub_emulator_launcher()), "--host=127.0.0.1", f"--port={port}"]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    emulator = BrokerProcess("pubsub", f"127.0.0.1:{port}", proc, log_path)
    try:
        wait_for_port(port, timeout=timeout)
    except TimeoutError as exc:
        tail = emulator.log_tail()
        emulator.stop()
        raise BrokerStartError(f"Pub/Sub emulator did not start on port {port}: {exc}\n{tail}") from exc
    return emulator


@dataclass
class PubSubFaults:
    proxy: FaultProxy
    emulator: BrokerProcess
    port: int

    @property
    def direct(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def pubsub_faults() -> Iterator[PubSubFaults]:
    port = free_port()
    faults = PubSubFaults(FaultProxy(port).start(), start_emulator_on(port), port)
    try:
        yield faults
    finally:
        faults.proxy.stop()
        faults.emulator.stop()  # the current process: a restart replaced it


def direct_clients(address: str) -> tuple[Any, Any]:
    """The test's own publisher and subscriber, straight to the emulator (never through the proxy)."""
    import grpc
    from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
    from google.pubsub_v1.services.publisher.transports import PublisherGrpcAsyncIOTransport
    from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcAsyncIOTransport

    publisher = PublisherAsyncClient(
        transport=PublisherGrpcAsyncIOTransport(channel=grpc.aio.insecure_channel(address))
    )
    subscriber = SubscriberAsyncClient(
        transport=SubscriberGrpcAsyncIOTransport(channel=grpc.aio.insecure_channel(address))
    )
    return publisher, subscriber


class PubSubTarget:
    broker = "pubsub"

    def __init__(self, faults: PubSubFaults, adapter: PubSubAdapter) -> None:
        self.faults = faults
        self.proxy = faults.proxy
        self.adapter = adapter
        self.publish_retries = 0
        self.sent: list[str] = []
        self.sent_before_restart: set[str] = set()
        self.broker_forgot = 0
        self.restarted = False
        self._ready = asyncio.Event()
        self._ready.set()

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        while True:
            await self._ready.wait()
            try:
                ids = await self.adapter.publish([order(index)])
                self.sent.extend(f"{message_id}:{index}" for message_id in ids)
                return
            except (gexc.GoogleAPICallError, gexc.RetryError, TimeoutError):
                self.publish_retries += 1  # the emulator restarting, or not re-created yet
                await asyncio.sleep(0.2)

    async def expected_ids(self) -> set[str]:
        """What the emulator holds: everything, or after a restart what was published since."""
        return set(self.sent) - self.sent_before_restart

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    def identity(self, payload: dict[str, Any]) -> str:
        """The emulator numbers messages from 1 again after a restart: the order id tells them apart."""
        return f"{payload['message_id']}:{payload['body']['order_id']}"

    async def restart(self, down: float) -> None:
        """Kill the emulator, start a new one on the same port, re-create the (lost) topics and subscriptions."""
        self._ready.clear()
        self.sent_before_restart = set(self.sent)
        self.broker_forgot = len(self.sent_before_restart)
        self.faults.emulator.stop()
        await asyncio.sleep(down)
        self.faults.emulator = await asyncio.to_thread(start_emulator_on, self.faults.port)
        self.adapter.created.clear()
        await self.adapter.setup()
        self.restarted = True
        self._ready.set()

    def note(self) -> str:
        if not self.restarted:
            return ""
        return (
            f"the emulator keeps no data: topic and subscriptions re-created; {len(self.sent_before_restart)} "
            "messages published before the restart are not checked (unacked ones died with the emulator)"
        )

    async def close(self) -> None:
        return None


@pytest.fixture
async def pubsub_target(pubsub_faults: PubSubFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[PubSubTarget]:
    pubsub_faults.proxy.heal()
    # The producer reads PUBSUB_EMULATOR_HOST when it builds its client: it goes through the proxy.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_faults.proxy.address)
    publisher, subscriber = direct_clients(pubsub_faults.direct)
    adapter = PubSubAdapter(publisher, subscriber, suffix=uuid.uuid4().hex[:12])
    await adapter.setup()
    try:
        yield PubSubTarget(pubsub_faults, adapter)
    finally:
        pubsub_faults.proxy.heal()
        await adapter.teardown()
        await publisher.transport.close()
        await subscriber.transport.close()


@pytest.mark.pubsub
@pytest.mark.parametrize("fault", FAULTS, ids=str)
async def test_pubsub_resumes_after_fault_and_loses_nothing(pubsub_target: PubSubTarget, fault: Fault) -> None:
    report = await run_fault(pubsub_target, fault)
    assert_nothing_lost(report)


@pytest.mark.pubsub
@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", SLOW_FAULTS, ids=str)
async def test_pubsub_long_faults(pubsub_target: PubSubTarget, fault: Fault) -> None:
    report = await run_fault(pubsub_target, fault)
    assert_nothing_lost(report)


@pytest.mark.pubsub
@pytest.mark.timeout(180)
async def test_pubsub_emulator_restart_recovers(pubsub_target: PubSubTarget) -> None:
    report = await run_fault(pubsub_target, RESTART)
    assert_nothing_lost(report)  # of what the emulator holds: what was published after the restart
    assert pubsub_target.restarted


@pytest.mark.pubsub
@pytest.mark.timeout(180)
async def test_pubsub_unreachable_gives_one_clear_error(
    pubsub_faults: PubSubFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FaultProxy(pubsub_faults.port) as dead:
        dead.refuse(float("inf"))
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", dead.address)
        publisher, subscriber = direct_clients(pubsub_faults.direct)
        adapter = PubSubAdapter(publisher, subscriber, suffix=uuid.uuid4().hex[:12])
        try:
            # The subscription check retries for CONNECT_TIMEOUT (20 s), then fails the group with
            # a BrokerUnavailableError that names the subscription and the endpoint.
            attempts, after, error = await assert_one_clear_error(
                dead,
                adapter.make_trigger,
                mentions=(adapter.subscription, f"emulator {dead.address}", "did not answer"),
                error_type=BrokerUnavailableError,
                error_timeout=PUBSUB_ERROR_TIMEOUT,
                max_attempts=PUBSUB_MAX_CONNECT_ATTEMPTS,
            )
        finally:
            await publisher.transport.close()
            await subscriber.transport.close()
    print(f"FAULT pubsub/unreachable: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")


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
    conn = {"conn_type": "azure_service_bus", "schema": sb_connection_string(port, key)}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


@dataclass
class ServiceBusFaults:
    proxy: FaultProxy
    broker: BrokerHandle
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def servicebus_faults() -> Iterator[ServiceBusFaults]:
    broker = start_broker(sas_keys={SAS_KEY_NAME: SAS_KEY})  # checks every SAS token, as the service does
    try:
        with FaultProxy(broker.port) as proxy:
            yield ServiceBusFaults(proxy, broker)
    finally:
        broker.stop()


class ServiceBusTarget:
    broker = "servicebus"

    def __init__(self, faults: ServiceBusFaults, conn_id: str, queue: str) -> None:
        self.faults = faults
        self.proxy = faults.proxy
        self.conn_id = conn_id
        self.queue = queue
        self.publish_retries = 0
        self.broker_forgot = 0
        self.sent: set[str] = set()
        self.restarts = 0
        self._client: ServiceBusClient | None = None
        self._sender: ServiceBusSender | None = None

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        options: dict[str, Any] = {"queue_name": self.queue, "azure_service_bus_conn_id": self.conn_id}
        options["max_wait_time"] = 0.5
        options.update(kwargs)
        return ServiceBusSharedStreamTrigger(**options)

    async def publish(self, index: int) -> None:
        message_id = f"order-{index}"
        while True:
            try:
                if self._sender is None:
                    self._client = ServiceBusClient.from_connection_string(self.faults.broker.connection_string)
                    self._sender = self._client.get_queue_sender(self.queue)
                    await asyncio.wait_for(self._sender.__aenter__(), timeout=10)
                await asyncio.wait_for(
                    self._sender.send_messages(ServiceBusMessage(order(index), message_id=message_id)), timeout=10
                )
                self.sent.add(message_id)
                return
            except Exception:  # the broker restarting: the SDK's errors, or a timeout
                self.publish_retries += 1
                await self._drop_sender()
                await asyncio.sleep(0.2)

    async def _drop_sender(self) -> None:
        sender, client, self._sender, self._client = self._sender, self._client, None, None
        for closable in (sender, client):
            if closable is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(closable.close(), timeout=5)

    async def expected_ids(self) -> set[str]:
        return set(self.sent)

    async def unsettled(self) -> int:
        counts = await asyncio.to_thread(self.faults.broker.counts, self.queue)
        return int(counts.active + counts.locked + counts.deferred)

    def identity(self, payload: dict[str, Any]) -> str:
        return str(payload["message_id"])

    async def restart(self, down: float) -> None:
        await asyncio.to_thread(self.faults.broker.restart_listener, down)
        self.restarts += 1

    def note(self) -> str:
        return "the test broker kept its entities, messages and locks" if self.restarts else ""

    async def close(self) -> None:
        await self._drop_sender()


@pytest.fixture
async def servicebus_target(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ServiceBusTarget]:
    servicebus_faults.proxy.heal()
    queue = f"faults-{uuid.uuid4().hex[:8]}"
    servicebus_faults.broker.create_queue(queue, lock_duration=5.0, max_delivery_count=10)
    conn_id = sb_connection(monkeypatch, "servicebus_faults", servicebus_faults.proxy.port)
    target = ServiceBusTarget(servicebus_faults, conn_id, queue)
    try:
        yield target
    finally:
        servicebus_faults.proxy.heal()
        await target.close()
        errors = servicebus_faults.broker.clear_errors()
        assert not errors, "the test broker recorded errors:\n" + "\n".join(map(str, errors))


@pytest.mark.servicebus
@pytest.mark.parametrize("fault", FAULTS, ids=str)
async def test_servicebus_resumes_after_fault_and_loses_nothing(
    servicebus_target: ServiceBusTarget, fault: Fault
) -> None:
    report = await run_fault(servicebus_target, fault)
    assert_nothing_lost(report)


@pytest.mark.servicebus
@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", SLOW_FAULTS, ids=str)
async def test_servicebus_long_faults(servicebus_target: ServiceBusTarget, fault: Fault) -> None:
    report = await run_fault(servicebus_target, fault)
    assert_nothing_lost(report)


@pytest.mark.servicebus
async def test_servicebus_broker_restart_keeps_its_data_and_loses_nothing(
    servicebus_target: ServiceBusTarget,
) -> None:
    report = await run_fault(servicebus_target, RESTART)
    assert_nothing_lost(report)


@pytest.mark.servicebus
async def test_servicebus_unreachable_gives_one_clear_error(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"faults-{uuid.uuid4().hex[:8]}"
    servicebus_faults.broker.create_queue(queue)
    with FaultProxy(servicebus_faults.broker.port) as dead:
        dead.refuse(float("inf"))
        conn_id = sb_connection(monkeypatch, "servicebus_faults_dead", dead.port)
        target = ServiceBusTarget(servicebus_faults, conn_id, queue)
        # The SDK's ServiceBusConnectionError (after its own retries), as a BrokerUnavailableError
        # that names the entity and the connection.
        attempts, after, error = await assert_one_clear_error(
            dead,
            target.make_trigger,
            mentions=("ServiceBusConnectionError", queue, conn_id, "could not be reached"),
            error_type=BrokerUnavailableError,
        )
    print(f"FAULT servicebus/unreachable: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")


@pytest.mark.servicebus
async def test_servicebus_bad_sas_key_gives_one_clear_error(
    servicebus_faults: ServiceBusFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"faults-{uuid.uuid4().hex[:8]}"
    servicebus_faults.broker.create_queue(queue)
    conn_id = sb_connection(monkeypatch, "servicebus_faults_badkey", servicebus_faults.proxy.port, key="wrong")
    target = ServiceBusTarget(servicebus_faults, conn_id, queue)
    attempts, after, error = await assert_one_clear_error(
        servicebus_faults.proxy,
        target.make_trigger,
        mentions=("ServiceBusAuthenticationError", queue, conn_id),
        error_type=SharedStreamConfigError,
    )
    print(f"FAULT servicebus/bad-sas-key: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")
