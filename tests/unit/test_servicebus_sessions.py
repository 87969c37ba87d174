"""The credit that session receivers share, on the real FlowGate (no broker, no SDK receiver).

The session receivers themselves are tested through the real SDK against the test broker in
tests/integration/servicebus/test_servicebus_sessions.py.
"""

from __future__ import annotations

import asyncio

import pytest

from airflow_shared_stream_provider._core.flow import FlowGate
from airflow_shared_stream_provider.producers.servicebus_sessions import CreditPool, ServiceBusCounters, renew_margin
from devkit.runner import settle

WATCHER = 1


def gate_with_window(window: int) -> FlowGate:
    gate = FlowGate()
    gate.window = window
    gate.register(WATCHER)
    return gate


def broadcast(gate: FlowGate, pool: CreditPool, count: int) -> None:
    """What open_stream does with ``count`` reserved messages: hand them to the gate."""
    for _ in range(count):
        pool.consumed()
        gate.next_seq()


async def test_reservations_never_exceed_the_gate_credit() -> None:
    gate = gate_with_window(10)
    pool = CreditPool(gate.credit, gate.wait_for_credit)
    assert pool.try_reserve(8) == 8
    assert pool.try_reserve(8) == 2  # only what is left
    assert pool.try_reserve(1) == 0
    pool.release(3)  # a receive call returned 5 of the 8
    assert pool.try_reserve(8) == 3
    broadcast(gate, pool, 10)  # every reservation became a broadcast message
    assert (pool.reserved, gate.credit(), pool.available()) == (0, 0, 0)


async def test_a_fair_share_is_left_for_the_other_sessions() -> None:
    gate = gate_with_window(10)
    pool = CreditPool(gate.credit, gate.wait_for_credit)
    assert pool.try_reserve(100, sharers=4) == 3  # ceil(10 / 4)
    assert pool.try_reserve(100, sharers=4) == 3
    assert pool.try_reserve(100, sharers=4) == 3
    assert pool.try_reserve(100, sharers=4) == 1  # what is left
    assert pool.try_reserve(100, sharers=1) == 0


async def test_a_waiting_session_is_woken_by_a_release_or_by_watcher_progress() -> None:
    gate = gate_with_window(10)
    pool = CreditPool(gate.credit, gate.wait_for_credit)
    wake = asyncio.Event()
    assert pool.try_reserve(10) == 10
    waiting = asyncio.ensure_future(pool.reserve(4, sharers=1, wake=wake, timeout=None))
    await settle()
    assert not waiting.done()
    pool.release(6)  # a short receive
    assert await asyncio.wait_for(waiting, 5) == 4
    broadcast(gate, pool, 8)
    assert (gate.credit(), pool.available()) == (2, 2)
    assert pool.try_reserve(2) == 2
    broadcast(gate, pool, 2)
    # The gate is exhausted (the watcher is a whole window behind): only its pulling helps now.
    assert (gate.credit(), pool.reserved) == (0, 0)
    blocked = [asyncio.ensure_future(pool.reserve(5, sharers=2, wake=asyncio.Event(), timeout=None)) for _ in range(2)]
    await settle()
    assert not any(task.done() for task in blocked)
    gate.consumed(WATCHER, 10)  # the watcher pulled everything: credit for a whole window again
    results = await asyncio.wait_for(asyncio.gather(*blocked), 5)
    assert sorted(results) == [5, 5]
    await pool.close()


async def test_reserve_returns_nothing_when_woken_for_a_settlement_or_at_the_deadline() -> None:
    gate = gate_with_window(4)
    pool = CreditPool(gate.credit, gate.wait_for_credit)
    assert pool.try_reserve(4) == 4
    wake = asyncio.Event()
    waiting = asyncio.ensure_future(pool.reserve(1, sharers=1, wake=wake, timeout=None))
    await settle()
    wake.set()  # a settlement was queued: the session receiver must run it first
    assert await asyncio.wait_for(waiting, 5) == 0
    assert await pool.reserve(1, sharers=1, wake=asyncio.Event(), timeout=0.01) == 0
    assert pool.reserved == 4


def test_session_counters_and_renew_margin() -> None:
    counters = ServiceBusCounters("servicebus", "q")
    assert {"sessions_accepted", "sessions_released", "sessions_lost", "leases_lost"} <= set(counters.snapshot())
    assert renew_margin(2.0) == pytest.approx(2.0 / 3)
    assert renew_margin(60.0) == 10.0
