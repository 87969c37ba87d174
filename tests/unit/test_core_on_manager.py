"""
The shared core on the real ``SharedStreamManager``: fan-out, filters, dispositions, poison cap,
flow control. The broker is the in-memory one from ``devkit.memory`` (a real producer on the
core); time is a fake clock injected into the manager, so ack timeouts happen when the test says.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any

import pytest
from airflow.triggers.shared_stream import AckTimeout, AdvanceItem, AdvanceOutcome, SharedStreamManager

from airflow_shared_stream_provider import RejectMessage
from devkit.memory import MemoryBroker, MemorySharedStreamProducer, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import FakeClock, RunnerSim, wait_until

_names = itertools.count()


@pytest.fixture
def broker() -> Any:
    name = f"unit-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def trigger(broker: MemoryBroker, **kwargs: Any) -> MemorySharedStreamTrigger:
    return MemorySharedStreamTrigger(broker_name=broker.name, **kwargs)


def publish_orders(broker: MemoryBroker, count: int, **extra: Any) -> list[str]:
    regions = ("eu", "us", "apac")
    return [broker.publish(json.dumps({"order_id": i, "region": regions[i % 3], **extra})) for i in range(count)]


async def persist_until(runner: RunnerSim, predicate: Any, *, what: str, timeout: float = 10.0) -> None:
    """Run supervisor sync rounds (persist + confirm) until ``predicate`` holds."""

    def step() -> bool:
        runner.persist()
        return bool(predicate())

    await wait_until(step, timeout=timeout, what=what)


def high_value(envelope: Mapping[str, Any]) -> bool:
    return envelope["body"]["order_id"] % 2 == 0


def reject_odd(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"]["order_id"] % 2:
        raise RejectMessage(f"odd order {envelope['body']['order_id']}")
    return True


def broken_filter(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"]["order_id"] == 1:
        raise KeyError("customer")
    return True


async def test_fan_out_each_watcher_fires_on_what_it_matches(broker: MemoryBroker) -> None:
    publish_orders(broker, 30)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker))
        runner.add(2, trigger(broker, match={"body.region": "eu"}))
        runner.add(3, trigger(broker, match={"body.region": ["us", "apac"]}, filter_function=f"{__name__}.high_value"))
        await persist_until(runner, lambda: len(broker.committed) == 30, what="30 commits")
        assert not runner.failures
    assert runner.count(1) == 30
    assert {p["body"]["region"] for p in runner.persisted[2]} == {"eu"}
    assert runner.count(2) == 10
    fired3 = sorted(p["body"]["order_id"] for p in runner.persisted[3])
    assert fired3 == [i for i in range(30) if i % 3 != 0 and i % 2 == 0]
    counters = broker.producers[-1].counters
    assert (counters.received, counters.committed, counters.advanced) == (30, 30, 30)
    assert counters.fired == 30 + 10 + len(fired3)
    # One envelope per message, shared by every watcher that fired on it.
    first = {p["message_id"]: p for p in runner.persisted[1]}
    assert all(first[p["message_id"]] is p for p in runner.persisted[2])


async def test_nothing_is_committed_before_the_events_are_persisted(broker: MemoryBroker) -> None:
    publish_orders(broker, 5)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker))
        await wait_until(lambda: len(runner.pending) == 5, timeout=10, what="5 fired events")
        assert broker.committed == []
        assert len(broker.in_flight) == 5
        runner.persist()
        await wait_until(lambda: len(broker.committed) == 5, timeout=10, what="commits after persistence")


async def test_reject_dead_letters_with_the_watchers_reason(broker: MemoryBroker) -> None:
    publish_orders(broker, 4)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.reject_odd"))
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: len(broker.committed) + len(broker.dead_letters) == 4, what="4 settled")
    assert len(broker.committed) == 2
    reasons = [reason for _, reason in broker.dead_letters]
    assert len(reasons) == 2
    assert all("rejected by 1 watcher(s)" in r for r in reasons)
    assert any("odd order 1" in r for r in reasons)
    assert runner.count(2) == 4  # the other watcher still fired; the reject decides the disposition


async def test_ack_timeout_fails_the_slow_watcher_and_redelivers_without_committing(
    broker: MemoryBroker, clock: FakeClock
) -> None:
    [message_id] = publish_orders(broker, 1)
    manager = SharedStreamManager(ack_timeout=0.1, _now=clock)
    async with RunnerSim(manager, withhold={2}) as runner:
        runner.add(1, trigger(broker))
        runner.add(2, trigger(broker))
        await wait_until(lambda: len(runner.pending) == 2, timeout=10, what="both watchers fired")
        runner.persist()  # watcher 1's event persists, watcher 2's never does
        assert broker.committed == []
        clock.now += 1.0  # past the ack timeout
        await wait_until(lambda: 2 in runner.failures, timeout=10, what="watcher 2 force-failed")
        assert isinstance(runner.failures[2], AckTimeout)
        # The triggerer re-creates the failed watcher (the stream waits for it: _core/cohort.py).
        runner.withhold.clear()
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: broker.committed == [message_id], what="commit after redelivery")
    assert ("unit" in message_id) and broker.actions[0] == (message_id, "redeliver")
    attempts = [p["delivery_attempt"] for p in runner.persisted[1]]
    # The healthy watcher saw it again, flagged as a redelivery; once more if the redelivery was
    # broadcast before watcher 2 was back (given back: it missed watcher 2).
    assert attempts[:2] == [1, 2]
    # The re-created watcher has the delivery that was committed (the failed one's event of the
    # first delivery is stored too: the supervisor persists what it was handed).
    assert runner.persisted[2][-1]["delivery_attempt"] == attempts[-1]


async def test_poison_cap_dead_letters_a_message_that_keeps_failing(broker: MemoryBroker, clock: FakeClock) -> None:
    [message_id] = publish_orders(broker, 1)
    manager = SharedStreamManager(ack_timeout=0.1, _now=clock)
    async with RunnerSim(manager, withhold={1}) as runner:
        for attempt in (1, 2):
            runner.add(1, trigger(broker, max_delivery_attempts=2))
            await wait_until(lambda: len(runner.pending) >= 1, timeout=10, what=f"attempt {attempt} fired")
            clock.now += 1.0
            await wait_until(lambda: 1 in runner.failures, timeout=10, what=f"attempt {attempt} failed")
            runner.failures.clear()
            runner.pending.clear()
            await runner.remove(1)
            advanced = attempt
            await wait_until(lambda: len(broker.actions) >= advanced, timeout=10, what="advance")  # noqa: B023
    # Between attempts the failed watcher is still subscribed but excluded from broadcasts, so the
    # redelivery may be held (nobody to deliver to) before the next watcher arrives.
    assert [action for _, action in broker.actions if action != "hold"] == ["redeliver", "dead_letter"]
    assert broker.dead_letters[0][0] == message_id
    assert "poison message: failed 2 delivery attempt(s)" in broker.dead_letters[0][1]


async def test_a_broadcast_nobody_was_subscribed_for_is_held_not_committed(broker: MemoryBroker) -> None:
    """All-zero counts (every watcher force-failed or gone at fan-out) mean HOLD: keep it, re-deliver later."""
    [message_id] = publish_orders(broker, 1)
    producer = MemorySharedStreamTrigger.create_shared_stream_producer(trigger(broker).serialize()[1])
    stream: Any = producer.open_stream()
    try:
        _, payload = await anext(stream)
        await producer.advance([AdvanceItem(payload, AdvanceOutcome(acked=0, failed=0, rejected=0))])
        assert broker.actions == [(message_id, "hold")]
        await wait_until(lambda: len(broker.available) == 1, timeout=5, what="held message back on the broker")
        assert broker.available[0].attempts == 0  # nobody saw it: not a delivery attempt
        assert broker.committed == [] and broker.dead_letters == []
    finally:
        await stream.aclose()
        await producer.aclose()


class ExplodingProducer(MemorySharedStreamProducer):
    async def _apply(self, decided: Any) -> None:
        raise RuntimeError("commit refused by the broker")


class ExplodingTrigger(MemorySharedStreamTrigger):
    producer_class_path = f"{__name__}.ExplodingProducer"


async def test_an_advance_that_raises_terminates_the_group_and_commits_nothing(broker: MemoryBroker) -> None:
    publish_orders(broker, 3)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, ExplodingTrigger(broker_name=broker.name))
        runner.add(2, ExplodingTrigger(broker_name=broker.name, match={"body.region": "eu"}))
        await persist_until(runner, lambda: len(runner.failures) == 2, what="both watchers failed")
    assert all("commit refused" in str(exc) for exc in runner.failures.values())
    assert broker.committed == []
    # The manager closes the terminated group's producer in its own task, possibly after both
    # watchers have seen the error: closing gives the in-flight messages back to the broker.
    await wait_until(lambda: len(broker.available) == 3, timeout=10, what="in-flight messages given back on close")
    assert broker.in_flight == {} and broker.committed == []


@pytest.mark.parametrize(
    ("policy", "expect_dead", "expect_fired"),
    [("reject", 1, 2), ("skip", 0, 2)],
)
async def test_a_filter_that_raises_follows_on_filter_error(
    broker: MemoryBroker, policy: str, expect_dead: int, expect_fired: int
) -> None:
    publish_orders(broker, 3)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.broken_filter", on_filter_error=policy))
        await persist_until(runner, lambda: len(broker.actions) == 3, what="3 advanced")
        assert runner.alive(1), "the watcher must keep running"
    assert len(broker.dead_letters) == expect_dead
    assert runner.count(1) == expect_fired
    if expect_dead:
        assert "filter raised KeyError" in broker.dead_letters[0][1]


async def test_on_filter_error_fail_ends_the_watcher_and_redelivers_the_message(broker: MemoryBroker) -> None:
    ids = publish_orders(broker, 3)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.broken_filter", on_filter_error="fail"))
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: 1 in runner.failures, what="watcher 1 failed")
        assert isinstance(runner.failures[1], KeyError)
        await persist_until(runner, lambda: len(broker.committed) == 3, what="all committed")
    # The manager resolved the choked-on message as accepted when watcher 1 left; the producer
    # still redelivered it (to watcher 2) instead of settling a message watcher 1 never handled.
    assert (ids[1], "redeliver") in broker.actions
    assert not broker.dead_letters
    assert [p["delivery_attempt"] for p in runner.persisted[2] if p["message_id"] == ids[1]] == [1, 2]


async def test_oversize_messages_are_dead_lettered_intact_by_default(broker: MemoryBroker) -> None:
    broker.publish(json.dumps({"blob": "x" * 4000}))
    broker.publish(json.dumps({"order_id": 1}))
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, max_payload_bytes=2048))
        await persist_until(runner, lambda: len(broker.actions) == 2, what="2 advanced")
    assert runner.count(1) == 1
    assert "payload too large" in broker.dead_letters[0][1]


async def test_oversize_messages_fire_truncated_when_asked(broker: MemoryBroker) -> None:
    broker.publish(json.dumps({"blob": "x" * 4000}), attributes={"type": "order"})
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, max_payload_bytes=2048, oversize_policy="truncate"))
        await persist_until(runner, lambda: len(broker.committed) == 1, what="committed")
    [event] = runner.persisted[1]
    assert event["body"] is None
    assert event["body_truncated"] is True
    assert event["body_bytes"] > 4000
    assert event["attributes"] == {"type": "order"}
    assert len(json.dumps(event)) <= 2048


@pytest.mark.parametrize("watchers", [1, 10])
async def test_a_backlog_never_overflows_watchers_behind_the_executor_hop(
    broker: MemoryBroker, queue_size: int, watchers: int
) -> None:
    """The runner logs each event through a thread executor; a backlog must not overflow anyone."""
    publish_orders(broker, 1500)
    manager = SharedStreamManager(max_subscriber_queue=queue_size)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.01) as runner:
        for trigger_id in range(watchers):
            runner.add(trigger_id, trigger(broker))
        await wait_until(lambda: len(broker.committed) == 1500 or bool(runner.failures), timeout=60, what="drain")
        assert not runner.failures, f"watchers failed: {runner.failures}"
    assert all(runner.count(t) == 1500 for t in range(watchers))


async def test_without_the_gate_the_same_backlog_overflows(broker: MemoryBroker, queue_size: int) -> None:
    """Negative control for the test above: a producer sized for a bigger queue overflows ours."""
    publish_orders(broker, 1500)
    manager = SharedStreamManager(max_subscriber_queue=queue_size // 8)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.01) as runner:
        runner.add(1, trigger(broker))
        await wait_until(lambda: bool(runner.failures), timeout=60, what="overflow")
    assert "exceeded maxsize" in str(runner.failures[1])


async def test_a_new_stream_fans_out_a_backlog_in_rounds_that_double(broker: MemoryBroker) -> None:
    """
    Slow start on the real manager: a stream that finds a backlog fans out a first round of 512
    events (128 messages for 4 watchers), and more only as rounds are persisted and advanced, so
    a triggerer killed soon after a restart has committed its first rounds instead of nothing.
    """
    ids = publish_orders(broker, 2_000)
    async with RunnerSim(SharedStreamManager()) as runner:
        for trigger_id in (1, 2, 3, 4):
            runner.add(trigger_id, trigger(broker))
        await wait_until(lambda: len(runner.pending) >= 4 * 128, timeout=10, what="the first round")
        await asyncio.sleep(0.3)  # nothing is persisted: nothing more may come
        assert len(runner.pending) == 4 * 128
        assert broker.committed == []
        runner.persist()
        await wait_until(lambda: len(broker.committed) == 128, timeout=10, what="the first round committed")
        await wait_until(lambda: len(runner.pending) >= 4 * 256, timeout=10, what="the second round")
        await asyncio.sleep(0.3)
        assert len(runner.pending) == 4 * 256
        await persist_until(runner, lambda: len(broker.committed) == 2_000, what="the backlog committed")
    assert all([p["message_id"] for p in runner.persisted[t]] == ids for t in (1, 2, 3, 4))
