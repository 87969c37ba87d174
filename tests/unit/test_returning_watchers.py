"""
Returning watchers (``_core/cohort.py``): a watcher the manager force-fails (an ack timeout, a full
queue) is left out of every later broadcast until the triggerer re-creates its trigger. On a queue
broker the siblings' acks used to settle what it missed meanwhile: lost for it. Found by the
30-minute production run (docs/production.md: Pub/Sub and Redis, the busiest watcher, 535 and 384
orders). Now the stream reads nothing while such a watcher is away (at most ``cohort_max_wait``),
and a message broadcast without a watcher of its audience is given back instead of settled.

Driven through the real ``SharedStreamManager`` with the in-memory broker (a queue: what is
settled is gone) and a fake clock for the ack timeout. The first test has a negative control: with
both halves of the fix switched off, the re-created watcher misses the messages read while it was
away.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from typing import Any

import pytest
from airflow.triggers.shared_stream import AckTimeout, AdvanceItem, AdvanceOutcome, SharedStreamManager

from airflow_shared_stream_provider._core.cohort import Cohort
from airflow_shared_stream_provider._core.flow import FlowGate
from devkit.memory import MemoryBroker, MemorySharedStreamProducer, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import FakeClock, RunnerSim, wait_until

_names = itertools.count()
FIRST = 3  # messages both watchers fire on before watcher 2 is force-failed
WHILE_AWAY = 5  # messages published while it is away


@pytest.fixture
def broker() -> Any:
    name = f"returning-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


def trigger(broker: MemoryBroker) -> MemorySharedStreamTrigger:
    return MemorySharedStreamTrigger(broker_name=broker.name)


def publish(broker: MemoryBroker, start: int, count: int) -> list[str]:
    return [broker.publish(json.dumps({"order_id": i})) for i in range(start, start + count)]


async def force_fail_watcher_2(runner: RunnerSim, broker: MemoryBroker, clock: FakeClock) -> list[str]:
    """Both watchers fire on the first messages; watcher 2's events never persist: its ack timeout strikes."""
    first = publish(broker, 0, FIRST)
    runner.add(1, trigger(broker))
    runner.add(2, trigger(broker))
    await wait_until(
        lambda: len(set(runner.message_ids(1))) == FIRST and sum(p.trigger_id == 2 for p in runner.pending) == FIRST,
        timeout=10,
        what="both watchers fired on the first messages",
    )
    clock.now += 1.0  # past the ack timeout
    await wait_until(lambda: 2 in runner.failures, timeout=10, what="watcher 2 force-failed")
    assert isinstance(runner.failures[2], AckTimeout)
    return first


async def run_away_and_back(broker: MemoryBroker) -> tuple[list[str], RunnerSim]:
    """Watcher 2 is force-failed, messages arrive while it is away, the triggerer re-creates it."""
    clock = FakeClock()
    manager = SharedStreamManager(ack_timeout=0.1, _now=clock)
    async with RunnerSim(manager, withhold={2}, confirm_interval=0.01) as runner:
        first = await force_fail_watcher_2(runner, broker, clock)
        later = publish(broker, FIRST, WHILE_AWAY)
        await asyncio.sleep(0.5)  # the triggerer takes its time to re-create the failed trigger
        runner.failures.clear()
        runner.withhold.clear()
        runner.pending = [p for p in runner.pending if p.trigger_id != 2]  # the failed one's never persist
        runner.add(2, trigger(broker))
        everything = first + later
        await wait_until(
            lambda: set(broker.committed) >= set(everything) or len(broker.available) == 0 == len(broker.in_flight),
            timeout=20,
            what="every message settled",
        )
        await wait_until(lambda: set(broker.committed) == set(everything), timeout=5, what="every message committed")
    return everything, runner


