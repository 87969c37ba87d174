"""What only Service Bus has: peek-lock settlement, lock renewal and expiry, the DLQ, delivery_count."""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider.producers.servicebus import (
    POISON_REASON,
    REJECTED_REASON,
    ServiceBusSharedStreamProducer,
)
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import ServiceBusEnv

pytestmark = [pytest.mark.integration, pytest.mark.servicebus, pytest.mark.timeout(120)]

FIXED_QUEUE = bool(os.environ.get("SERVICEBUS_CONNECTION_STRING") and os.environ.get("SERVICEBUS_QUEUE"))
needs_lock_control = pytest.mark.skipif(
    FIXED_QUEUE, reason="SERVICEBUS_QUEUE is a pre-declared queue: its lock duration cannot be set per test"
)


def reject_everything(envelope: Mapping[str, Any]) -> bool:
    raise RejectMessage(f"order {envelope['body']['order_id']} refused by the test")


def trigger(queue: str, conn_id: str, **kwargs: Any) -> ServiceBusSharedStreamTrigger:
    return ServiceBusSharedStreamTrigger(
        queue_name=queue, azure_service_bus_conn_id=conn_id, max_wait_time=0.5, **kwargs
    )


def order(i: int) -> bytes:
    return json.dumps({"order_id": i}).encode()


def stat(sb: ServiceBusEnv, queue: str, name: str) -> int:
    assert sb.handle is not None
    return int(sb.handle.entity_stats(queue)[name])


async def test_complete_happens_only_after_persistence(sb: ServiceBusEnv, sb_conn: str) -> None:
    queue = await sb.create_queue(lock_duration=30)
    await sb.publish(queue, [order(i) for i in range(5)], attributes={"kind": "order"})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:  # manual persistence
        runner.add(1, trigger(queue, sb_conn))
        await wait_until(lambda: len(runner.pending) >= 5, timeout=30, what="5 fired events")
        assert await sb.unsettled(queue) == 5
        if sb.local:
            assert sb.handle.counts(queue).locked == 5
            assert stat(sb, queue, "completed") == 0
        runner.persist()
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
        assert not runner.failures
    envelope = runner.persisted[1][0]
    assert envelope["broker"] == "servicebus"
    assert envelope["source"] == queue
    assert envelope["attributes"] == {"kind": "order"}
    assert envelope["delivery_attempt"] == 1
    assert envelope["metadata"]["sequence_number"] >= 1
    assert envelope["published_at"]
    assert await sb.dead_letters(queue) == []
    if sb.local:
        assert stat(sb, queue, "completed") == 5


async def test_failed_message_is_abandoned_and_redelivered_with_delivery_count_plus_one(
    sb: ServiceBusEnv, sb_conn: str
) -> None:
    queue = await sb.create_queue(lock_duration=30)
    await sb.publish(queue, [order(1)])
    manager = SharedStreamManager(ack_timeout=1.0)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger(queue, sb_conn))
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="the ack timeout failing the watcher")
        runner.crash()  # its event never reached the DB
    assert type(runner.failures[1]).__name__ == "AckTimeout"
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(2, trigger(queue, sb_conn))
        await wait_until_async(lambda: _settled(sb, queue), timeout=20)  # well before the 30 s lock expires
    (envelope,) = runner.persisted[2]
    assert envelope["delivery_attempt"] == 2
    assert envelope["metadata"]["delivery_count"] == 1
    if sb.local:
        assert stat(sb, queue, "abandoned") == 1
        assert stat(sb, queue, "lock_expired") == 0


async def test_rejected_message_lands_in_the_dlq_with_reason_and_description(sb: ServiceBusEnv, sb_conn: str) -> None:
    queue = await sb.create_queue()
    await sb.publish(queue, [order(7)], attributes={"kind": "order"})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, trigger(queue, sb_conn, filter_function=f"{__name__}.reject_everything"))
        runner.add(2, trigger(queue, sb_conn))
        await wait_until_async(lambda: _dead_lettered(sb, queue, 1), timeout=30)
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
    (dead,) = await sb.dead_letters(queue)
    assert dead.body == order(7)
    assert dead.reason == REJECTED_REASON
    assert dead.description is not None and "order 7 refused by the test" in dead.description
    assert runner.count(2) == 1  # the other watcher still fired; the reject wins for the broker


