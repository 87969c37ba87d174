"""
Broker faults through a loopback TCP fault proxy (tests/faultproxy.py), Kafka (Tansu) and SQS (moto).

The scenario and its checks are ``faults_harness`` (shared with
``test_broker_faults_pubsub_servicebus.py``): each broker's consumer connection goes through a
:class:`~tests.faultproxy.FaultProxy`; a steady stream is published while the real
``SharedStreamManager`` (driven by ``RunnerSim``, persist confirmations every 50 ms) feeds several
watchers, and one fault is injected mid-stream:

* ``reset``: every open connection is reset at once (RST);
* ``stall``: no byte flows either way for 5 s, connections kept;
* ``refuse``: every connection is reset and reconnects are refused for 5 s;
* ``restart`` (SQS): moto's server is stopped and started again on the same port; its backend is
  in-process, so queues, messages and receipt handles survive.
* ``restart`` (Kafka): a Tansu that stores in S3 (``--storage-engine s3://``, a moto server as the
  object store) is stopped and started again on the same port; topics, records and committed
  offsets survive. (This Tansu build has no other persistent engine: ``sqlite://`` and
  ``postgres://`` answer ``FeatureNotEnabled``.)

Then the proxy heals. The property, per broker and fault:

* delivery resumes, either by itself, or (when the producer fails its group loudly) after the
  failed watchers are re-created the way the triggerer re-creates failed triggers; which one
  happened is recorded in the printed report line;
* nothing is lost: every watcher has every message id at least once, and the broker ends settled
  (no message left uncommitted / undeleted);
* duplicates are counted and printed (delivery is at least once).

And a stream that cannot connect (unreachable endpoint, bad credentials) fails with one clear
error, making a bounded number of connection attempts (counted at the proxy), not a hot loop.

Regressions: an SQS outage past the receive loop's error streak is a ``BrokerUnavailableError``,
not a ``SharedStreamConfigError``; Kafka reconnects at most a few times a second while refused
(``retry_backoff_ms`` defaults to 1 s, ``kafka_config.DEFAULT_RETRY_BACKOFF_MS``).

Kafka clients connect to the address the broker *advertises*, so Kafka runs on a dedicated Tansu
whose advertised listener is the proxy (``start_kafka(advertised_port=...)``); its publisher goes through the
proxy too (it rides the faults out by retrying), and the expected message ids are read back from
the topic afterwards. The SQS publisher talks to moto directly; only the producer's ``aws``
connection (``endpoint_url``) points at the proxy.

Run with ``-s`` to see the report lines (``FAULT kafka/reset: ...``). The long variants (eight
resets, a 45 s stall, a 40 s refusal) are marked ``slow`` and run only with ``-m slow`` or
BROKER_FAULTS_SLOW=1 (about 4.5 min); the default run takes about 2 min.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiobotocore.session import get_session
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from botocore.exceptions import BotoCoreError, ClientError

from airflow_shared_stream_provider._core.errors import BrokerUnavailableError, SharedStreamConfigError
from airflow_shared_stream_provider._core.retry import Backoff
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from airflow_shared_stream_provider.producers import sqs as sqs_producer
from airflow_shared_stream_provider.producers.kafka_config import DEFAULT_RETRY_BACKOFF_MS, kafka_client_config
from devkit.brokers import BrokerProcess, start_kafka, start_moto, stop_moto
from devkit.kits.kafka import read_partitions, s3_storage
from devkit.kits.sqs import sqs_connection as kit_sqs_connection
from devkit.ports import free_port
from tests.faultproxy import FaultProxy
from tests.integration import faults_harness as harness
from tests.integration.faults_harness import _slow_opt_in, print_fault_reports
from tests.integration.kafka.conftest import KafkaAdapter, kafka_it_connection
from tests.integration.sqs.conftest import SqsAdapter

__all__ = ["_slow_opt_in", "print_fault_reports"]  # fixtures used by this module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# -- Kafka: a dedicated Tansu advertising the proxy --------------------------------------------
@dataclass
class KafkaFaults:
    proxy: FaultProxy
    broker: BrokerProcess
    start_broker: Callable[[], BrokerProcess] | None = None
    """Starts the broker again on the same port with the same data; None: it keeps none (memory)."""


@contextlib.contextmanager
def tansu_behind_proxy(**storage: Any) -> Iterator[KafkaFaults]:
    """
    A Tansu behind a proxy that it advertises, so that every client goes through the proxy.
    ``storage``: ``start_kafka``'s ``storage`` and ``env`` for one that keeps its data (and can be
    restarted); none: in memory.
    """
    listen_port = free_port()
    with FaultProxy(listen_port) as proxy:

        def start() -> BrokerProcess:
            return start_kafka(port=listen_port, advertised_port=proxy.port, **storage)

        faults = KafkaFaults(proxy, start(), start if storage else None)
        try:
            yield faults
        finally:
            faults.broker.stop()  # the current process: a restart replaced it


@pytest.fixture(scope="module")
def kafka_faults() -> Iterator[KafkaFaults]:
    with tansu_behind_proxy() as faults:
        yield faults


@pytest.fixture(scope="module")
def kafka_s3_faults() -> Iterator[KafkaFaults]:
    """A Tansu that stores in S3 (a moto server): a restart keeps topics, records and offsets."""
    store = start_moto()
    try:
        storage, env = s3_storage(store.address)
        with tansu_behind_proxy(storage=storage, env=env) as faults:
            yield faults
    finally:
        stop_moto(store)


class KafkaTarget(harness.FaultTargetBase):
    broker = "kafka"
    kept_on_restart = "Tansu kept its topics, records and committed offsets (S3 storage on moto)"

    def __init__(self, faults: KafkaFaults, adapter: KafkaAdapter) -> None:
        super().__init__(faults.proxy)
        self.faults = faults
        self.adapter = adapter
        self._producer: AIOKafkaProducer | None = None

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        async def send() -> None:
            if self._producer is None:
                producer = AIOKafkaProducer(bootstrap_servers=self.adapter.bootstrap, acks="all", retry_backoff_ms=1000)
                await asyncio.wait_for(producer.start(), timeout=10)
                self._producer = producer
            partition = index % self.adapter.partitions
            await asyncio.wait_for(
                self._producer.send_and_wait(self.adapter.topic, harness.order(index), partition=partition), timeout=15
            )

        retry_on = (KafkaError, asyncio.TimeoutError, TimeoutError, OSError)
        await self.publish_retrying(send, retry_on, before_retry=self._drop_producer)

    async def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), timeout=5)

    async def expected_ids(self) -> set[str]:
        """Every record of the topic, read back from the broker (a retried publish may have written twice)."""
        return {f"{self.adapter.topic}/{p}/{offset}" for p, offset in await self._records_from({})}

    async def unsettled(self) -> int:
        """Records past the group's committed offsets, read back (not end offsets: see :meth:`_records_from`)."""
        return len(await self._records_from(await self.adapter.committed()))

    async def _records_from(self, offsets: dict[int, int]) -> list[tuple[int, int]]:
        """
        ``(partition, offset)`` of every record from ``offsets`` (default: the beginning) on, read
        past the listed end offsets (the kit's :func:`read_partitions`): Tansu on S3 storage
        answers ``ListOffsets`` from a watermark that lags behind its records after a restart.
        """
        topic = self.adapter.topic
        consumer = AIOKafkaConsumer(bootstrap_servers=self.adapter.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            found: list[tuple[int, int]] = []
            starts = {TopicPartition(topic, p): offsets.get(p, 0) for p in range(self.adapter.partitions)}
            await read_partitions(
                consumer,
                starts,
                past_listed_ends=True,
                on_record=lambda record: found.append((record.partition, record.offset)),
            )
            return found
        finally:
            await consumer.stop()

    async def restart(self, down: float) -> None:
        """Stop Tansu, start it again on the same port after ``down`` s (it keeps its data in S3)."""
        faults = self.faults
        if faults.start_broker is None:
            raise NotImplementedError("this Tansu stores in memory: a restart keeps no data")
        faults.broker.stop()
        self.proxy.drop()  # a stopped broker keeps none of its connections
        await asyncio.sleep(down)
        faults.broker = await asyncio.to_thread(faults.start_broker)
        self.restarts += 1

    async def close(self) -> None:
        await self._drop_producer()


def kafka_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, bootstrap: str) -> str:
    return harness.set_connection(monkeypatch, conn_id, kafka_it_connection(bootstrap))