async def test_a_force_failed_watcher_misses_nothing_read_while_it_was_away(
    broker: MemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider._core.cohort")
    everything, runner = await run_away_and_back(broker)
    assert set(runner.message_ids(1)) == set(everything)
    # Before the fix the messages published while it was away were committed by watcher 1's acks
    # alone, and watcher 2 never had them.
    assert set(runner.message_ids(2)) == set(everything), sorted(set(everything) - set(runner.message_ids(2)))
    assert broker.dead_letters == []
    assert "reads nothing until watcher" in caplog.text
    assert "reads again: watcher" in caplog.text


async def test_negative_control_without_the_fix_the_returning_watcher_loses_what_was_read_meanwhile(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MemorySharedStreamProducer, "gives_back_missed_messages", False)
    leave = Cohort.leave
    monkeypatch.setattr(Cohort, "leave", lambda self, token, failed=False: leave(self, token))
    everything, runner = await run_away_and_back(broker)
    missed = set(everything) - set(runner.message_ids(2))
    # At least what was published while it was away (its first messages' redelivery may have gone
    # to watcher 1 alone as well).
    assert missed >= set(everything[FIRST:]), "the negative control lost less than what was read while it was away"


async def test_a_watcher_that_does_not_come_back_is_waited_for_at_most_cohort_max_wait(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_MAX_WAIT", "0.5")
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider._core.cohort")
    clock = FakeClock()
    manager = SharedStreamManager(ack_timeout=0.1, _now=clock)
    async with RunnerSim(manager, withhold={2}, confirm_interval=0.01) as runner:
        first = await force_fail_watcher_2(runner, broker, clock)
        later = publish(broker, FIRST, WHILE_AWAY)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Watcher 1 gets everything once the stream stops waiting (never re-created: its Dag gone).
        await wait_until(lambda: set(broker.committed) == set(first + later), timeout=20, what="committed")
        waited = loop.time() - started
    assert waited >= 0.4, waited  # it did wait (the bound is 0.5 s, measured from the failure)
    assert set(runner.message_ids(1)) >= set(first + later)
    assert "reads again without watcher(s)" in caplog.text


async def test_a_cancelled_watcher_is_not_waited_for(broker: MemoryBroker, caplog: pytest.LogCaptureFixture) -> None:
    """A watcher removed on purpose (its Dag paused or deleted) leaves; the stream goes on at once."""
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider._core.cohort")
    first = publish(broker, 0, FIRST)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        runner.add(1, trigger(broker))
        runner.add(2, trigger(broker))
        await wait_until(lambda: set(broker.committed) == set(first), timeout=10, what="first committed")
        await runner.remove(2)
        later = publish(broker, FIRST, WHILE_AWAY)
        await wait_until(lambda: set(broker.committed) == set(first + later), timeout=5, what="later committed")
    assert "reads nothing until" not in caplog.text


async def test_a_message_broadcast_without_a_watcher_of_its_audience_is_given_back(broker: MemoryBroker) -> None:
    """The audience rule alone: two watchers registered at the broadcast, one ack: not settled."""
    [message_id] = publish(broker, 0, 1)
    producer = MemorySharedStreamTrigger.create_shared_stream_producer(trigger(broker).serialize()[1])
    assert isinstance(producer, MemorySharedStreamProducer)
    gate = producer.gate
    gate.register(101)
    gate.register(102)
    stream: Any = producer.open_stream()
    try:
        _, payload = await anext(stream)
        assert payload.message.audience == 2
        await producer.advance([AdvanceItem(payload, AdvanceOutcome(acked=1, failed=0, rejected=0))])
        assert broker.actions == [(message_id, "redeliver")]
        # Not counted toward the poison cap: the message did nothing wrong (a collateral failure).
        assert producer._forgiven is not None and producer._forgiven.get(message_id) == 1
        # The shortfall holds the intake until the registered watchers change (_core/flow.py) ...
        assert producer.credit() == 0
        # ... here: the force-failed watcher leaves and the triggerer re-creates it.
        gate.unregister(102)
        gate.register(102)
        assert producer.credit() > 0
        _, again = await anext(stream)
        await producer.advance([AdvanceItem(again, AdvanceOutcome(acked=2, failed=0, rejected=0))])
        assert broker.actions[-1] == (message_id, "commit")
        assert again.delivery_attempt == 2
    finally:
        gate.unregister(101)
        gate.unregister(102)
        await stream.aclose()
        await producer.aclose()


# -- a force-failed watcher that has not left yet (a shortfall, _core/flow.py) ---------------------
STUCK = threading.Event()


def stuck_on_order_0(envelope: dict[str, Any]) -> bool:
    """Blocks (in its filter thread) on order 0 until the test lets it go."""
    if envelope["body"]["order_id"] == 0:
        STUCK.wait(timeout=30)
    return True


def stuck_trigger(broker: MemoryBroker) -> MemorySharedStreamTrigger:
    return MemorySharedStreamTrigger(
        broker_name=broker.name, filter_function=f"{__name__}.stuck_on_order_0", filter_mode="thread"
    )


async def run_stuck_watcher(broker: MemoryBroker, *, settle: bool = True) -> tuple[list[str], RunnerSim, int]:
    """
    Watcher 2 is force-failed while its filter is stuck on order 0 (it stays registered: it has
    not pulled the failure yet); orders 1-5 arrive meanwhile. Returns the ids, the runner and the
    redeliveries counted while it was stuck. ``settle``: then wait until every order is committed.
    """
    STUCK.clear()
    clock = FakeClock()
    manager = SharedStreamManager(ack_timeout=0.1, _now=clock)
    async with RunnerSim(manager, confirm_interval=0.01) as runner:
        [first] = publish(broker, 0, 1)
        runner.add(1, trigger(broker))
        runner.add(2, stuck_trigger(broker))
        await wait_until(lambda: runner.message_ids(1) == [first], timeout=10, what="watcher 1 fired on order 0")
        clock.now += 1.0  # watcher 2 is past its ack timeout, stuck in its filter
        later = publish(broker, 1, WHILE_AWAY)
        await asyncio.sleep(0.5)  # the stream runs on with watcher 2 failed but still registered
        redelivered_while_stuck = sum(1 for _, action in broker.actions if action != "commit")
        STUCK.set()  # the filter returns; watcher 2 pulls its failure and leaves
        if not settle:
            return [first, *later], runner, redelivered_while_stuck
        await wait_until(lambda: 2 in runner.failures, timeout=10, what="watcher 2 force-failed")
        assert isinstance(runner.failures[2], AckTimeout)
        runner.failures.clear()
        runner.add(2, stuck_trigger(broker))  # the triggerer re-creates it (its filter passes now)
        everything = [first, *later]
        await wait_until(lambda: set(broker.committed) == set(everything), timeout=20, what="every message committed")
    return everything, runner, redelivered_while_stuck


async def test_a_force_failed_watcher_that_has_not_left_yet_stops_the_intake(broker: MemoryBroker) -> None:
    everything, runner, redelivered_while_stuck = await run_stuck_watcher(broker)
    print(f"given back while stuck, with the hold: {redelivered_while_stuck}")
    # Order 0 (failed with watcher 2) and what was read in the persistence round before the
    # producer saw the shortfall go back; then nothing is read until watcher 2 leaves.
    assert redelivered_while_stuck <= 4 * (1 + WHILE_AWAY), broker.actions
    assert set(runner.message_ids(2)) == set(everything)
    assert broker.dead_letters == []


async def test_negative_control_without_the_shortfall_hold_messages_go_round_while_it_is_stuck(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FlowGate, "shortfall", lambda self, missed, generation, stream: None)
    _, _, redelivered_while_stuck = await run_stuck_watcher(broker, settle=False)
    print(f"given back while stuck, without the hold: {redelivered_while_stuck}; dead letters {broker.dead_letters}")
    assert redelivered_while_stuck > 4 * (1 + WHILE_AWAY), "no storm without the hold: the test would not see one"
    # What the storm costs: valid messages reach the collateral ceiling and are dead-lettered.
    assert broker.dead_letters, "the storm dead-lettered nothing"
