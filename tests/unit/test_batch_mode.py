"""
Batch mode (``batch_size > 1``) and the ``flush_after`` marker on the real ``SharedStreamManager``.

Every guarantee must hold per message although one asset event carries many: nothing is
advanced before the batch's events are persisted, a rejected message is dead-lettered alone, a
failed watcher brings the whole batch back, lanes never mix, and the payload stays under the cap.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any

import pytest
from airflow.triggers.shared_stream import AckTimeout, SharedStreamManager

from airflow_shared_stream_provider import RejectMessage
from airflow_shared_stream_provider._core.batching import Batcher, MessageBatch
from airflow_shared_stream_provider._core.envelope import StreamMessage
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.producer import Delivery
from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import FakeClock, RunnerSim, wait_until

_names = itertools.count()


@pytest.fixture
def broker() -> Any:
    name = f"batch-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


def trigger(broker: MemoryBroker, **kwargs: Any) -> MemorySharedStreamTrigger:
    kwargs.setdefault("batch_size", 10)
    kwargs.setdefault("batch_timeout", 0.05)
    return MemorySharedStreamTrigger(broker_name=broker.name, **kwargs)


def publish(broker: MemoryBroker, count: int, *, lane: str = "", start: int = 0, **extra: Any) -> list[str]:
    return [broker.publish(json.dumps({"order_id": i, **extra}), lane=lane) for i in range(start, start + count)]


def delivered(runner: RunnerSim, trigger_id: int) -> list[str]:
    """Message ids a watcher's persisted events carried, in order (batch payloads unpacked)."""
    ids: list[str] = []
    for payload in runner.persisted.get(trigger_id, []):
        assert set(payload) == {"messages"}, payload
        ids.extend(envelope["message_id"] for envelope in payload["messages"])
    return ids


async def persist_until(runner: RunnerSim, predicate: Any, *, what: str, timeout: float = 10.0) -> None:
    def step() -> bool:
        runner.persist()
        return bool(predicate())

    await wait_until(step, timeout=timeout, what=what)


