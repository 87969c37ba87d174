"""
The byte budget (``max_in_flight_bytes``, ``_core/flow.py``): what a stream holds in flight is
bounded in bytes, not only in messages, on the real ``SharedStreamManager`` with the in-memory
broker, and nothing is lost to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.flow import MIN_START_IN_FLIGHT, FlowGate, gates
from airflow_shared_stream_provider._core.producer import DEFERRED_BYTES_SHARE, HELD_OVERHEAD, Decided
from devkit.memory import MemoryBroker, MemorySharedStreamProducer, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until
from tests.unit.test_core_on_manager import trigger

MiB = 1024 * 1024
_names = itertools.count()


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"bytes-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


def publish_large(broker: MemoryBroker, count: int, size: int) -> list[str]:
    return [broker.publish(str(i).encode().ljust(size, b"x")) for i in range(count)]


def held_weight(size: int) -> int:
    """What one message of ``size`` bytes with no attributes weighs once its body is dropped (truncate)."""
    return size + HELD_OVERHEAD


def deferred_bytes(producer: MemorySharedStreamProducer) -> int:
    """Bytes of the advanced messages the producer's deferred release still holds."""
    return sum(e.delivery.message.held_bytes for e in producer.deferred._held if isinstance(e, Decided))


def fired_ids(runner: RunnerSim, trigger_id: int) -> list[str]:
    """Message ids a watcher fired for, one per message (batch events unpacked)."""
    ids: list[str] = []
    for payload in runner.persisted.get(trigger_id, []):
        messages: list[dict[str, Any]] = payload.get("messages") or [payload]
        ids.extend(message["message_id"] for message in messages)
    return ids


async def drain(runner: RunnerSim, broker: MemoryBroker, total: int) -> tuple[int, int]:
    """Persist until ``total`` commits; return the peak bytes held in flight and deferred."""
    peak_deferred = 0

    def step() -> bool:
        nonlocal peak_deferred
        runner.persist()
        if broker.producers:
            peak_deferred = max(peak_deferred, deferred_bytes(broker.producers[-1]))
        return len(broker.committed) == total

    await wait_until(step, timeout=30, what=f"{total} commits")
    producer: MemorySharedStreamProducer = broker.producers[-1]
    # Every message advanced gave its bytes back.
    assert producer.gate.held_bytes == 0
    return producer.peak_held_bytes, peak_deferred


@pytest.mark.parametrize("batch_size", [1, 10])
async def test_a_backlog_of_large_messages_holds_the_budget_plus_at_most_one_message(
    broker: MemoryBroker, batch_size: int
) -> None:
    budget, size, count = 4 * MiB, MiB, 40
    ids = publish_large(broker, count, size)
    options = {"max_in_flight_bytes": budget, "oversize_policy": "truncate", "batch_size": batch_size}
    async with RunnerSim(SharedStreamManager()) as runner:
        for trigger_id in (1, 2, 3):
            runner.add(trigger_id, trigger(broker, **options))
        peak, peak_deferred = await drain(runner, broker, count)
    assert not runner.failures
    # The budget bounds what is held; a receive may start just below it (one message over).
    assert budget // 2 < peak <= budget + held_weight(size)
    # Advanced messages waiting for their gradual release stay within their share of the budget.
    assert peak_deferred <= budget // DEFERRED_BYTES_SHARE
    # Nothing lost: every watcher fired once for every message, each committed once.
    for trigger_id in (1, 2, 3):
        assert sorted(fired_ids(runner, trigger_id)) == sorted(ids)
    assert sorted(broker.committed) == sorted(ids)
    assert not broker.dead_letters


