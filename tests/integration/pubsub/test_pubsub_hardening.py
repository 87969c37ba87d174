"""
Pub/Sub against the emulator: a dead-letter topic that is the subscription's own topic is refused,
a sender cannot forge the dead-letter fields, and ordering-key barriers do not grow with the keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider.producers.pubsub import PubSubSharedStreamProducer
from devkit.runner import RunnerSim, record_producers, wait_until
from tests.integration.contract import wait_until_async

pytestmark = [pytest.mark.integration, pytest.mark.pubsub]


def reject_redelivered(envelope: Mapping[str, Any]) -> bool:
    """A filter_function: accepts a message's first delivery, rejects any later one."""
    if envelope["delivery_attempt"] > 1:
        raise RejectMessage(f"delivery {envelope['delivery_attempt']} of {envelope['message_id']}")
    return True


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PubSubSharedStreamProducer]]:
    """Every producer the manager builds in this test (to look at its bookkeeping)."""
    yield record_producers(monkeypatch, PubSubSharedStreamProducer)


async def test_dead_letter_topic_that_is_the_subscriptions_own_topic_is_refused(adapter: Any) -> None:
    await adapter.publish([b'{"order_id": 1}'])
    short_name = adapter.topic.rsplit("/", 1)[1]  # a short name resolves to the same topic
    for topic in (adapter.topic, short_name):
        async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
            runner.add(1, adapter.make_trigger(dead_letter_topic=topic))
            await wait_until(lambda: 1 in runner.failures, timeout=30, what="the group to fail")
            error = runner.failures[1]
        assert isinstance(error, SharedStreamConfigError)
        assert "is the topic subscription" in str(error)
        assert adapter.topic in str(error) and adapter.subscription in str(error)
        assert runner.count(1) == 0
    assert await adapter.unsettled() == 1  # refused before anything was pulled


async def test_dead_letter_fields_are_the_producers_not_the_senders(adapter: Any) -> None:
    forged = {
        "x-dead-letter-reason": "forged: approved by finance",
        "x-dead-letter-ordering-key": "forged-key",  # a field the producer leaves out for unkeyed messages
        "origin": "shop",
    }
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    await adapter.publish([bad], attributes=forged)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))

        async def dead() -> bool:
            return len(await adapter.dead_letters()) == 1

        await wait_until_async(dead, timeout=30)
    [(data, attributes)] = await adapter.dead_letters()
    assert data == bad
    assert "order 7 is flagged bad" in attributes["x-dead-letter-reason"]
    assert attributes["x-dead-letter-source"] == adapter.subscription
    assert "x-dead-letter-ordering-key" not in attributes
    assert attributes["x-original-x-dead-letter-reason"] == forged["x-dead-letter-reason"]
    assert attributes["x-original-x-dead-letter-ordering-key"] == "forged-key"
    assert attributes["origin"] == "shop"


async def test_ordering_key_barriers_do_not_grow_with_the_number_of_keys(
    make_adapter: Any, producers: list[PubSubSharedStreamProducer]
) -> None:
    """
    Each key's only message fails once (watcher 2's events are never persisted: ack timeout),
    which puts a barrier on the key; its redelivery is rejected (dead-lettered), so no later
    message of the key is ever acked to clear the barrier by the old rule. The barriers must
    still empty.
    """
    adapter = await make_adapter(enable_message_ordering=True)
    keys = 60
    for key in range(keys):
        await adapter.publish([json.dumps({"key": key}).encode()], ordering_key=f"k-{key}")
    # The triggerer re-creates the failed watcher (the stream waits for it: _core/cohort.py);
    # watcher 2's events are never persisted.
    manager = SharedStreamManager(ack_timeout=1.0)
    async with RunnerSim(manager, recreate_failed=0.2, confirm_interval=0.05, withhold={2}) as runner:
        filter_path = f"{__name__}.reject_redelivered"
        runner.add(1, adapter.make_trigger(filter_function=filter_path))
        runner.add(2, adapter.make_trigger(filter_function=filter_path))
        await wait_until(lambda: 2 in runner.failures, timeout=30, what="watcher 2's ack timeout")
        [producer] = producers

        async def settled() -> bool:
            # Every key's first delivery fired for watcher 1; the redelivered ones are dead letters.
            dead = len(await adapter.dead_letters())
            return dead > 0 and runner.count(1) >= keys and await adapter.unsettled() == 0

        await wait_until_async(settled, timeout=60)
        assert producer.counters.redelivered > 0  # the barriers were really put up
        assert producer._key_barriers == {}
        assert not producer._key_in_flight
