"""
The SDK's prefetch stays within the byte budget (``max_in_flight_bytes``), on the test broker.

The broker announces its maximum message size (4 MiB) on the link's attach; with the default
``prefetch_count=100`` and a small budget the producer lowers the prefetch so that a full SDK
buffer of maximum-size messages fits half the budget. Checked through the SDK receiver's own
prefetch setting and through the broker's count of messages locked to the consumer, which counts
what the SDK prefetched as well as what the stream holds.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from azure.servicebus import ServiceBusMessage

from airflow_shared_stream_provider._core.producer import HELD_OVERHEAD
from airflow_shared_stream_provider.producers.servicebus import ServiceBusSharedStreamProducer
from airflow_shared_stream_provider.producers.servicebus_types import budget_prefetch
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import ServiceBusEnv

pytestmark = [pytest.mark.integration, pytest.mark.servicebus, pytest.mark.timeout(180)]

MiB = 1024 * 1024
BROKER_MAX = 4 * MiB  # tests/servicebus_broker's default max_message_size, announced on its links
BUDGET = 24 * MiB
MESSAGES = 40
BODY = 1 * MiB


def body(i: int) -> bytes:
    return f"{i:08d}".encode().ljust(BODY, b"x")


async def test_default_prefetch_is_lowered_to_fit_the_byte_budget(
    sb: ServiceBusEnv,
    sb_conn: str,
    producers: list[ServiceBusSharedStreamProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not sb.local:
        pytest.skip("needs the test broker's count of locked messages")
    queue = await sb.create_queue("prefetch", lock_duration=60)
    assert sb.client is not None
    async with sb.client.get_queue_sender(queue) as sender:  # one by one: a batch is capped at 1 MiB
        for i in range(MESSAGES):
            await sender.send_messages(ServiceBusMessage(body(i)))
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider")
    manager = SharedStreamManager(ack_timeout=120)
    async with RunnerSim(manager) as runner:  # manual persistence: nothing is settled until persist()
        runner.add(
            1,
            ServiceBusSharedStreamTrigger(
                queue_name=queue,
                azure_service_bus_conn_id=sb_conn,
                max_wait_time=0.5,
                max_in_flight_bytes=BUDGET,
                oversize_policy="truncate",
            ),
        )
        await wait_until(lambda: len(runner.pending) >= 5, timeout=60, what="the first events")
        producer = producers[0]
        # A full buffer of 4 MiB messages (each held as body + envelope cap + overhead) fits in
        # half of 24 MiB twice: prefetch 2, not 100.
        held = BROKER_MAX + min(BROKER_MAX, producer.max_envelope_bytes) + HELD_OVERHEAD
        expected = budget_prefetch(ceiling=100, budget_bytes=BUDGET, receivers=1, message_bytes=held)
        assert expected == 2
        assert producer.prefetch == expected
        receiver = producer._receiver
        assert receiver is not None
        assert receiver._prefetch_count == expected  # the SDK receiver's own setting
        assert producer.sdk_buffered_messages() == expected
        lowered = [r.getMessage() for r in caplog.records if "prefetch_count lowered" in r.getMessage()]
        assert len(lowered) == 1, lowered
        assert "from 100 to 2" in lowered[0] and f"{BROKER_MAX} bytes" in lowered[0]

        # Nothing is confirmed, so the stream stops receiving once the budget is full; then the
        # broker's locks are what the stream holds plus at most the SDK's link credit
        # (prefetch + 1). With prefetch 100 the broker locked the whole backlog to the link.
        gate = producer.gate
        settled_in_flight = -1
        for _ in range(50):
            await asyncio.sleep(0.2)
            if gate.in_flight == settled_in_flight:
                break
            settled_in_flight = gate.in_flight
        locked = sb.handle.counts(queue).locked
        assert gate.held_bytes <= BUDGET + BODY + HELD_OVERHEAD
        assert locked <= gate.in_flight + expected + 1, (locked, gate.in_flight)
        assert locked < MESSAGES

        await wait_until_async(lambda: _all_settled(sb, queue, runner), timeout=120)
        assert not runner.failures
    # Every message delivered once, completed once, none abandoned, released (the receiver re-created
    # before its first receive held nothing), expired or dead-lettered.
    seen = [envelope["metadata"]["sequence_number"] for envelope in runner.persisted[1]]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == MESSAGES
    assert all(envelope["delivery_attempt"] == 1 for envelope in runner.persisted[1])
    stats = sb.handle.entity_stats(queue)
    assert stats["completed"] == MESSAGES
    assert stats["abandoned"] == stats["released"] == stats["lock_expired"] == stats["dead_lettered"] == 0
    counts = sb.handle.counts(queue)
    assert counts.active == counts.locked == counts.dead_lettered == 0


async def _all_settled(sb: ServiceBusEnv, queue: str, runner: RunnerSim) -> bool:
    runner.persist()
    assert sb.handle is not None
    return int(sb.handle.entity_stats(queue)["completed"]) >= MESSAGES


async def test_session_receivers_share_the_prefetch_budget(
    sb: ServiceBusEnv,
    sb_conn: str,
    producers: list[ServiceBusSharedStreamProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With sessions the budget's half is split between the receivers held at once; the first
    session receiver, attached before the maximum was known, is closed unused and accepted again."""
    if not sb.local:
        pytest.skip("needs the test broker's settlement record")
    budget = 40 * MiB
    queue = await sb.create_queue("prefetch-sessions", lock_duration=60, requires_session=True)
    per_session = 10
    for session_id in ("A", "B", "C"):
        await sb.publish(queue, [f"{session_id}-{n}".encode() for n in range(per_session)], session_id=session_id)
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider")
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(
            1,
            ServiceBusSharedStreamTrigger(
                queue_name=queue,
                azure_service_bus_conn_id=sb_conn,
                max_wait_time=0.5,
                sessions=True,
                max_concurrent_sessions=2,
                max_in_flight_bytes=budget,
            ),
        )
        await wait_until(lambda: bool(producers), timeout=30, what="the producer")
        producer = producers[0]
        held = BROKER_MAX + min(BROKER_MAX, producer.max_envelope_bytes) + HELD_OVERHEAD
        expected = budget_prefetch(ceiling=100, budget_bytes=budget, receivers=2, message_bytes=held)
        assert expected == 2  # 20 MiB shared by 2 receivers of 4 MiB messages, not 100 each
        prefetches: set[int] = set()

        async def done() -> bool:
            pool = producer._sessions
            if pool is not None:
                prefetches.update(session.receiver._prefetch_count for session in pool.sessions())
            assert sb.handle is not None
            return int(sb.handle.entity_stats(queue)["completed"]) >= 3 * per_session

        await wait_until_async(done, timeout=60)
        assert not runner.failures
        assert producer.prefetch == expected
        assert producer.sdk_buffered_messages() == 2 * expected
        assert prefetches == {expected}, prefetches  # every session receiver that received
    lowered = [r.getMessage() for r in caplog.records if "prefetch_count lowered" in r.getMessage()]
    assert len(lowered) == 1, lowered
    assert "from 100 to 2 per receiver: 2 receiver(s)" in lowered[0]
    bodies = [envelope["body"] for envelope in runner.persisted[1]]
    assert sorted(bodies) == sorted(f"{s}-{n}" for s in "ABC" for n in range(per_session))
    assert all(envelope["delivery_attempt"] == 1 for envelope in runner.persisted[1])
    stats = sb.handle.entity_stats(queue)
    assert stats["completed"] == 3 * per_session
    assert stats["abandoned"] == stats["lock_expired"] == stats["dead_lettered"] == 0
