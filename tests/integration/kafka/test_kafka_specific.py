"""What only Kafka has: offsets and seek-back, partitions, consumer groups, rebalances."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from airflow.triggers.shared_stream import AckTimeout, SharedStreamManager

from airflow_shared_stream_provider._core.errors import PartialAssignmentError, SharedStreamConfigError
from devkit.runner import FakeClock, RunnerSim, wait_until
from tests.integration.contract import orders, wait_until_async

from .conftest import KafkaAdapter

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


async def fully_committed(adapter: KafkaAdapter) -> bool:
    return await adapter.unsettled() == 0


async def test_an_ack_timeout_seeks_back_and_redelivers_only_the_failed_message(adapter: KafkaAdapter) -> None:
    await adapter.publish(orders(1), partition=0)
    clock = FakeClock()
    manager = SharedStreamManager(ack_timeout=0.2, _now=clock)
    async with RunnerSim(manager, withhold={2}) as runner:
        runner.add(1, adapter.make_trigger())
        # Watcher 2 fires only on order 0 and its event never persists; it moves past 1 and 2.
        runner.add(2, adapter.make_trigger(match={"body.order_id": 0}))
        await wait_until(lambda: len(runner.pending) == 2, timeout=30, what="both watchers fired")
        await adapter.publish(orders(3)[1:], partition=0)  # offsets 1-2 arrive behind the stuck one
        await wait_until(lambda: len(runner.pending) == 4, timeout=30, what="4 fired")
        runner.persist()
        assert (await adapter.committed())[0] == 0, "committed past a message whose event was not persisted"
        clock.now += 5
        await wait_until(lambda: isinstance(runner.failures.get(2), AckTimeout), timeout=30, what="ack timeout")

        async def persisted_and_committed() -> bool:
            runner.persist()
            return await fully_committed(adapter)

        await wait_until_async(persisted_and_committed, timeout=30)
    by_offset = sorted((p["metadata"]["offset"], p["delivery_attempt"]) for p in runner.persisted[1])
    # Offset 0 came back once (attempt 2); offsets 1 and 2, in flight during the seek-back, did not.
    assert by_offset == [(0, 1), (0, 2), (1, 1), (2, 1)]


async def test_a_message_that_keeps_failing_is_dead_lettered_with_its_headers(adapter: KafkaAdapter) -> None:
    await adapter.publish([b'{"order_id": 7}'], attributes={"source": "shop"}, partition=1)
    clock = FakeClock()
    manager = SharedStreamManager(ack_timeout=0.2, _now=clock)
    options = {"max_delivery_attempts": 2}
    async with RunnerSim(manager, withhold={1, 2}) as runner:
        runner.add(1, adapter.make_trigger(**options))
        await wait_until(lambda: len(runner.pending) == 1, timeout=30, what="attempt 1")
        # The replacement watcher joins before the first one fails, so the group (and the
        # in-session attempt count) lives on; it was not subscribed at fan-out, so it waits.
        runner.add(2, adapter.make_trigger(**options))
        await wait_until(
            lambda: any(len(group._subscribers) == 2 for group in manager._groups.values()),
            timeout=10,
            what="second watcher subscribed",
        )
        clock.now += 5
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="attempt 1 failed")
        await wait_until(lambda: len(runner.pending) == 2, timeout=30, what="attempt 2")
        assert [p.event.payload["delivery_attempt"] for p in runner.pending] == [1, 2]
        clock.now += 5
        await wait_until(lambda: 2 in runner.failures, timeout=30, what="attempt 2 failed")
        await wait_until_async(lambda: fully_committed(adapter), timeout=30)
    [record] = await adapter.dead_letter_records()
    headers = {k: v.decode() for k, v in record.headers}
    assert record.value == b'{"order_id": 7}'
    assert headers["source"] == "shop"
    assert headers["x-dead-letter-source"] == f"{adapter.topic}/1/0"
    assert headers["x-dead-letter-reason"].startswith("poison message: failed 2 delivery attempt(s)")


async def test_siblings_on_two_triggerers_sharing_a_group_fail_loudly(adapter: KafkaAdapter) -> None:
    """``position_store="group"``; the default (watcher positions) never splits: test_watcher_positions.py."""
    await adapter.publish(orders(6))
    first = RunnerSim(SharedStreamManager())
    second = RunnerSim(SharedStreamManager())  # another triggerer process, same group id
    async with first, second:
        first.add(1, adapter.make_trigger(partial_assignment_grace=0, position_store="group"))
        await wait_until(lambda: first.count(1) + len(first.pending) >= 1, timeout=30, what="first consuming")
        second.add(2, adapter.make_trigger(partial_assignment_grace=0, position_store="group"))
        await wait_until(lambda: bool(first.failures) and bool(second.failures), timeout=60, what="both fail")
    for runner in (first, second):
        [error] = runner.failures.values()
        assert isinstance(error, PartialAssignmentError)
        assert "Several triggerers" in str(error) and adapter.group_id in str(error)


async def test_with_on_partial_assignment_warn_the_stream_keeps_running(adapter: KafkaAdapter) -> None:
    await adapter.publish(orders(6))
    first = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    second = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    async with first, second:
        warn: dict[str, Any] = {"on_partial_assignment": "warn", "position_store": "group"}
        first.add(1, adapter.make_trigger(partial_assignment_grace=0, **warn))
        second.add(2, adapter.make_trigger(partial_assignment_grace=0, **warn))
        await wait_until_async(lambda: fully_committed(adapter), timeout=60)
        assert not first.failures and not second.failures
    # Together they saw everything, but each saw only part of the topic: what "warn" accepts.
    assert first.count(1) + second.count(2) >= 6


async def test_a_rebalance_never_commits_outcomes_for_a_revoked_partition(adapter: KafkaAdapter) -> None:
    await adapter.publish(orders(6))
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, adapter.make_trigger(on_partial_assignment="warn", position_store="group"))
        await wait_until(lambda: len(runner.pending) == 6, timeout=30, what="6 fired, not persisted")
        # A second member joins the group: partitions are revoked from our consumer mid-flight.
        intruder = AIOKafkaConsumer(
            adapter.topic, bootstrap_servers=adapter.bootstrap, group_id=adapter.group_id, enable_auto_commit=False
        )
        await intruder.start()
        try:
            await wait_until_async(lambda: _assigned(intruder), timeout=60)
            runner.persist()  # outcomes for partitions we lost arrive now
            await wait_until(lambda: not runner.pending, timeout=10, what="persisted")
            committed = await adapter.committed()
            for tp in intruder.assignment():
                assert committed[tp.partition] == 0, f"committed {tp} after losing it"
        finally:
            await intruder.stop()


async def _assigned(consumer: AIOKafkaConsumer) -> bool:
    await consumer.getmany(timeout_ms=100)
    return bool(consumer.assignment())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"enable.auto.commit": "true"}, "enable.auto.commit=true"),
        ({"sasl.mechansim": "PLAIN"}, "unsupported Kafka setting 'sasl.mechansim'"),
    ],
)
async def test_bad_connections_fail_the_group_with_a_clear_error(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], message: str
) -> None:
    conn = {"conn_type": "kafka", "extra": {"bootstrap.servers": adapter.bootstrap, **extra}}
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_BAD", json.dumps(conn))
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, adapter.make_trigger(kafka_config_id="kafka_bad"))
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="failure")
    assert isinstance(runner.failures[1], SharedStreamConfigError)
    assert message in str(runner.failures[1])


async def test_an_unreachable_broker_fails_with_the_address(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devkit.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    conn = {"conn_type": "kafka", "extra": {"bootstrap.servers": address, "request.timeout.ms": 2000}}
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DOWN", json.dumps(conn))
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, adapter.make_trigger(kafka_config_id="kafka_down"))
        await wait_until(lambda: 1 in runner.failures, timeout=60, what="failure")
    assert address in str(runner.failures[1])


@pytest.mark.parametrize("watchers", [1, 10])
async def test_a_backlog_behind_the_executor_hop_overflows_nobody(
    adapter: KafkaAdapter, queue_size: int, watchers: int
) -> None:
    """The runner's per-event thread hop makes watchers slower than a fetch; credit keeps them whole."""
    count = 3000
    await adapter.publish(orders(count))
    manager = SharedStreamManager(max_subscriber_queue=queue_size)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.02) as runner:
        for trigger_id in range(watchers):
            runner.add(trigger_id, adapter.make_trigger(max_batch_size=500))
        await wait_until_async(lambda: _done_or_failed(adapter, runner), timeout=120)
        assert not runner.failures, runner.failures
    assert all(runner.count(t) == count for t in range(watchers))


async def _done_or_failed(adapter: KafkaAdapter, runner: RunnerSim) -> bool:
    return bool(runner.failures) or await fully_committed(adapter)