@contextlib.asynccontextmanager
async def open_kafka_target(faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KafkaTarget]:
    bootstrap = faults.proxy.address
    adapter = KafkaAdapter(bootstrap, kafka_connection(monkeypatch, "kafka_faults", bootstrap))
    await adapter.create_topics()
    target = KafkaTarget(faults, adapter)
    try:
        yield target
    finally:
        await target.close()


@pytest.fixture
async def kafka_target(kafka_faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KafkaTarget]:
    async with open_kafka_target(kafka_faults, monkeypatch) as target:
        yield target


@pytest.fixture
async def kafka_s3_target(kafka_s3_faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KafkaTarget]:
    async with open_kafka_target(kafka_s3_faults, monkeypatch) as target:
        yield target


@pytest.mark.kafka
@harness.fault_variants
async def test_kafka_resumes_after_fault_and_loses_nothing(kafka_target: KafkaTarget, fault: harness.Fault) -> None:
    report = await harness.assert_fault_loses_nothing(kafka_target, fault)
    assert_reconnects_bounded(report, fault)


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_kafka_broker_restart_keeps_its_data_and_loses_nothing(kafka_s3_target: KafkaTarget) -> None:
    await harness.assert_fault_loses_nothing(kafka_s3_target, harness.RESTART)
    assert kafka_s3_target.restarts == 1


