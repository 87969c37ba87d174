"""What only Pub/Sub has: ack deadline extension, nack, dead-letter topic, ordering keys, delivery_attempt."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import orders, wait_until_async

pytestmark = [pytest.mark.integration, pytest.mark.pubsub]

NEVER = {"body.order_id": -1}


async def settled(adapter: Any, timeout: float = 30.0) -> None:
    async def check() -> bool:
        return bool(await adapter.unsettled() == 0)

    await wait_until_async(check, timeout=timeout)


def persist_except(runner: RunnerSim, dropped: set[int]) -> None:
    """One supervisor round in which the events of ``dropped`` watchers are lost (never confirmed)."""
    runner.pending = [p for p in runner.pending if p.trigger_id not in dropped]
    runner.persist()


async def persist_loop(runner: RunnerSim, dropped: set[int]) -> None:
    while True:
        await asyncio.sleep(0.05)
        persist_except(runner, dropped)


async def test_acked_only_after_persistence(adapter: Any) -> None:
    await adapter.publish(orders(5))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until(lambda: len(runner.pending) >= 5, timeout=30, what="5 fired events")
        assert await adapter.unsettled() == 5
        runner.persist()
        await settled(adapter)
        assert runner.count(1) == 5


async def test_failed_message_is_nacked_and_redelivered_promptly(adapter: Any) -> None:
    await adapter.publish(orders(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=1.0)) as runner:
        dropped = {2}
        persister = asyncio.create_task(persist_loop(runner, dropped=dropped))
        try:
            runner.add(1, adapter.make_trigger())  # persisted normally
            runner.add(2, adapter.make_trigger())  # its events never persist: ack timeout -> failed
            await wait_until(lambda: 2 in runner.failures, timeout=30, what="watcher 2's ack timeout")
            # The triggerer re-creates it (the stream waits for it: _core/cohort.py); it persists now.
            runner.pending = [p for p in runner.pending if p.trigger_id != 2]
            dropped.clear()
            runner.add(2, adapter.make_trigger())
            await wait_until(lambda: runner.count(1) >= 2, timeout=30, what="the redelivery")
            await settled(adapter)
        finally:
            persister.cancel()
    assert 2 in runner.failures  # AckTimeout
    first, again = runner.persisted[1][:2]
    assert first["message_id"] == again["message_id"]
    assert [first["delivery_attempt"], again["delivery_attempt"]] == [1, 2]


async def test_lease_extension_prevents_redelivery(adapter: Any) -> None:
    # The subscription's ack deadline is 10 s; the events stay unpersisted for 13 s.
    await adapter.publish(orders(3))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger(ack_deadline_seconds=10))
        await wait_until(lambda: len(runner.pending) >= 3, timeout=30, what="3 fired events")
        await asyncio.sleep(13)  # the point of the test is wall-clock time passing the deadline
        # Independent client: nothing is deliverable (every lease was extended) ...
        response = await adapter.subscriber.pull(
            request={"subscription": adapter.subscription, "max_messages": 10}, timeout=2, retry=None
        )
        assert list(response.received_messages) == []
        # ... and the watcher was not handed any message twice.
        assert len(runner.pending) == 3
        assert await adapter.unsettled() == 3
        runner.persist()
        await settled(adapter)


async def test_dead_letter_topic_gets_original_data_attributes_and_reason(adapter: Any) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    good = orders(2)
    await adapter.publish([good[0], bad, good[1]], attributes={"origin": "shop", "kind": "order"})
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await settled(adapter)
        await wait_until_async(lambda: _has_dead(adapter, 1), timeout=30)
    (data, attributes), *more = await adapter.dead_letters()
    assert not more
    assert data == bad
    assert attributes["origin"] == "shop"
    assert attributes["kind"] == "order"
    assert "order 7 is flagged bad" in attributes["x-dead-letter-reason"]
    assert attributes["x-dead-letter-source"] == adapter.subscription
    assert attributes["x-dead-letter-delivery-attempt"] == "1"
    assert attributes["x-dead-letter-message-id"]
    assert runner.count(1) == 2


async def _has_dead(adapter: Any, count: int) -> bool:
    return len(await adapter.dead_letters()) >= count


async def test_ordering_keys_are_lanes(make_adapter: Any) -> None:
    adapter = await make_adapter(enable_message_ordering=True)
    await adapter.publish([json.dumps({"key": "A", "n": n}).encode() for n in range(4)], ordering_key="A")
    await adapter.publish([json.dumps({"key": "B", "n": n}).encode() for n in range(4)], ordering_key="B")
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until(lambda: len(runner.pending) >= 8, timeout=30, what="8 fired events")
        # Persist only key B: lane B is acked while lane A is still held.
        held = [p for p in runner.pending if p.event.payload["metadata"]["ordering_key"] == "A"]
        runner.pending = [p for p in runner.pending if p not in held]
        runner.persist()

        async def only_a_left() -> bool:
            return bool(await adapter.unsettled() == 4)

        await wait_until_async(only_a_left, timeout=30)
        runner.pending = held
        runner.persist()
        await settled(adapter)
    fired = runner.persisted[1]
    for key in ("A", "B"):
        in_key = [p["body"]["n"] for p in fired if p["body"]["key"] == key]
        assert in_key == [0, 1, 2, 3]
        assert {p["metadata"]["ordering_key"] for p in fired if p["body"]["key"] == key} == {key}


async def test_poison_cap_uses_pubsub_delivery_attempt(make_adapter: Any) -> None:
    # A subscription with its own dead-letter policy, so Pub/Sub counts delivery attempts.
    policy_topic = f"{(await make_adapter()).topic}"  # any other topic will do as the policy's target
    adapter = await make_adapter(dead_letter_policy={"dead_letter_topic": policy_topic, "max_delivery_attempts": 10})
    await adapter.publish(orders(1))
    for _ in range(2):  # two earlier deliveries, nacked by someone else
        response = await adapter.subscriber.pull(
            request={"subscription": adapter.subscription, "max_messages": 1}, timeout=10, retry=None
        )
        (received,) = response.received_messages
        await adapter.subscriber.modify_ack_deadline(
            request={"subscription": adapter.subscription, "ack_ids": [received.ack_id], "ack_deadline_seconds": 0}
        )
    async with RunnerSim(SharedStreamManager(ack_timeout=1.0)) as runner:
        persister = asyncio.create_task(persist_loop(runner, dropped={2}))
        try:
            runner.add(1, adapter.make_trigger(max_delivery_attempts=3))
            runner.add(2, adapter.make_trigger(max_delivery_attempts=3))  # fails: ack timeout
            await wait_until_async(lambda: _has_dead(adapter, 1), timeout=30)
            await settled(adapter)
        finally:
            persister.cancel()
    assert [p["delivery_attempt"] for p in runner.persisted[1]] == [3]
    ((data, attributes),) = await adapter.dead_letters()
    assert data == orders(1)[0]
    assert attributes["x-dead-letter-delivery-attempt"] == "3"
    assert "poison" in attributes["x-dead-letter-reason"]


async def test_missing_subscription_fails_every_watcher_with_its_name(adapter: Any) -> None:
    from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger

    missing = adapter.subscription + "-missing"
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, PubSubSharedStreamTrigger(subscription=missing))
        runner.add(2, PubSubSharedStreamTrigger(subscription=missing, match=NEVER))
        await wait_until(lambda: len(runner.failures) == 2, timeout=30, what="both watchers failed")
    for exc in runner.failures.values():
        assert missing in str(exc)
        assert "does not exist" in str(exc)


async def test_ten_watchers_pull_full_batches_not_a_trickle_of_credit(
    adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Ten watchers, each event through the executor hop: the slowest watcher's queue bounds the
    credit and frees it a message at a time. The pulls still ask for full batches (before: ~8
    messages a pull, 247 pulls for 2,000 messages in stream_bench against 26 with one watcher).
    """
    from airflow_shared_stream_provider.producers.pubsub import PubSubSharedStreamProducer

    sizes: list[int] = []
    original = PubSubSharedStreamProducer._pull

    async def counting_pull(self: Any, pull_index: int, max_messages: int) -> Any:
        received = await original(self, pull_index, max_messages)
        if received:
            sizes.append(len(received))
        return received

    monkeypatch.setattr(PubSubSharedStreamProducer, "_pull", counting_pull)
    count, watchers = 1000, 10
    await adapter.publish(orders(count))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), executor_hop=True, confirm_interval=0.05) as runner:
        for i in range(watchers):
            runner.add(i, adapter.make_trigger())
        await wait_until(
            lambda: all(runner.count(i) >= count for i in range(watchers)), timeout=120, what="every message x 10"
        )
    assert sum(sizes) >= count
    # 100 a pull once slow start is over (a few smaller first pulls): 10 + a margin, not ~125.
    assert len(sizes) <= 25, sizes