@needs_lock_control
async def test_locks_are_renewed_while_a_watcher_works(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue(lock_duration=2)
    await sb.publish(queue, [order(1), order(2)])
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger(queue, sb_conn))
        await wait_until(lambda: len(runner.pending) >= 2, timeout=30, what="2 fired events")
        await wait_until(
            lambda: producers[0].counters.leases_renewed >= 4, timeout=20, what="two renewals of each lock"
        )
        # Three lock durations later, nothing was redelivered behind the watcher's back.
        assert await sb.unsettled(queue) == 2
        if sb.local:
            assert sb.handle.counts(queue).locked == 2
            assert stat(sb, queue, "lock_expired") == 0
            assert stat(sb, queue, "lock_renewed") >= 4
        runner.persist()
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
        assert not runner.failures
    assert sorted(p["delivery_attempt"] for p in runner.persisted[1]) == [1, 1]
    assert producers[0].counters.leases_lost == 0


@needs_lock_control
async def test_crash_before_confirmation_redelivers_after_lock_expiry(
    sb: ServiceBusEnv, sb_conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = await sb.create_queue(lock_duration=2)
    await sb.publish(queue, [order(i) for i in range(3)])

    async def die(self: ServiceBusSharedStreamProducer, receiver: Any) -> None:
        return None  # a killed triggerer settles nothing and abandons nothing

    with monkeypatch.context() as patch:
        patch.setattr(ServiceBusSharedStreamProducer, "_finish", die)
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager) as runner:
            runner.add(1, trigger(queue, sb_conn, renew_locks=False))
            await wait_until(lambda: len(runner.pending) >= 3, timeout=30, what="3 fired events")
            runner.crash()
    assert await sb.unsettled(queue) == 3  # still there, locked until expiry
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, trigger(queue, sb_conn))
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
    assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == [0, 1, 2]
    assert {p["delivery_attempt"] for p in runner.persisted[1]} == {2}
    if sb.local:
        assert stat(sb, queue, "lock_expired") == 3


async def test_poison_cap_dead_letters_after_max_delivery_attempts(sb: ServiceBusEnv, sb_conn: str) -> None:
    queue = await sb.create_queue(lock_duration=30, max_delivery_count=10)
    await sb.publish(queue, [order(9)])
    for attempt in (1, 2):
        manager = SharedStreamManager(ack_timeout=1.0)
        async with RunnerSim(manager) as runner:
            runner.add(attempt, trigger(queue, sb_conn, max_delivery_attempts=2))
            failures = runner.failures
            await wait_until(partial(operator.contains, failures, attempt), timeout=30, what=f"attempt {attempt} fails")
            assert runner.pending[0].event.payload["delivery_attempt"] == attempt
            runner.crash()
    await wait_until_async(lambda: _dead_lettered(sb, queue, 1), timeout=30)
    (dead,) = await sb.dead_letters(queue)
    assert dead.body == order(9)
    assert dead.reason == POISON_REASON
    assert dead.description is not None and "max_delivery_attempts=2" in dead.description
    assert await sb.unsettled(queue) == 0


@needs_lock_control
async def test_lost_lock_is_counted_and_the_group_keeps_running(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue(lock_duration=1)
    await sb.publish(queue, [order(1)])
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger(queue, sb_conn, renew_locks=False))
        await wait_until(lambda: len(runner.pending) >= 1, timeout=30, what="the first delivery")
        if sb.local:
            await sb.handle.async_wait_until(lambda b: b.entity_stats(queue)["lock_expired"] >= 1, timeout=10)
        else:
            import asyncio

            await asyncio.sleep(2.5)
        runner.persist()  # too late: completing it finds the lock lost
        await wait_until(lambda: producers[0].counters.leases_lost >= 1, timeout=30, what="the lost lock counted")
        # Same group, same watcher: the broker's redelivery arrives and is completed this time.
        await wait_until(lambda: runner.count(1) + len(runner.pending) >= 2, timeout=30, what="the redelivery")
        runner.persist()
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
        assert runner.alive(1)
        assert not runner.failures
    assert [p["delivery_attempt"] for p in runner.persisted[1]] == [1, 2]
    assert len(producers) == 1