def reject_odd(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"]["order_id"] % 2:
        raise RejectMessage(f"odd order {envelope['body']['order_id']}")
    return True


def fail_on_three(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"]["order_id"] == 3 and envelope["delivery_attempt"] == 1:
        raise KeyError("customer")
    return True


# -- the batcher's cut rules -------------------------------------------------------------------


def _delivery(message_id: str, lane: str = "", body: str = "") -> Delivery:
    message = StreamMessage({"message_id": message_id, "body": body, "lane": lane}, 0)
    return Delivery(message, 1)


def _batcher(**kwargs: Any) -> Batcher:
    options: dict[str, Any] = {"batch_size": 3, "batch_timeout": 1.0, "max_payload_bytes": 65536}
    options.update(kwargs)
    return Batcher(lane_of=lambda delivery: delivery.message.envelope["lane"], **options)


def test_a_batch_is_cut_when_full_and_lanes_never_mix() -> None:
    batcher = _batcher()
    for index, lane in enumerate("aababba"):
        batcher.add(_delivery(f"m{index}", lane), now=0.0)
    ready = list(batcher.ready())
    assert [[m.envelope["message_id"] for m in b.messages] for b in ready] == [["m0", "m1", "m3"], ["m2", "m4", "m5"]]
    assert [b.lane for b in ready] == ["a", "b"]
    assert batcher.pending_messages == 1  # m6 waits for its lane's batch to fill or time out


def test_a_partly_filled_batch_waits_batch_timeout_from_its_first_message() -> None:
    batcher = _batcher()
    batcher.add(_delivery("m0", "a"), now=10.0)
    batcher.add(_delivery("m1", "a"), now=10.8)
    assert batcher.next_deadline() == 11.0
    batcher.due(10.99)
    assert list(batcher.ready()) == []
    batcher.due(11.0)
    [batch] = list(batcher.ready())
    assert len(batch) == 2
    assert batcher.next_deadline() is None


def test_a_batch_is_cut_before_the_payload_cap() -> None:
    body = "x" * 300
    batcher = _batcher(batch_size=100, max_payload_bytes=1024)
    for index in range(7):
        batcher.add(_delivery(f"m{index}", "a", body), now=0.0)
    batcher.flush()
    batches = list(batcher.ready())
    assert [len(b) for b in batches] == [2, 2, 2, 1]
    for batch in batches:
        payload = json.dumps({"messages": [m.envelope for m in batch.messages]}, separators=(",", ":"))
        assert len(payload) <= 1024


def test_batch_settings_are_checked_and_part_of_the_key(broker: MemoryBroker) -> None:
    with pytest.raises(SharedStreamConfigError, match="batch_size"):
        trigger(broker, batch_size=0)
    with pytest.raises(SharedStreamConfigError, match="batch_size"):
        trigger(broker, batch_size=2.5)
    with pytest.raises(SharedStreamConfigError, match="batch_timeout"):
        trigger(broker, batch_timeout=-1)
    assert trigger(broker, batch_size=10).shared_stream_key() != trigger(broker, batch_size=20).shared_stream_key()
    # Per-message mode stays the default: one envelope per event.
    assert MemorySharedStreamTrigger(broker_name=broker.name).settings.batch_size == 1


# -- on the real manager -----------------------------------------------------------------------


async def test_a_backlog_fills_batches_and_every_watcher_gets_every_message(broker: MemoryBroker) -> None:
    ids = publish(broker, 25)
    async with RunnerSim(SharedStreamManager()) as runner:
        for trigger_id in (1, 2, 3):
            runner.add(trigger_id, trigger(broker))
        await wait_until(lambda: len(runner.pending) >= 9, timeout=10, what="three batches per watcher")
        assert broker.committed == []  # nothing advanced before the events are persisted
        await persist_until(runner, lambda: len(broker.committed) == 25, what="25 commits")
        assert not runner.failures
    for trigger_id in (1, 2, 3):
        assert delivered(runner, trigger_id) == ids
        assert [len(p["messages"]) for p in runner.persisted[trigger_id]] == [10, 10, 5]
    counters = broker.producers[-1].counters
    assert (counters.received, counters.committed, counters.batches) == (25, 25, 3)


async def test_a_rejected_message_is_dead_lettered_alone_its_neighbours_are_committed(broker: MemoryBroker) -> None:
    ids = publish(broker, 10)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.reject_odd"))
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: len(broker.committed) + len(broker.dead_letters) == 10, what="settled")
    assert broker.committed == ids[0::2]
    assert [message_id for message_id, _ in broker.dead_letters] == ids[1::2]
    assert all("rejected by 1 watcher(s): odd order" in reason for _, reason in broker.dead_letters)
    assert delivered(runner, 1) == ids[0::2]
    assert delivered(runner, 2) == ids  # the other watcher fired on every message
    assert broker.producers[-1].counters.rejected == 5


async def test_a_crash_before_persistence_commits_nothing_and_the_batch_comes_back(broker: MemoryBroker) -> None:
    ids = publish(broker, 5)
    clock = FakeClock()
    async with RunnerSim(SharedStreamManager(ack_timeout=0.1, _now=clock)) as runner:
        runner.add(1, trigger(broker))
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="one batch event")
        assert runner.crash() == 1  # the triggerer died before the event was persisted
        clock.now += 1.0  # the manager gives up on the lost event: the watcher is failed
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="watcher failed by the ack timeout")
        assert isinstance(runner.failures[1], AckTimeout)
        assert broker.committed == []
        await runner.remove(1)
        runner.failures.clear()
        runner.add(1, trigger(broker))  # the triggerer re-creates the watcher
        await persist_until(runner, lambda: len(broker.committed) == 5, what="redelivered and committed")
    # Each once; not necessarily in order: a message the stopping producer had received ahead is
    # abandoned on its close and comes back behind the others.
    assert sorted(delivered(runner, 1)) == ids
    assert min(envelope["delivery_attempt"] for envelope in runner.persisted[1][0]["messages"]) >= 2


async def test_a_watcher_that_fails_on_one_message_brings_its_whole_batch_back(broker: MemoryBroker) -> None:
    ids = publish(broker, 6)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.fail_on_three", on_filter_error="fail"))
        runner.add(2, trigger(broker))
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="watcher 1 stopped")
        assert isinstance(runner.failures[1], KeyError)
        await persist_until(runner, lambda: len(broker.actions) >= 6, what="the batch advanced")
        assert broker.committed == []
        assert [action for _, action in broker.actions] == ["redeliver"] * 6
        await runner.remove(1)
        runner.failures.clear()
        runner.add(1, trigger(broker, filter_function=f"{__name__}.fail_on_three", on_filter_error="fail"))
        await persist_until(runner, lambda: len(broker.committed) == 6, what="committed on the second attempt")
    assert delivered(runner, 1) == ids


async def test_lanes_are_batched_apart_and_keep_their_order(broker: MemoryBroker) -> None:
    lane_a = publish(broker, 7, lane="a")
    lane_b = publish(broker, 7, lane="b", start=100)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, lanes=True, batch_size=3))
        await persist_until(runner, lambda: len(broker.committed) == 14, what="14 commits")
    for payload in runner.persisted[1]:
        lanes = {envelope["metadata"]["lane"] for envelope in payload["messages"]}
        assert len(lanes) == 1, payload
    ids = delivered(runner, 1)
    assert [i for i in ids if i in lane_a] == lane_a
    assert [i for i in ids if i in lane_b] == lane_b


