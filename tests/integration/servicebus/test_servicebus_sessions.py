"""
Session-enabled entities (``sessions=True``) through the real SDK, against the test broker.

Each test drives the real ``SharedStreamManager`` through ``RunnerSim`` and asserts on the broker's
own record of what happened to each message (``BrokerHandle.history``: complete / abandon /
release / expire / dead_letter, in order, with the delivery count), independently of the producer.
That record is what the ordering guarantee is about, so these tests need the test broker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from airflow.triggers.base import TriggerEvent
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider.producers.servicebus import REJECTED_REASON, ServiceBusSharedStreamProducer
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import EXTERNAL, ServiceBusEnv

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servicebus,
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(EXTERNAL), reason="asserts on the test broker's settlement history"),
]


# -- filters used by the watchers (dotted paths) ------------------------------------------------------
def fail_a1_first_time(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"] == {"session": "A", "n": 1} and envelope["delivery_attempt"] == 1:
        raise RuntimeError("A-1 cannot be handled yet")
    return True


BROADCAST_ORDER: list[tuple[str, int, int]] = []
"""``(session, n, delivery_attempt)`` in the order ``record_order``'s watcher was handed them."""


def record_order(envelope: Mapping[str, Any]) -> bool:
    BROADCAST_ORDER.append((envelope["body"]["session"], envelope["body"]["n"], envelope["delivery_attempt"]))
    return True


def reject_a1(envelope: Mapping[str, Any]) -> bool:
    if envelope["body"] == {"session": "A", "n": 1}:
        raise RejectMessage("A-1 is refused by the test")
    return True


# -- helpers ---------------------------------------------------------------------------------------
def session_trigger(queue: str, conn_id: str, **kwargs: Any) -> ServiceBusSharedStreamTrigger:
    options: dict[str, Any] = {"max_wait_time": 0.5, "session_idle_timeout": 0.5}
    options.update(kwargs)
    return ServiceBusSharedStreamTrigger(queue_name=queue, azure_service_bus_conn_id=conn_id, sessions=True, **options)


async def publish_sessions(sb: ServiceBusEnv, queue: str, sessions: Mapping[str, int]) -> None:
    """Messages ``{"session": S, "n": i}`` with session id S, session after session (in order)."""
    for session_id, count in sessions.items():
        bodies = [json.dumps({"session": session_id, "n": i}).encode() for i in range(count)]
        await sb.publish(queue, bodies, session_id=session_id)


def seen(runner: RunnerSim, trigger_id: int, session_id: str) -> list[int]:
    """The ``n`` of every event a watcher persisted for one session, in persistence order."""
    return [p["body"]["n"] for p in runner.persisted[trigger_id] if p["body"]["session"] == session_id]


def events(sb: ServiceBusEnv, queue: str, session_id: str, *kinds: str) -> list[tuple[str, int, int]]:
    """``(event, sequence_number, delivery_count)`` the broker recorded for one session, in order."""
    return [
        (h.event, h.sequence_number, h.delivery_count)
        for h in sb.handle.history(queue)
        if h.session_id == session_id and (not kinds or h.event in kinds)
    ]


def completed(sb: ServiceBusEnv, queue: str, session_id: str) -> list[int]:
    return [seq for _, seq, _ in events(sb, queue, session_id, "complete")]


async def settled(sb: ServiceBusEnv, queue: str) -> bool:
    return await sb.unsettled(queue) == 0