async def test_a_lock_lost_at_renewal_is_counted_once_and_the_redelivery_completes(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    if not sb.local:
        pytest.skip("expires a lock on demand: needs the test broker")
    queue = await sb.create_queue(lock_duration=2)
    await sb.publish(queue, [order(1)])
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger(queue, sb_conn))
        await wait_until(lambda: len(runner.pending) >= 1, timeout=30, what="the first delivery")
        sb.handle.call(partial(_expire_every_lock, queue))
        # The broker redelivers at once (delivery_count + 1); the renewal (a third of the lock
        # duration before expiry) then finds the first lock lost ...
        await wait_until(lambda: len(runner.pending) >= 2, timeout=30, what="the broker's redelivery")
        await wait_until(lambda: producers[0].counters.leases_lost >= 1, timeout=30, what="renewal finds it lost")
        # ... and completing the first delivery fails the same way: still one lost lock.
        runner.persist()
        await wait_until_async(lambda: _settled(sb, queue), timeout=30)
        assert not runner.failures
    assert [p["delivery_attempt"] for p in runner.persisted[1]] == [1, 2]
    assert producers[0].counters.leases_lost == 1
    assert stat(sb, queue, "lock_expired") == 1


def _expire_every_lock(queue: str, broker: Any) -> None:
    entity = broker.entity(queue)
    for message in list(entity.messages.values()):
        if message.state == "locked":
            entity._expire(message)
    broker.dispatch(entity)


async def test_topic_subscription_stream(sb: ServiceBusEnv, sb_conn: str) -> None:
    if not sb.local:
        pytest.skip("creating a topic needs the test broker or administration rights (not in this suite)")
    sb.handle.create_topic("orders")
    sb.handle.create_subscription("orders", "airflow", lock_duration=30)
    sb.handle.create_subscription("orders", "other", lock_duration=30)
    assert sb.client is not None
    async with sb.client.get_topic_sender("orders") as sender:
        from azure.servicebus import ServiceBusMessage

        await sender.send_messages([ServiceBusMessage(order(i)) for i in range(4)])
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        for i in (1, 2):
            runner.add(
                i,
                ServiceBusSharedStreamTrigger(
                    topic_name="orders",
                    subscription_name="airflow",
                    azure_service_bus_conn_id=sb_conn,
                    max_wait_time=0.5,
                ),
            )
        await wait_until(lambda: runner.count(1) >= 4 and runner.count(2) >= 4, timeout=30, what="4 events each")
        await sb.handle.async_wait_until(
            lambda b: (
                b.counts("orders/Subscriptions/airflow").active == 0
                and b.counts("orders/Subscriptions/airflow").locked == 0
            ),
            timeout=30,
        )
    assert runner.persisted[1][0]["source"] == "orders/Subscriptions/airflow"
    assert sb.handle.counts("orders/Subscriptions/other").active == 4  # the other subscription is untouched


async def _settled(sb: ServiceBusEnv, queue: str) -> bool:
    return await sb.unsettled(queue) == 0


async def _dead_lettered(sb: ServiceBusEnv, queue: str, count: int) -> bool:
    return len(await sb.dead_letters(queue)) >= count


async def test_missing_entity_fails_the_group_with_an_error_naming_it(sb: ServiceBusEnv, sb_conn: str) -> None:
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger("no-such-queue", sb_conn))
        runner.add(2, trigger("no-such-queue", sb_conn, match={"body.x": 1}))
        await wait_until(lambda: len(runner.failures) == 2, timeout=60, what="both watchers to fail")
    for error in runner.failures.values():
        assert isinstance(error, SharedStreamConfigError)
        assert "no-such-queue" in str(error)
        assert "servicebus_it" in str(error)
        assert "SharedAccessKey=" not in str(error)
    if sb.local:
        sb.handle.clear_errors()