async def test_a_trickle_is_delivered_after_batch_timeout_without_filling_a_batch(broker: MemoryBroker) -> None:
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, batch_size=1000, batch_timeout=0.05))
        [message_id] = publish(broker, 1)
        await persist_until(runner, lambda: broker.committed == [message_id], what="the lone message committed")
    assert delivered(runner, 1) == [message_id]


async def test_the_payload_of_a_batch_event_stays_under_max_payload_bytes(broker: MemoryBroker) -> None:
    publish(broker, 20, pad="y" * 400)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, batch_size=100, max_payload_bytes=4096))
        await persist_until(runner, lambda: len(broker.committed) == 20, what="20 commits")
    sizes = [len(json.dumps(p, separators=(",", ":"))) for p in runner.persisted[1]]
    assert len(sizes) > 1
    assert max(sizes) <= 4096
    assert len(delivered(runner, 1)) == 20


async def test_flow_control_counts_batches_so_a_backlog_never_overflows_a_watcher(
    broker: MemoryBroker, queue_size: int
) -> None:
    ids = publish(broker, 3000)  # 300 batches: five times what a watcher's queue holds
    manager = SharedStreamManager(max_subscriber_queue=queue_size)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.01) as runner:
        runner.add(1, trigger(broker))
        runner.add(2, trigger(broker))
        await wait_until(lambda: len(broker.committed) == 3000, timeout=30, what="3000 commits")
        assert not runner.failures  # no watcher was failed by an overflowing queue
    assert delivered(runner, 1) == ids
    assert delivered(runner, 2) == ids


# -- flush_after: the marker for Airflow 3.3's stranded tail ------------------------------------


async def test_flush_after_emits_at_most_three_markers_per_quiet_period(broker: MemoryBroker) -> None:
    loop = asyncio.get_running_loop()
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, batch_size=1, flush_after=0.2))
        runner.add(2, trigger(broker, batch_size=1))
        ids = publish(broker, 3)
        await persist_until(runner, lambda: len(broker.committed) == 3, what="3 commits")
        quiet_since = loop.time()

        def markers(trigger_id: int) -> list[dict[str, Any]]:
            return [p for p in runner.persisted.get(trigger_id, []) if p.get("marker") == "flush"]

        await persist_until(runner, lambda: len(markers(1)) == 1, what="the first flush marker")
        first_after = loop.time() - quiet_since
        assert markers(1)[0]["after_message_id"] == ids[-1]
        assert markers(2) == []  # opt-in: the sibling emits none
        # Then after 3x and 7x flush_after (a marker may itself be stranded behind a waiting run).
        await persist_until(runner, lambda: len(markers(1)) == 3, what="the third flush marker")
        assert loop.time() - quiet_since >= 1.3  # 7 x 0.2 s, minus the persistence round
        assert first_after < 1.0
        for _ in range(40):  # quiet goes on: no fourth marker
            runner.persist()
            await asyncio.sleep(0.02)
        assert len(markers(1)) == 3
        more = publish(broker, 1, start=10)
        await persist_until(runner, lambda: len(markers(1)) == 4, what="a marker after the next burst")
        assert markers(1)[-1]["after_message_id"] == more[0]
        assert not runner.failures


async def test_flush_after_keeps_rejections_per_message(broker: MemoryBroker) -> None:
    ids = publish(broker, 4)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, batch_size=1, flush_after=5, filter_function=f"{__name__}.reject_odd"))
        await persist_until(runner, lambda: len(broker.committed) + len(broker.dead_letters) == 4, what="settled")
    assert broker.committed == ids[0::2]
    assert [message_id for message_id, _ in broker.dead_letters] == ids[1::2]


async def test_flush_after_works_in_batch_mode_and_markers_are_no_messages(broker: MemoryBroker) -> None:
    ids = publish(broker, 12)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, flush_after=0.2))
        await persist_until(runner, lambda: len(broker.committed) == 12, what="12 commits")
        await persist_until(
            runner, lambda: any(p.get("marker") for p in runner.persisted[1]), what="a marker after the backlog"
        )
    batches = [p for p in runner.persisted[1] if "messages" in p]
    assert [e["message_id"] for p in batches for e in p["messages"]] == ids
    markers = [p for p in runner.persisted[1] if "marker" in p]
    assert markers and all(marker["after_message_id"] == ids[-1] for marker in markers)


def test_message_batch_repr_names_its_first_message() -> None:
    batch = MessageBatch("a", [], [StreamMessage({"message_id": "m0"}, 0)])
    assert "m0" in repr(batch)
