"""
bench/production.py's ``restart-broker`` chaos action on real local brokers: a real
``redis-server`` restarted with its data (append-only file and RDB kept) and a Tansu storing in S3
(a moto server; topics, records and committed offsets kept), a publisher riding each restart out
without an error or a doubled record, and the brokers that keep their state in memory (moto's
SQS, Tansu on its memory engine) or are not the run's own (an external ``REDIS_URL``) recorded as
skipped with the reason, left running. And the schedule: ``--chaos once`` and ``loop`` include
the action.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.production import ACTIONS, chaos_schedule, orders_for_tick, parse_args, restart_brokers
from devkit.demo_streams import DemoStream, KafkaDemoStream, SqsDemoStream
from devkit.demo_types import GROUP_ID
from devkit.redis_broker import start_redis
from devkit.redis_demo import REDIS_STREAM, RedisDemoStream

requires_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

GROUP = "chaos-test"


@pytest.fixture
def redis_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisDemoStream]:
    monkeypatch.delenv("REDIS_URL", raising=False)  # the run's own server: restartable
    stream = RedisDemoStream()
    stream.start()
    try:
        yield stream
    finally:
        stream.stop()


@pytest.fixture
def sqs_stream() -> Iterator[SqsDemoStream]:
    stream = SqsDemoStream()
    stream.start()
    try:
        yield stream
    finally:
        stream.stop()


def restart_while_publishing(
    streams: dict[str, DemoStream[Any]],
    publisher: DemoStream[Any],
    *,
    first_seq: int,
    down_seconds: float,
    rng: random.Random,
    settle: float = 0.3,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """
    ``restart_brokers(streams, down_seconds)`` while ``publisher`` keeps sending two orders every
    50 ms from ``first_seq`` on (as bench/production.py's publisher does, one call a tick), from
    ``settle`` seconds before the restart to ``settle`` after it: ``(its answer, the publish errors)``.
    """
    errors: list[str] = []
    stop = threading.Event()

    def publish() -> None:
        seq = first_seq
        while not stop.is_set():
            try:
                publisher.publish(orders_for_tick(publisher.broker, seq, 2, time.time(), rng))
            except Exception as exc:  # any publish error fails the calling test
                errors.append(repr(exc))
            seq += 2
            time.sleep(0.05)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        time.sleep(settle)
        done = restart_brokers(streams, down_seconds=down_seconds)
        time.sleep(settle)
    finally:
        stop.set()
        thread.join(timeout=60)
    return done, errors


def test_the_schedules_include_restart_broker() -> None:
    assert "restart-broker" in ACTIONS
    assert "restart-broker" in parse_args([]).actions.split(",")
    once = chaos_schedule("once", 600.0, 180.0, ACTIONS)
    assert [action for _, action in once] == list(ACTIONS)
    assert all(at < 480.0 for at, _ in once)  # nothing in the last 20 % (the drain)
    loop = chaos_schedule("loop", 3600.0, 60.0, ACTIONS)
    assert "restart-broker" in {action for _, action in loop}


@requires_redis
def test_redis_restarts_with_its_data_and_a_memory_broker_is_skipped(
    redis_stream: RedisDemoStream, sqs_stream: SqsDemoStream
) -> None:
    rng = random.Random(3)
    client = redis_stream.orders.client
    redis_stream.publish(orders_for_tick("redis", 0, 10, time.time(), rng))
    client.execute_command("XGROUP", "CREATE", REDIS_STREAM, GROUP, "0")
    # Two entries delivered to a consumer and not acknowledged: the pending list must survive too.
    client.execute_command("XREADGROUP", "GROUP", GROUP, "c1", "COUNT", "2", "STREAMS", REDIS_STREAM, ">")
    address = f"{redis_stream.orders.server.host}:{redis_stream.orders.server.port}"

    done, errors = restart_while_publishing(
        {"redis": redis_stream, "sqs": sqs_stream}, redis_stream, first_seq=10, down_seconds=6.0, rng=rng
    )

    assert done["redis"]["restarted"] == address
    assert done["redis"]["down_s"] >= 6.0
    assert done["sqs"] == {"skipped": "moto keeps its state in memory (a new server starts empty)"}
    assert errors == []
    # Every entry once: what was published before, during and after the restart, nothing twice.
    assert int(client.xlen(REDIS_STREAM)) == redis_stream.published >= 12
    assert int(client.xpending(REDIS_STREAM, GROUP)["pending"]) == 2
    # The memory-only broker was left alone: its queue still answers.
    assert sqs_stream.settlement().total == 0


@requires_redis
def test_an_external_redis_is_skipped_and_left_running(monkeypatch: pytest.MonkeyPatch) -> None:
    with start_redis(own=True) as server:
        monkeypatch.setenv("REDIS_URL", server.url)
        stream = RedisDemoStream()
        stream.start()
        try:
            done = restart_brokers({"redis": stream}, down_seconds=0.0)
            assert done["redis"] == {
                "skipped": f"an external Redis ({server.host}:{server.port}, REDIS_URL) is not this run's to restart"
            }
            assert server.process is not None and server.process.poll() is None
            with pytest.raises(NotImplementedError):
                stream.restart_keeping_data()
        finally:
            stream.stop()


@pytest.fixture
def kafka_stream(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[KafkaDemoStream]:
    """The demo's Kafka stream on the run's own Tansu, storing as the test's parameter says."""
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv(KafkaDemoStream.storage_env, request.param)
    stream = KafkaDemoStream()
    stream.start()
    try:
        yield stream
    finally:
        stream.stop()


def commit(bootstrap: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit ``offsets`` for the demo's group, as the watchers' producer does after persistence."""

    async def run() -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP_ID, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = {p: TopicPartition(topic, p) for p in offsets}
            consumer.assign(list(tps.values()))
            await consumer.commit({tps[p]: offset for p, offset in offsets.items()})
        finally:
            await consumer.stop()

    asyncio.run(run())


@pytest.mark.parametrize("kafka_stream", ["s3"], indirect=True)
def test_kafka_on_s3_restarts_with_its_records_and_committed_offsets(kafka_stream: KafkaDemoStream) -> None:
    rng = random.Random(5)
    orders = kafka_stream.orders
    kafka_stream.publish(orders_for_tick("kafka", 0, 12, time.time(), rng))
    before = orders.end_offsets()
    commit(orders.bootstrap, orders.topic, {p: 1 for p, end in before.items() if end})
    committed = orders.committed()
    assert committed and set(committed.values()) == {1}

    done, errors = restart_while_publishing(
        {"kafka": kafka_stream}, kafka_stream, first_seq=12, down_seconds=3.0, rng=rng, settle=0.5
    )

    assert done["kafka"]["restarted"] == orders.bootstrap
    assert done["kafka"]["down_s"] >= 3.0
    assert errors == []
    # Every record once: the end offsets (read past Tansu's lagging ListOffsets) count exactly
    # what was published, before, during and after the restart; the group's offsets came back.
    assert sum(orders.end_offsets().values()) == kafka_stream.published > 12
    assert orders.committed() == committed
    settlement = kafka_stream.settlement()
    assert (settlement.settled, settlement.total) == (len(committed), kafka_stream.published)


@pytest.mark.parametrize("kafka_stream", ["memory"], indirect=True)
def test_kafka_in_memory_is_skipped_with_the_way_to_restart_it(kafka_stream: KafkaDemoStream) -> None:
    done = restart_brokers({"kafka": kafka_stream}, down_seconds=0.0)
    assert "memory engine" in done["kafka"]["skipped"] and "--kafka-storage s3" in done["kafka"]["skipped"]
    with pytest.raises(NotImplementedError):
        kafka_stream.restart_keeping_data()
    assert kafka_stream.settlement().total == 0  # left running