MAX_KAFKA_RECONNECTS_PER_SECOND = 12.0
"""
While refused, the stream's reconnects per second. aiokafka retries every ``retry_backoff_ms``
from each component; at its own default (100 ms) that was about 40/s (208 in a 5 s refusal), with
the provider's default (1 s, ``kafka_config.DEFAULT_RETRY_BACKOFF_MS``) 6/s (30 in 5 s).
"""


def assert_reconnects_bounded(report: harness.FaultReport, fault: harness.Fault) -> None:
    """Regression: a refusing broker is not hammered (no reconnect every 100 ms)."""
    if fault.kind != "refuse":
        return
    rate = report.refused_during_fault / (fault.seconds * fault.repeat)
    assert rate <= MAX_KAFKA_RECONNECTS_PER_SECOND, f"{rate:.1f} reconnects/s while refused: {report.line()}"


def test_kafka_retry_backoff_defaults_to_one_second_unless_the_connection_sets_it() -> None:
    default = kafka_client_config("k", {"bootstrap.servers": "b:9092"}, trigger_group_id=None, derived_group_id="g")
    assert default.consumer["retry_backoff_ms"] == DEFAULT_RETRY_BACKOFF_MS == 1000
    assert default.common["retry_backoff_ms"] == 1000  # the dead-letter producer's too
    extras = {"bootstrap.servers": "b:9092", "retry.backoff.ms": "250"}
    explicit = kafka_client_config("k", extras, trigger_group_id=None, derived_group_id="g")
    assert explicit.consumer["retry_backoff_ms"] == 250


@pytest.mark.kafka
@harness.long_fault_variants
async def test_kafka_long_faults(kafka_target: KafkaTarget, fault: harness.Fault) -> None:
    report = await harness.assert_fault_loses_nothing(kafka_target, fault)
    assert_reconnects_bounded(report, fault)