async def persist_until(
    runner: RunnerSim,
    condition: Callable[[], bool],
    *,
    where: Callable[[int, TriggerEvent], bool] | None = None,
    timeout: float = 30,
    what: str = "",
) -> None:
    """Persist (only what ``where`` picks) every 50 ms until ``condition()``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or condition!r}")
        runner.persist_matching(where)
        await asyncio.sleep(0.05)


def is_a1_retry(_: int, event: TriggerEvent) -> bool:
    payload = event.payload
    return bool(payload["body"] == {"session": "A", "n": 1} and payload["delivery_attempt"] >= 2)


# -- tests -----------------------------------------------------------------------------------------
async def test_every_session_arrives_in_order_and_is_completed_only_after_persistence(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=30, requires_session=True)
    await publish_sessions(sb, queue, {"A": 4, "B": 4, "C": 4})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:  # manual persistence
        runner.add(1, session_trigger(queue, sb_conn, max_concurrent_sessions=3))
        runner.add(2, session_trigger(queue, sb_conn, max_concurrent_sessions=3, match={"body.session": "B"}))
        await wait_until(lambda: len(runner.pending) >= 16, timeout=30, what="12 + 4 fired events")
        assert await sb.unsettled(queue) == 12
        assert sb.handle.counts(queue).locked == 12
        assert [h for h in sb.handle.history(queue) if h.event == "complete"] == []
        runner.persist()
        await wait_until_async(lambda: settled(sb, queue), timeout=30)
        assert not runner.failures
    for session_id, first in (("A", 1), ("B", 5), ("C", 9)):
        assert seen(runner, 1, session_id) == [0, 1, 2, 3]
        assert completed(sb, queue, session_id) == [first, first + 1, first + 2, first + 3]
    assert seen(runner, 2, "B") == [0, 1, 2, 3]
    assert runner.count(2) == 4
    envelope = next(p for p in runner.persisted[1] if p["body"] == {"session": "C", "n": 2})
    assert (envelope["metadata"]["session_id"], envelope["delivery_attempt"]) == ("C", 1)
    assert {h.event for h in sb.handle.history(queue)} == {"complete"}
    counters = producers[0].counters
    assert (counters.sessions_accepted, counters.committed, counters.leases_lost) == (3, 12, 0)
    assert len(producers) == 1


async def test_a_failed_message_holds_its_session_while_other_sessions_progress(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=30, requires_session=True)
    await publish_sessions(sb, queue, {"A": 4, "B": 4})  # A: sequence numbers 1-4, B: 5-8
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        # Watcher 1 fails on A-1 (and so leaves the group); watcher 2 fires on everything.
        runner.add(
            1, session_trigger(queue, sb_conn, filter_function=f"{__name__}.fail_a1_first_time", on_filter_error="fail")
        )
        BROADCAST_ORDER.clear()
        runner.add(2, session_trigger(queue, sb_conn, filter_function=f"{__name__}.record_order"))
        # Keep A-1's redelivery unpersisted: session A stays held at A-1 while B must finish.
        await persist_until(
            runner,
            lambda: len(completed(sb, queue, "B")) == 4 and any(is_a1_retry(0, p.event) for p in runner.pending),
            where=lambda trigger_id, event: not is_a1_retry(trigger_id, event),
            what="session B completed while A-1 is redelivered and unconfirmed",
        )
        assert completed(sb, queue, "A") == [1]  # A-0 only: nothing after A-1 went past it
        assert sb.handle.session_locked(queue, "A")
        assert await sb.unsettled(queue) == 3  # are back on the broker, locked by us
        await persist_until(runner, lambda: sb.handle.counts(queue).locked == 0, what="everything completed")
        await wait_until_async(lambda: settled(sb, queue), timeout=30)
        assert runner.alive(2)
    assert isinstance(runner.failures.pop(1), RuntimeError)
    assert not runner.failures
    assert completed(sb, queue, "A") == [1, 2, 3, 4]
    assert completed(sb, queue, "B") == [5, 6, 7, 8]
    a_events = events(sb, queue, "A")
    # A-1 was abandoned (delivery counted) before anything later of A was settled; what the session
    # receiver still held (A-2, A-3, and A-1 again if already redelivered into its buffer) was
    # released when it closed (no delivery counted); nothing was completed ahead of A-1.
    assert a_events[:2] == [("complete", 1, 0), ("abandon", 2, 1)]
    assert {e for e in a_events if e[0] == "release"} <= {("release", 2, 1), ("release", 3, 0), ("release", 4, 0)}
    assert {e[0] for e in a_events} == {"complete", "abandon", "release"}
    assert [e for e in a_events if e[0] == "complete"] == [
        ("complete", 1, 0),
        ("complete", 2, 1),
        ("complete", 3, 0),
        ("complete", 4, 0),
    ]
    # Watcher 2 was handed session A in order, and after the hold A again from A-1 on (A-2 and A-3
    # may have been handed out before the hold too: at least once, never out of order per run).
    a_order = [(n, attempt) for session, n, attempt in BROADCAST_ORDER if session == "A"]
    assert a_order[:2] == [(0, 1), (1, 1)]
    assert a_order[-3:] == [(1, 2), (2, 1), (3, 1)]
    assert [n for n, _ in a_order[2:-3]] in ([], [2], [2, 3])
    b_order = [n for session, n, _ in BROADCAST_ORDER if session == "B"]
    assert sorted(set(b_order)) == [0, 1, 2, 3]
    counters = producers[0].counters
    assert counters.sessions_released >= 1 and counters.leases_lost == 0


async def test_a_rejected_message_is_dead_lettered_and_does_not_hold_its_session(
    sb: ServiceBusEnv, sb_conn: str
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=30, requires_session=True)
    await publish_sessions(sb, queue, {"A": 4})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, session_trigger(queue, sb_conn, filter_function=f"{__name__}.reject_a1"))
        runner.add(2, session_trigger(queue, sb_conn))
        await wait_until_async(lambda: settled(sb, queue), timeout=30)
        assert not runner.failures
    (dead,) = await sb.dead_letters(queue)
    assert json.loads(dead.body) == {"session": "A", "n": 1}
    assert dead.reason == REJECTED_REASON
    assert dead.description is not None and "A-1 is refused by the test" in dead.description
    assert events(sb, queue, "A") == [("complete", 1, 0), ("dead_letter", 2, 0), ("complete", 3, 0), ("complete", 4, 0)]
    assert seen(runner, 1, "A") == [0, 2, 3]
    assert seen(runner, 2, "A") == [0, 1, 2, 3]  # every message once: the reject did not hold A


async def test_session_locks_are_renewed_while_a_watcher_works(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=2, requires_session=True)
    await publish_sessions(sb, queue, {"A": 2, "B": 1})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:  # nothing persisted for a while
        runner.add(1, session_trigger(queue, sb_conn, max_concurrent_sessions=2))
        await wait_until(lambda: len(runner.pending) >= 3, timeout=30, what="3 fired events")
        await wait_until(
            lambda: producers[0].counters.leases_renewed >= 4, timeout=20, what="two renewals of each session lock"
        )
        # Well past the 2 s lock duration: nothing expired, both sessions are still ours.
        assert sb.handle.entity_stats(queue)["session_locks_expired"] == 0
        assert sb.handle.session_locked(queue, "A") and sb.handle.session_locked(queue, "B")
        assert sb.handle.counts(queue).locked == 3
        runner.persist()
        await wait_until_async(lambda: settled(sb, queue), timeout=30)
        assert not runner.failures
    assert [p["delivery_attempt"] for p in runner.persisted[1]] == [1, 1, 1]
    assert {h.event for h in sb.handle.history(queue)} == {"complete"}
    assert (producers[0].counters.leases_lost, producers[0].counters.sessions_lost) == (0, 0)


async def test_an_idle_session_is_released_so_further_sessions_are_served(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=30, requires_session=True)
    await publish_sessions(sb, queue, {"A": 3, "B": 3, "C": 3})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, session_trigger(queue, sb_conn, max_concurrent_sessions=1, session_idle_timeout=0.3))
        await wait_until_async(lambda: settled(sb, queue), timeout=60)
        assert not runner.failures
    # One session at a time, oldest first; each released once idle so the next one was served.
    order = [h.session_id for h in sb.handle.history(queue)]
    assert order == ["A"] * 3 + ["B"] * 3 + ["C"] * 3
    for session_id in "ABC":
        assert seen(runner, 1, session_id) == [0, 1, 2]
    counters = producers[0].counters
    assert counters.sessions_accepted == 3
    assert counters.sessions_released >= 2


async def test_a_lost_session_lock_is_counted_and_the_broker_redelivers(
    sb: ServiceBusEnv, sb_conn: str, producers: list[ServiceBusSharedStreamProducer]
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=1, requires_session=True)
    await publish_sessions(sb, queue, {"A": 2})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, session_trigger(queue, sb_conn, renew_locks=False))
        await wait_until(lambda: len(runner.pending) >= 2, timeout=30, what="the first delivery")
        await sb.handle.async_wait_until(lambda b: b.entity_stats(queue)["session_locks_expired"] >= 1, timeout=10)
        await wait_until(lambda: producers[0].counters.sessions_lost >= 1, timeout=10, what="the lost session")
        runner.persist()  # too late: the session is gone, nothing is settled on its receiver
        # Same group: the broker redelivers the session; it is accepted again and completed.
        await persist_until(runner, lambda: sb.handle.counts(queue).active + sb.handle.counts(queue).locked == 0)
        assert runner.alive(1)
        assert not runner.failures
    assert [(e, seq) for e, seq, _ in events(sb, queue, "A")][:2] == [("expire", 1), ("expire", 2)]
    final = [(seq, count) for e, seq, count in events(sb, queue, "A") if e == "complete"]
    assert [seq for seq, _ in final] == [1, 2]
    assert all(count >= 1 for _, count in final)  # delivery_count + 1 for the lost delivery
    attempts = [p["delivery_attempt"] for p in runner.persisted[1]]
    assert attempts[:2] == [1, 1] and attempts[-1] >= 2
    counters = producers[0].counters
    assert counters.leases_lost >= 2
    assert counters.committed >= 2 and counters.redelivered >= 2  # the lost ones are reported redelivered
    assert len(producers) == 1


async def test_stopping_the_group_releases_its_sessions_without_counting_a_delivery(
    sb: ServiceBusEnv, sb_conn: str
) -> None:
    queue = await sb.create_queue("sessions", lock_duration=30, requires_session=True)
    await publish_sessions(sb, queue, {"A": 2, "B": 2})
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, session_trigger(queue, sb_conn))
        await wait_until(lambda: len(runner.pending) >= 4, timeout=30, what="4 fired events")
        runner.crash()  # never persisted: nothing may be completed
    # Back at once (not after the 30 s lock), with no delivery counted, and nothing completed.
    counts = sb.handle.counts(queue)
    assert (counts.active, counts.locked) == (4, 0)
    assert {(h.event, h.delivery_count) for h in sb.handle.history(queue)} == {("release", 0)}
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, session_trigger(queue, sb_conn))
        await wait_until_async(lambda: settled(sb, queue), timeout=30)
    assert seen(runner, 1, "A") == [0, 1] and seen(runner, 1, "B") == [0, 1]
    assert {p["delivery_attempt"] for p in runner.persisted[1]} == {1}


async def test_sessions_of_a_topic_subscription(sb: ServiceBusEnv, sb_conn: str) -> None:
    sb.handle.create_topic("orders")
    sb.handle.create_subscription("orders", "airflow", lock_duration=30, requires_session=True)
    assert sb.client is not None
    async with sb.client.get_topic_sender("orders") as sender:
        from azure.servicebus import ServiceBusMessage

        await sender.send_messages(
            [ServiceBusMessage(json.dumps({"session": s, "n": i}), session_id=s) for i in range(3) for s in ("A", "B")]
        )
    path = "orders/Subscriptions/airflow"
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(
            1,
            ServiceBusSharedStreamTrigger(
                topic_name="orders",
                subscription_name="airflow",
                azure_service_bus_conn_id=sb_conn,
                sessions=True,
                max_wait_time=0.5,
            ),
        )
        await sb.handle.async_wait_until(
            lambda b: b.counts(path).active + b.counts(path).locked == 0 and b.counts(path).deferred == 0, timeout=30
        )
        assert not runner.failures
    for session_id in "AB":
        assert seen(runner, 1, session_id) == [0, 1, 2]
    assert {p["source"] for p in runner.persisted[1]} == {path}


@pytest.mark.parametrize(
    ("requires_session", "sessions", "message"),
    [
        (True, False, "requires sessions (requiresSession is true): pass sessions=True"),
        (False, True, "is not session-enabled (requiresSession is false): drop sessions=True"),
    ],
)
async def test_a_mismatch_between_entity_and_sessions_option_fails_the_group_clearly(
    sb: ServiceBusEnv, sb_conn: str, requires_session: bool, sessions: bool, message: str
) -> None:
    queue = await sb.create_queue("mismatch", requires_session=requires_session)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        trigger = ServiceBusSharedStreamTrigger(queue_name=queue, azure_service_bus_conn_id=sb_conn, sessions=sessions)
        runner.add(1, trigger)
        await wait_until(lambda: 1 in runner.failures, timeout=90, what="the group to fail")
    error = runner.failures[1]
    assert isinstance(error, SharedStreamConfigError)
    assert message in str(error)
    assert queue in str(error) and "servicebus_it" in str(error)
    sb.handle.clear_errors()
