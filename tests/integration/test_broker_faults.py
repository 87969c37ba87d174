"""
Broker faults through a loopback TCP fault proxy (tests/faultproxy.py), Kafka (Tansu) and SQS (moto).

Each broker's consumer connection goes through a :class:`~tests.faultproxy.FaultProxy`; a steady
stream is published while the real ``SharedStreamManager`` (driven by :class:`RunnerSim`, persist
confirmations every 50 ms) feeds several watchers, and one fault is injected mid-stream:

* ``reset``: every open connection is reset at once (RST);
* ``stall``: no byte flows either way for 5 s, connections kept;
* ``refuse``: every connection is reset and reconnects are refused for 5 s.

Then the proxy heals. The property, per broker and fault:

* delivery resumes, either by itself, or (when the producer fails its group loudly) after the
  failed watchers are re-created the way the triggerer re-creates failed triggers; which one
  happened is recorded in the printed report line;
* nothing is lost: every watcher has every message id at least once, and the broker ends settled
  (no message left uncommitted / undeleted);
* duplicates are counted and printed (delivery is at least once).

And a stream that cannot connect (unreachable endpoint, bad credentials) fails with one clear
error, making a bounded number of connection attempts (counted at the proxy), not a hot loop.

Kafka clients connect to the address the broker *advertises*, so Kafka runs on a dedicated Tansu
whose advertised listener is the proxy (:func:`start_tansu_behind`); its publisher goes through the
proxy too (it rides the faults out by retrying), and the expected message ids are read back from
the topic afterwards. The SQS publisher talks to moto directly; only the producer's ``aws``
connection (``endpoint_url``) points at the proxy.

Run with ``-s`` to see the report lines (``FAULT kafka/reset: ...``). The long variants (eight
resets, a 45 s stall, a 40 s refusal) are marked ``slow`` and run only with ``-m slow`` or
BROKER_FAULTS_SLOW=1 (about 4.5 min); the default run takes about 1.5 min.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pytest
from aiobotocore.session import get_session
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from devkit.brokers import BrokerProcess, BrokerStartError, start_moto, stop_moto, tansu_binary
from devkit.ports import free_port, wait_for_port
from devkit.runner import RunnerSim, wait_until
from tests.faultproxy import FaultProxy
from tests.integration.kafka.conftest import KafkaAdapter, create_topics
from tests.integration.sqs.conftest import SqsAdapter, create_queue_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FAULT_SECONDS = 5.0
"""How long a stall or a refusal lasts."""
PUBLISH_INTERVAL = 0.05
"""A steady stream: one message every 50 ms (20/s)."""
BEFORE_FAULT = 1.0
"""Seconds of stream flowing before the fault (after the first deliveries)."""
AFTER_HEAL = 1.0
"""Seconds the publisher keeps going after the proxy healed."""
RECREATE_AFTER = 1.0
"""A failed trigger is re-created about one triggerer loop later."""
RESUME_TIMEOUT = 60.0
WATCHERS = 3
REGIONS = ("eu", "us", "apac")
CONNECT_WINDOW = 5.0
"""A stream that cannot connect has its connection attempts counted over at least this long."""
ERROR_TIMEOUT = 30.0
"""How long a stream that cannot connect may take to say so (SQS: botocore's jittered retries)."""
MAX_CONNECT_ATTEMPTS = 6
"""A bounded number of attempts: a hot retry loop makes hundreds in CONNECT_WINDOW."""


@dataclass(frozen=True)
class Fault:
    """One fault plan: ``kind`` applied ``repeat`` times (random gaps between), each lasting ``seconds``."""

    name: str
    kind: Literal["reset", "stall", "refuse"]
    seconds: float = 0.0
    repeat: int = 1

    def __str__(self) -> str:
        return self.name


FAULTS = (
    Fault("reset", "reset"),
    Fault("stall", "stall", FAULT_SECONDS),
    Fault("refuse", "refuse", FAULT_SECONDS),
)
"""The fast variants, run by default: one fault each, 5 s for a stall or a refusal."""
SLOW_FAULTS = (
    Fault("reset-x8", "reset", repeat=8),
    Fault("stall-45s", "stall", 45.0),
    Fault("refuse-40s", "refuse", 40.0),
)
"""
The long variants (marked ``slow``; they run when asked for with ``-m slow`` or BROKER_FAULTS_SLOW=1,
and are skipped otherwise so the default run stays short): eight resets 0.3-1.5 s apart; a stall
longer than aiokafka's request timeout (40 s), Kafka's session timeout (10 s here) and the SQS
visibility timeout (10 s here); a refusal longer than the SQS receive loop's error streak (5
failures, 1+2+4+8 s apart), so that one fails its group loudly and is re-created.
"""


@pytest.fixture
def _slow_opt_in(request: pytest.FixtureRequest) -> None:
    markexpr = str(request.config.getoption("markexpr", "") or "")
    asked = re.search(r"(?<!not )\bslow\b", markexpr) is not None
    if not asked and os.environ.get("BROKER_FAULTS_SLOW") != "1":
        pytest.skip("long fault variant: run with -m slow or BROKER_FAULTS_SLOW=1")


def order(index: int) -> bytes:
    return json.dumps({"order_id": index, "region": REGIONS[index % len(REGIONS)]}).encode()


# -- what a broker provides to the scenario -----------------------------------------------------
class FaultTarget(Protocol):
    broker: str
    proxy: FaultProxy
    publish_retries: int

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger: ...

    async def publish(self, index: int) -> None:
        """Publish order ``index`` (retrying through faults until the broker acknowledged it)."""

    async def expected_ids(self) -> set[str]:
        """Every message id the broker holds for this stream (each watcher must have them all)."""

    async def unsettled(self) -> int: ...

    async def close(self) -> None: ...


@dataclass
class FaultReport:
    broker: str
    fault: str
    published: int = 0
    publish_retries: int = 0
    group_failures: list[str] = field(default_factory=list)
    recreations: int = 0
    lost: dict[int, int] = field(default_factory=dict)
    duplicates: dict[int, int] = field(default_factory=dict)
    unsettled: int = -1
    dropped: int = 0
    delivered_during_fault: int = 0
    refused_during_fault: int = 0
    resumed_after: float = -1.0
    connections: int = 0
    elapsed: float = 0.0

    @property
    def outcome(self) -> str:
        if not self.group_failures:
            return "resumed by itself"
        return f"group failed loudly ({len(self.group_failures)} watcher failures), resumed after re-creation"

    def line(self) -> str:
        kinds = Counter(failure.split(": ", 2)[1] for failure in self.group_failures)
        first_error = f"{dict(kinds)}, first: {self.group_failures[0][:200]}" if self.group_failures else ""
        return (
            f"FAULT {self.broker}/{self.fault}: {self.outcome}; published {self.published} "
            f"(publisher retries {self.publish_retries}); lost {sum(self.lost.values())} {self.lost}; "
            f"duplicates {sum(self.duplicates.values())} {self.duplicates}; unsettled {self.unsettled}; "
            f"all delivered {self.resumed_after:.1f}s after heal; re-created {self.recreations}; "
            f"fault: {self.dropped} connections reset, {self.refused_during_fault} refused, "
            f"{self.delivered_during_fault} events persisted meanwhile; "
            f"proxy connections {self.connections}; {self.elapsed:.1f}s"
            + (f"; errors {first_error}" if first_error else "")
        )


REPORTS: list[FaultReport] = []


@pytest.fixture(scope="module", autouse=True)
def _print_reports() -> Iterator[None]:
    yield
    if REPORTS:
        print("\nBroker faults:")
        for report in REPORTS:
            print("  " + report.line())


# -- the scenario, the same for every broker ---------------------------------------------------
async def inject(proxy: FaultProxy, fault: Fault, rng: random.Random) -> int:
    """Apply ``fault`` (the scenario waits for its duration), then heal; return the connections reset."""
    dropped = 0
    for round_ in range(fault.repeat):
        if round_:
            await asyncio.sleep(rng.uniform(0.3, 1.5))
        if fault.kind == "reset":
            dropped += proxy.drop()
        elif fault.kind == "stall":
            proxy.stall(fault.seconds)
            await asyncio.sleep(fault.seconds)
        else:
            proxy.refuse(fault.seconds)
            dropped += proxy.drop()
            await asyncio.sleep(fault.seconds)
    proxy.heal()
    return dropped


def watcher_triggers(target: FaultTarget) -> dict[int, Callable[[], SharedStreamTrigger]]:
    """Several watchers of one stream: two take everything, one filters (and still matches all)."""
    return {
        1: target.make_trigger,
        2: target.make_trigger,
        3: lambda: target.make_trigger(match={"body.region": list(REGIONS)}),
    }


async def run_fault(target: FaultTarget, fault: Fault) -> FaultReport:
    report = FaultReport(target.broker, fault.name)
    started = time.monotonic()
    target.proxy.heal()
    connections_before = target.proxy.accepted
    triggers = watcher_triggers(target)
    runner = RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05)
    stop_publishing = asyncio.Event()

    async def publish_steadily() -> None:
        index = 0
        while not stop_publishing.is_set():
            await target.publish(index)
            index += 1
            report.published = index
            await asyncio.sleep(PUBLISH_INTERVAL)

    failed_at: dict[int, float] = {}

    async def recreate_failed() -> None:
        """The triggerer's part: a failed trigger is created again about one loop later, for as long as it fails."""
        while True:
            now = time.monotonic()
            for trigger_id, make in triggers.items():
                if runner.alive(trigger_id) or trigger_id not in runner.failures:
                    continue
                if trigger_id not in failed_at:
                    error = runner.failures[trigger_id]
                    report.group_failures.append(f"watcher {trigger_id}: {type(error).__name__}: {error}")
                    failed_at[trigger_id] = now
                elif now - failed_at[trigger_id] >= RECREATE_AFTER:
                    del runner.failures[trigger_id], failed_at[trigger_id]
                    runner.add(trigger_id, make())
                    report.recreations += 1
            await asyncio.sleep(0.05)

    def flowing() -> bool:
        if publisher.done() and not stop_publishing.is_set():
            publisher.result()  # the publisher died: raise its error instead of waiting for the flow
            raise AssertionError("the publisher stopped by itself")
        return all(runner.count(t) >= 5 for t in triggers)

    async with runner:
        for trigger_id, make in triggers.items():
            runner.add(trigger_id, make())
        publisher = asyncio.create_task(publish_steadily(), name="fault-publisher")
        triggerer = asyncio.create_task(recreate_failed(), name="fault-triggerer")
        try:
            await wait_until(flowing, timeout=30, what="the stream to flow")
            await asyncio.sleep(BEFORE_FAULT)
            events_before = sum(runner.count(t) for t in triggers)
            refused_before = target.proxy.refused
            report.dropped = await inject(target.proxy, fault, random.Random(fault.name))
            healed = time.monotonic()
            report.delivered_during_fault = sum(runner.count(t) for t in triggers) - events_before
            report.refused_during_fault = target.proxy.refused - refused_before
            await asyncio.sleep(AFTER_HEAL)
            stop_publishing.set()
            await asyncio.wait_for(publisher, timeout=RESUME_TIMEOUT)
            expected = await target.expected_ids()
            assert len(expected) >= report.published, "the broker holds fewer messages than were acknowledged"

            def missing(trigger_id: int) -> int:
                return len(expected - set(runner.message_ids(trigger_id)))

            resume_deadline = time.monotonic() + RESUME_TIMEOUT
            while time.monotonic() < resume_deadline:
                if all(missing(t) == 0 for t in triggers) and await target.unsettled() == 0:
                    break
                await asyncio.sleep(0.25)
            report.resumed_after = time.monotonic() - healed
            report.unsettled = await target.unsettled()
            for trigger_id in triggers:
                report.lost[trigger_id] = missing(trigger_id)
                ids = runner.message_ids(trigger_id)
                report.duplicates[trigger_id] = sum(n - 1 for n in Counter(ids).values())
        finally:
            stop_publishing.set()
            for task in (publisher, triggerer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    report.publish_retries = target.publish_retries
    report.connections = target.proxy.accepted - connections_before
    report.elapsed = time.monotonic() - started
    REPORTS.append(report)
    print(report.line())
    return report


def assert_nothing_lost(report: FaultReport) -> None:
    assert report.published > 0
    assert sum(report.lost.values()) == 0, f"messages lost: {report.line()}"
    assert report.unsettled == 0, f"the broker did not settle: {report.line()}"


async def assert_one_clear_error(
    proxy: FaultProxy, make_trigger: Callable[[], SharedStreamTrigger], *, mentions: tuple[str, ...]
) -> tuple[int, float, str]:
    """
    Watchers of a stream that cannot connect all fail with one error, within ERROR_TIMEOUT; the
    connection attempts, counted until then and for at least CONNECT_WINDOW, stay bounded.
    Returns (attempts, seconds until the error, the error).
    """
    before = proxy.accepted
    started = time.monotonic()
    watchers = range(1, WATCHERS + 1)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        for trigger_id in watchers:
            runner.add(trigger_id, make_trigger())
        with contextlib.suppress(TimeoutError):
            await wait_until(lambda: not any(runner.alive(t) for t in watchers), timeout=ERROR_TIMEOUT)
        failed_after = time.monotonic() - started
        await asyncio.sleep(max(0.0, CONNECT_WINDOW - failed_after))  # and nothing retries after the error
        attempts = proxy.accepted - before
        errors = {f"{type(e).__name__}: {e}" for e in runner.failures.values()}
        alive = [t for t in watchers if runner.alive(t)]
    assert not alive, f"watchers {alive} still waiting after {ERROR_TIMEOUT}s ({attempts} attempts): no error surfaced"
    assert len(runner.failures) == WATCHERS
    assert len(errors) == 1, f"expected one error for the group, got {errors}"
    error = errors.pop()
    for text in mentions:
        assert text in error, f"the error does not say {text!r}: {error}"
    assert 1 <= attempts <= MAX_CONNECT_ATTEMPTS, f"{attempts} connection attempts in {failed_after:.1f}s"
    return attempts, failed_after, error


# -- Kafka: a dedicated Tansu advertising the proxy --------------------------------------------
def start_tansu_behind(proxy_port: int, listen_port: int, *, timeout: float = 30.0) -> BrokerProcess:
    """
    Tansu listening on ``listen_port`` and advertising ``127.0.0.1:proxy_port`` (the fault proxy):
    every Kafka client, once bootstrapped, connects to the proxy.
    """
    log_path = Path(tempfile.mkstemp(prefix="tansu-faults-", suffix=".log")[1])
    argv = [
        str(tansu_binary()),
        "broker",
        "--listener-url",
        f"tcp://127.0.0.1:{listen_port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{proxy_port}",
        "--storage-engine",
        "memory://tansu/",
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    broker = BrokerProcess("kafka", f"127.0.0.1:{listen_port}", proc, log_path)
    try:
        wait_for_port(listen_port, timeout=timeout)
    except TimeoutError as exc:
        tail = broker.log_tail()
        broker.stop()
        raise BrokerStartError(f"Tansu did not start on port {listen_port}: {exc}\n{tail}") from exc
    return broker


@dataclass
class KafkaFaults:
    proxy: FaultProxy
    broker: BrokerProcess


@pytest.fixture(scope="module")
def kafka_faults() -> Iterator[KafkaFaults]:
    listen_port = free_port()
    with FaultProxy(listen_port) as proxy:
        broker = start_tansu_behind(proxy.port, listen_port)
        try:
            yield KafkaFaults(proxy, broker)
        finally:
            broker.stop()


class KafkaTarget:
    broker = "kafka"

    def __init__(self, faults: KafkaFaults, adapter: KafkaAdapter) -> None:
        self.proxy = faults.proxy
        self.adapter = adapter
        self.publish_retries = 0
        self._producer: AIOKafkaProducer | None = None

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        partition = index % self.adapter.partitions
        while True:
            try:
                if self._producer is None:
                    producer = AIOKafkaProducer(
                        bootstrap_servers=self.adapter.bootstrap, acks="all", retry_backoff_ms=1000
                    )
                    await asyncio.wait_for(producer.start(), timeout=10)
                    self._producer = producer
                await asyncio.wait_for(
                    self._producer.send_and_wait(self.adapter.topic, order(index), partition=partition), timeout=15
                )
                return
            except (KafkaError, TimeoutError, OSError):
                self.publish_retries += 1
                await self._drop_producer()
                await asyncio.sleep(0.2)

    async def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), timeout=5)

    async def expected_ids(self) -> set[str]:
        """Every record of the topic, read back from the broker (a retried publish may have written twice)."""
        topic = self.adapter.topic
        consumer = AIOKafkaConsumer(bootstrap_servers=self.adapter.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(self.adapter.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            ids: set[str] = set()
            while True:
                positions = {tp: await consumer.position(tp) for tp in tps}
                if all(positions[tp] >= ends[tp] for tp in tps):
                    return ids
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    ids.update(f"{topic}/{tp.partition}/{record.offset}" for record in records)
        finally:
            await consumer.stop()

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    async def close(self) -> None:
        await self._drop_producer()


def kafka_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, bootstrap: str) -> str:
    extra = {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest", "session.timeout.ms": 10000}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "kafka", "extra": extra}))
    return conn_id


@pytest.fixture
async def kafka_target(kafka_faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KafkaTarget]:
    kafka_faults.proxy.heal()
    bootstrap = kafka_faults.proxy.address
    adapter = KafkaAdapter(bootstrap, kafka_connection(monkeypatch, "kafka_faults", bootstrap))
    await create_topics(bootstrap, adapter.topic, partitions=adapter.partitions)
    await create_topics(bootstrap, adapter.dlq_topic, partitions=1)
    target = KafkaTarget(kafka_faults, adapter)
    try:
        yield target
    finally:
        kafka_faults.proxy.heal()
        await target.close()


@pytest.mark.kafka
@pytest.mark.parametrize("fault", FAULTS, ids=str)
async def test_kafka_resumes_after_fault_and_loses_nothing(kafka_target: KafkaTarget, fault: Fault) -> None:
    report = await run_fault(kafka_target, fault)
    assert_nothing_lost(report)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", SLOW_FAULTS, ids=str)
async def test_kafka_long_faults(kafka_target: KafkaTarget, fault: Fault) -> None:
    report = await run_fault(kafka_target, fault)
    assert_nothing_lost(report)


@pytest.mark.kafka
async def test_kafka_unreachable_gives_one_clear_error(
    kafka_faults: KafkaFaults, monkeypatch: pytest.MonkeyPatch
) -> None:
    listen_port = int(kafka_faults.broker.address.rsplit(":", 1)[1])
    with FaultProxy(listen_port) as dead:
        dead.refuse(float("inf"))
        conn_id = kafka_connection(monkeypatch, "kafka_faults_dead", dead.address)
        adapter = KafkaAdapter(dead.address, conn_id)
        attempts, after, error = await assert_one_clear_error(
            dead, adapter.make_trigger, mentions=("cannot reach Kafka", dead.address, conn_id)
        )
    print(f"FAULT kafka/unreachable: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")


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


def sqs_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, endpoint: str, *, secret: str = "testing") -> str:
    conn = {
        "conn_type": "aws",
        "login": "testing",
        "password": secret,
        "extra": {"region_name": REGION, "endpoint_url": endpoint},
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


class SqsTarget:
    broker = "sqs"

    def __init__(self, proxy: FaultProxy, adapter: SqsAdapter) -> None:
        self.proxy = proxy
        self.adapter = adapter
        self.sent: set[str] = set()
        self.publish_retries = 0  # straight to moto: never retried

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, index: int) -> None:
        body = order(index).decode()
        response = await self.adapter.client.send_message(QueueUrl=self.adapter.queue_url, MessageBody=body)
        self.sent.add(str(response["MessageId"]))

    async def expected_ids(self) -> set[str]:
        return set(self.sent)

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    async def close(self) -> None:
        return None


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
    sqs_faults.proxy.heal()
    queue_url, dlq_url = await create_queue_pair(sqs_client, visibility=30)
    conn_id = sqs_connection(monkeypatch, SQS_CONN_ID, sqs_faults.proxied)
    adapter = SqsAdapter(sqs_client, conn_id, queue_url, dlq_url)
    try:
        yield SqsTarget(sqs_faults.proxy, adapter)
    finally:
        sqs_faults.proxy.heal()
        for url in (queue_url, dlq_url):
            await sqs_client.delete_queue(QueueUrl=url)


@pytest.mark.sqs
@pytest.mark.parametrize("fault", FAULTS, ids=str)
async def test_sqs_resumes_after_fault_and_loses_nothing(sqs_target: SqsTarget, fault: Fault) -> None:
    report = await run_fault(sqs_target, fault)
    assert_nothing_lost(report)


@pytest.mark.sqs
@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", SLOW_FAULTS, ids=str)
async def test_sqs_long_faults(sqs_target: SqsTarget, fault: Fault) -> None:
    report = await run_fault(sqs_target, fault)
    assert_nothing_lost(report)


@pytest.mark.sqs
async def test_sqs_unreachable_endpoint_gives_one_clear_error(
    sqs_faults: SqsFaults, sqs_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(sqs_faults.direct.rsplit(":", 1)[1])
    queue_url, dlq_url = await create_queue_pair(sqs_client)
    try:
        with FaultProxy(port) as dead:
            dead.refuse(float("inf"))
            conn_id = sqs_connection(monkeypatch, "aws_faults_dead", f"http://{dead.address}")
            adapter = SqsAdapter(sqs_client, conn_id, queue_url, dlq_url)
            attempts, after, error = await assert_one_clear_error(
                dead, adapter.make_trigger, mentions=("cannot reach the SQS endpoint", queue_url, conn_id)
            )
    finally:
        for url in (queue_url, dlq_url):
            await sqs_client.delete_queue(QueueUrl=url)
    print(f"FAULT sqs/unreachable: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")


@pytest.mark.sqs
async def test_sqs_bad_credentials_give_one_clear_error(
    sqs_faults: SqsFaults, sqs_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings as moto_settings

    queue_url, dlq_url = await create_queue_pair(sqs_client)
    try:
        # moto checks credentials from now on: the key "testing" is no IAM user of its account.
        monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        conn_id = sqs_connection(monkeypatch, "aws_faults_badcreds", sqs_faults.proxied, secret="wrong")
        adapter = SqsAdapter(sqs_client, conn_id, queue_url, dlq_url)
        # moto answers the JSON-protocol request with an XML error body, so botocore reports the
        # code as "403" and the AWS code sits in the message (real SQS: "AWS rejected the credentials").
        attempts, after, error = await assert_one_clear_error(
            sqs_faults.proxy, adapter.make_trigger, mentions=("InvalidClientTokenId", conn_id)
        )
    finally:
        monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
        for url in (queue_url, dlq_url):
            await sqs_client.delete_queue(QueueUrl=url)
    print(f"FAULT sqs/bad-credentials: one error after {after:.1f}s and {attempts} connection attempt(s): {error}")
