"""
bench/production.py's ``restart-broker`` chaos action on real local brokers: a real
``redis-server`` restarted with its data (append-only file and RDB kept), a publisher riding the
restart out without an error or a doubled entry, and the brokers that keep their state in memory
(moto's SQS) or are not the run's own (an external ``REDIS_URL``) recorded as skipped with the
reason, left running. And the schedule: ``--chaos once`` and ``loop`` include the action.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from bench.production import ACTIONS, chaos_schedule, orders_for_tick, parse_args, restart_brokers
from devkit.demo_streams import SqsDemoStream
from devkit.redis_broker import start_redis
from devkit.redis_demo import REDIS_STREAM, RedisDemoStream

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

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


def test_the_schedules_include_restart_broker() -> None:
    assert "restart-broker" in ACTIONS
    assert "restart-broker" in parse_args([]).actions.split(",")
    once = chaos_schedule("once", 600.0, 180.0, ACTIONS)
    assert [action for _, action in once] == list(ACTIONS)
    assert all(at < 480.0 for at, _ in once)  # nothing in the last 20 % (the drain)
    loop = chaos_schedule("loop", 3600.0, 60.0, ACTIONS)
    assert "restart-broker" in {action for _, action in loop}


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

    # A publisher keeps sending through the restart (as bench/production.py's does, one call a tick).
    errors: list[str] = []
    stop = threading.Event()
    sent = [10]

    def publish() -> None:
        while not stop.is_set():
            try:
                redis_stream.publish(orders_for_tick("redis", sent[0], 2, time.time(), rng))
            except redis.RedisError as exc:
                errors.append(repr(exc))
            sent[0] += 2
            time.sleep(0.05)

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        time.sleep(0.3)
        done = restart_brokers({"redis": redis_stream, "sqs": sqs_stream}, down_seconds=6.0)
        time.sleep(0.3)
    finally:
        stop.set()
        publisher.join(timeout=30)

    assert done["redis"]["restarted"] == address
    assert done["redis"]["down_s"] >= 6.0
    assert done["sqs"] == {"skipped": "moto keeps its state in memory (a new server starts empty)"}
    assert errors == []
    # Every entry once: what was published before, during and after the restart, nothing twice.
    assert int(client.xlen(REDIS_STREAM)) == redis_stream.published >= 12
    assert int(client.xpending(REDIS_STREAM, GROUP)["pending"]) == 2
    # The memory-only broker was left alone: its queue still answers.
    assert sqs_stream.settlement().total == 0


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