async def test_a_client_that_copies_each_receive_gets_receives_that_fit_with_their_copies(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    ``receive_copies`` (Pub/Sub: gRPC's buffer, the protobuf, our copy): a receive starts only when
    what is held plus its messages, counted that many times, fits the budget, so what is held
    peaks ``copies - 1`` messages below it; nothing is lost to the stricter rule.
    """
    monkeypatch.setattr(MemorySharedStreamProducer, "receive_copies", 3)
    budget, size, count = 8 * MiB, MiB, 30
    ids = publish_large(broker, count, size)
    async with RunnerSim(SharedStreamManager()) as runner:
        for trigger_id in (1, 2, 3):
            runner.add(trigger_id, trigger(broker, max_in_flight_bytes=budget, oversize_policy="truncate"))
        peak, _ = await drain(runner, broker, count)
    assert not runner.failures
    weight = held_weight(size)
    # The last receive started with held + 3 x weight <= budget, and brought one message.
    assert peak + 2 * weight <= budget
    for trigger_id in (1, 2, 3):
        assert sorted(fired_ids(runner, trigger_id)) == sorted(ids)
    assert sorted(broker.committed) == sorted(ids)


async def test_a_message_larger_than_the_budget_flows_alone(broker: MemoryBroker) -> None:
    budget, size, count = MiB, 2 * MiB, 5
    ids = publish_large(broker, count, size)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, max_in_flight_bytes=budget, oversize_policy="truncate"))
        peak, _ = await drain(runner, broker, count)
    assert peak == held_weight(size)  # one at a time: never a second one while one is held
    assert sorted(fired_ids(runner, 1)) == sorted(ids)


async def test_messages_abandoned_on_close_give_their_bytes_back(broker: MemoryBroker) -> None:
    publish_large(broker, 6, MiB)
    watcher = trigger(broker, max_in_flight_bytes=4 * MiB, oversize_policy="truncate")
    key = watcher.shared_stream_key()
    gate = gates.acquire(key)  # outlives the producer, as it would for the next one
    try:
        runner = RunnerSim(SharedStreamManager())
        async with runner:
            runner.add(1, watcher)
            await wait_until(lambda: gate.held_bytes > 0 and len(runner.pending) > 0, timeout=10, what="held")
            # Never persisted: the stop abandons what is in flight to the broker.
        assert gate.held_bytes == 0
        assert len(broker.available) == 6  # all handed back, none lost
    finally:
        gates.release(key, gate)


def test_byte_credit_counts_the_remaining_budget_at_the_size_estimate() -> None:
    gate = FlowGate()
    gate.max_in_flight_bytes = 10 * MiB
    assert gate.byte_credit() == 10 * MiB  # nothing seen: the message bounds decide
    gate.hold_bytes(2 * MiB)
    assert gate.byte_credit() == 4  # 8 MiB left at 2 MiB each
    gate.hold_bytes(7 * MiB)
    assert gate.byte_credit() == 1  # below the budget: a receive may start
    gate.hold_bytes(MiB)
    assert gate.byte_credit() == 0  # at the budget: none
    assert gate.credit() == 0
    gate.release_bytes(10 * MiB)
    gate.max_in_flight_bytes = MiB
    assert gate.byte_credit() == 1  # nothing held: one message always flows, however large


def test_byte_credit_counts_each_receive_copies_times() -> None:
    gate = FlowGate()
    gate.max_in_flight_bytes = 10 * MiB
    gate.receive_copies = 3
    gate.hold_bytes(MiB)
    assert gate.byte_credit() == 3  # 9 MiB left, each message of the receive counted 3 MiB
    gate.hold_bytes(7 * MiB)
    # 2 MiB left: not even one message with its copies; held messages leave first.
    assert gate.byte_credit() == 0
    assert gate.credit() == 0
    gate.release_bytes(8 * MiB)
    gate.max_in_flight_bytes = 2 * MiB
    assert gate.byte_credit() == 1  # nothing held: one message always flows
    gate.receive_copies = 1
    gate.hold_bytes(MiB + MiB // 2)
    assert gate.byte_credit() == 1  # one copy: a receive may start just below the budget, as before


def test_before_the_first_message_the_broker_maximum_is_assumed() -> None:
    gate = FlowGate()
    gate.max_in_flight_bytes = 64 * MiB
    gate.expect_size(MiB)
    assert gate.byte_credit() == 64
    gate.expect_size(10 * MiB)  # 6, but not below slow start's first round
    assert gate.byte_credit() == MIN_START_IN_FLIGHT
    gate.hold_bytes(MiB)  # the first message replaces the prior
    assert gate.size_estimate == MiB
    gate.expect_size(10 * MiB)  # a later producer on the same gate keeps what was seen
    assert gate.size_estimate == MiB
    # An SDK's count-based buffer (prefetch) is reserved at the estimate.
    gate.buffered_messages = 3
    assert gate.byte_credit() == (64 - 1 - 3) * MiB // MiB
    gate.buffered_messages = 100  # at most half the budget: the rest is over it whatever we do
    assert gate.byte_credit() == (64 - 1 - 32) * MiB // MiB


def test_the_size_estimate_decays_after_a_large_message() -> None:
    gate = FlowGate()
    gate.hold_bytes(10 * MiB)
    for _ in range(200):
        gate.hold_bytes(1024)
    assert gate.size_estimate == 1024


def test_the_budget_is_validated() -> None:
    with pytest.raises(SharedStreamConfigError, match="max_in_flight_bytes"):
        trigger(memory_broker("unused"), max_in_flight_bytes=1024)
    with pytest.raises(SharedStreamConfigError, match="max_in_flight_bytes"):
        trigger(memory_broker("unused"), max_in_flight_bytes=True)
    brokers.pop("unused", None)