@pytest.mark.kafka
async def test_kafka_unreachable_gives_one_clear_error(
    kafka_faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    listen_port = int(kafka_faults.broker.address.rsplit(":", 1)[1])
    with harness.unreachable(listen_port) as dead:
        conn_id = kafka_connection(monkeypatch, "kafka_faults_dead", dead.address)
        adapter = KafkaAdapter(dead.address, conn_id)
        await harness.assert_one_clear_error(
            "kafka/unreachable",
            dead,
            adapter.make_trigger,
            mentions=("cannot reach Kafka", dead.address, conn_id),
        )


# -- SQS: moto behind the proxy ------------------------------------------------------------------
REGION = "us-east-1"
SQS_CONN_ID = "aws_faults"


@dataclass
class SqsFaults:
    proxy: FaultProxy
    moto: BrokerProcess

    @property
    def direct(self) -> str:
        return self.moto.address

    @property
    def proxied(self) -> str:
        return f"http://{self.proxy.address}"


@pytest.fixture(scope="module")
def sqs_faults() -> Iterator[SqsFaults]:
    moto = start_moto()
    try:
        port = int(moto.address.rsplit(":", 1)[1])
        with FaultProxy(port) as proxy:
            yield SqsFaults(proxy, moto)
    finally:
        stop_moto(moto)


def sqs_connection(
    monkeypatch: pytest.MonkeyPatch,
    conn_id: str,
    endpoint: str,
    *,
    secret: str = "testing",
    config_kwargs: dict[str, Any] | None = None,
) -> str:
    connection = kit_sqs_connection(endpoint, REGION)
    connection["password"] = secret
    if config_kwargs:
        connection["extra"]["config_kwargs"] = config_kwargs
    return harness.set_connection(monkeypatch, conn_id, connection)


@contextlib.asynccontextmanager
async def queue_pair(faults: SqsFaults, client: Any, conn_id: str) -> AsyncIterator[SqsAdapter]:
    """
    A fresh queue (visibility timeout 30 s) and its dead-letter queue, made by the SQS kit straight
    on moto, deleted after the test; the adapter's triggers use ``conn_id``.
    """
    adapter = await SqsAdapter.fresh(client, conn_id, faults.direct, region=REGION, visibility=30)
    try:
        yield adapter
    finally:
        await adapter.cleanup()


class SqsTarget(harness.FaultTargetBase):
    broker = "sqs"
    kept_on_restart = "moto kept its queues, messages and receipt handles (in-process backend)"

    def __init__(self, faults: SqsFaults, adapter: SqsAdapter) -> None:
        super().__init__(faults.proxy)
        self.faults = faults
        self.adapter = adapter

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        body = harness.order(index).decode()
        # Straight to moto: it fails only while moto restarts (SQS may have stored a send whose
        # answer was lost: only acknowledged ids are expected).
        client = self.adapter.kit.client
        response = await self.publish_retrying(
            lambda: self.adapter.in_thread(client.send_message, QueueUrl=self.adapter.queue_url, MessageBody=body),
            (BotoCoreError, ClientError),
        )
        self.sent.add(str(response["MessageId"]))

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    async def restart(self, down: float) -> None:
        """Stop moto's server (listener closed: connections refused) and start it on the same port."""
        server = self.faults.moto.extra["server"]
        await asyncio.to_thread(stop_moto_listener, server)
        self.proxy.drop()  # a restarted process keeps none of its connections (werkzeug's threads would)
        await asyncio.sleep(down)
        await asyncio.to_thread(server.start)
        self.restarts += 1


def stop_moto_listener(server: Any) -> None:
    """
    ThreadedMotoServer's ``stop()`` only ends its serve loop: the listening socket stays open (new
    connections hang) and a ``start()`` on the same port could not bind. Close the socket too; the
    SQS backend is moto's in-process state, so queues, messages and receipt handles survive.
    """
    server.stop()
    server._server.server_close()


@pytest.fixture
async def sqs_client(sqs_faults: SqsFaults) -> AsyncIterator[Any]:
    """The publisher's and the assertions' client: straight to moto, never through the proxy."""
    kwargs = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    async with get_session().create_client("sqs", region_name=REGION, endpoint_url=sqs_faults.direct, **kwargs) as c:
        yield c


@pytest.fixture
async def sqs_target(
    sqs_faults: SqsFaults, sqs_client: Any, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SqsTarget]:
    conn_id = sqs_connection(monkeypatch, SQS_CONN_ID, sqs_faults.proxied)
    async with queue_pair(sqs_faults, sqs_client, conn_id) as adapter:
        yield SqsTarget(sqs_faults, adapter)


def assert_no_config_error(report: harness.FaultReport) -> None:
    """Regression: an outage fails a group (if at all) with a broker error, never a configuration error."""
    assert "SharedStreamConfigError" not in report.error_types(), f"an outage is no config error: {report.line()}"


@pytest.mark.sqs
@harness.fault_variants
async def test_sqs_resumes_after_fault_and_loses_nothing(sqs_target: SqsTarget, fault: harness.Fault) -> None:
    report = await harness.assert_fault_loses_nothing(sqs_target, fault)
    assert_no_config_error(report)


@pytest.mark.sqs
@harness.long_fault_variants
async def test_sqs_long_faults(sqs_target: SqsTarget, fault: harness.Fault) -> None:
    report = await harness.assert_fault_loses_nothing(sqs_target, fault)
    assert_no_config_error(report)


@pytest.mark.sqs
async def test_sqs_unreachable_endpoint_gives_one_clear_error(
    sqs_faults: SqsFaults, sqs_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(sqs_faults.direct.rsplit(":", 1)[1])
    with harness.unreachable(port) as dead:
        conn_id = sqs_connection(monkeypatch, "aws_faults_dead", f"http://{dead.address}")
        async with queue_pair(sqs_faults, sqs_client, conn_id) as adapter:
            queue_url = adapter.queue_url
            await harness.assert_one_clear_error(
                "sqs/unreachable",
                dead,
                adapter.make_trigger,
                mentions=("cannot reach the SQS endpoint", queue_url, conn_id),
                error_type=BrokerUnavailableError,  # an outage, not a setting (a typo'd endpoint reads the same)
            )


@pytest.mark.sqs
async def test_sqs_bad_credentials_give_one_clear_error(
    sqs_faults: SqsFaults, sqs_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings as moto_settings

    conn_id = sqs_connection(monkeypatch, "aws_faults_badcreds", sqs_faults.proxied, secret="wrong")
    async with queue_pair(sqs_faults, sqs_client, conn_id) as adapter:
        try:
            # moto checks credentials from now on: the key "testing" is no IAM user of its account.
            monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
            # moto answers the JSON-protocol request with an XML error body, so botocore reports the
            # code as "403" and the AWS code sits in the message (real SQS: "AWS rejected the credentials").
            await harness.assert_one_clear_error(
                "sqs/bad-credentials",
                sqs_faults.proxy,
                adapter.make_trigger,
                mentions=("InvalidClientTokenId", conn_id),
                error_type=SharedStreamConfigError,
            )
        finally:
            monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))


@pytest.mark.sqs
async def test_sqs_outage_past_the_receive_streak_is_a_broker_error_not_a_config_error(
    sqs_target: SqsTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Regression: a network outage longer than the receive loop's error streak (5 failures in a row)
    failed the group with ``SharedStreamConfigError``. It is a ``BrokerUnavailableError`` now, and
    delivery resumes after re-creation with nothing lost. To make a 5 s refusal outlast the streak,
    its pauses are shortened (0.1-0.2 s instead of 1-8 s) and botocore makes one attempt per call
    (``config_kwargs.retries``, instead of 3 with 1-2 s jittered pauses).
    """
    monkeypatch.setattr(sqs_producer.SqsSharedStreamProducer, "receive_backoff", Backoff(0.1, cap=0.2))
    sqs_connection(monkeypatch, SQS_CONN_ID, sqs_target.faults.proxied, config_kwargs={"retries": {"max_attempts": 1}})
    past_streak = harness.Fault("refuse-past-streak", "refuse", harness.FAULT_SECONDS)
    report = await harness.assert_fault_loses_nothing(sqs_target, past_streak)
    assert report.group_failures, f"the outage did not outlast the receive streak: {report.line()}"
    # A delete that failed during the outage may end the group first (SqsAdvanceError, also not a
    # configuration error); the receive streak or the re-created triggers' open give the new class.
    assert "SharedStreamConfigError" not in report.error_types(), report.line()
    assert "BrokerUnavailableError" in report.error_types(), report.line()
    assert report.error_types() <= {"BrokerUnavailableError", "SqsAdvanceError"}, report.line()
    assert all("cannot reach the SQS endpoint" in failure for failure in report.group_failures), report.line()


@pytest.mark.sqs
async def test_sqs_moto_restart_keeps_its_data_and_loses_nothing(sqs_target: SqsTarget) -> None:
    await harness.assert_fault_loses_nothing(sqs_target, harness.RESTART)
