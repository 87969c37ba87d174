"""The flow gate's window arithmetic (the no-overflow behaviour on the real manager is in test_core_on_manager)."""

from __future__ import annotations

import pytest

from airflow_shared_stream_provider._core.flow import (
    BINDING_BUDGET,
    EVENT_BYTES_BUDGET,
    MIN_BATCHES_IN_FLIGHT,
    MIN_START_IN_FLIGHT,
    MIN_WINDOW,
    SLOW_START_EVENTS,
    FlowGate,
    scaled_in_flight,
    scaled_window,
)


@pytest.mark.parametrize(
    ("watchers", "expected"),
    [(0, 960), (1, 960), (2, 960), (3, 682), (10, 204), (32, 64), (100, 64), (1000, 64)],
)
def test_the_window_keeps_queued_bindings_within_the_budget(watchers: int, expected: int) -> None:
    assert BINDING_BUDGET == 2_048 and MIN_WINDOW == 64  # the table above is for these
    assert scaled_window(960, watchers) == expected
    assert scaled_window(100, watchers) == min(100, expected)


def test_credit_follows_the_number_of_registered_watchers() -> None:
    gate = FlowGate()
    gate.window = 960
    gate.register(0)
    assert gate.credit() == 960
    for token in range(1, 10):
        gate.register(token)
    assert gate.window == BINDING_BUDGET // 10
    assert gate.credit() == BINDING_BUDGET // 10
    for _ in range(gate.credit()):
        gate.next_seq()
    assert gate.credit() == 0
    # Watchers leaving widen the window again; the lag already queued counts against it.
    for token in range(1, 10):
        gate.unregister(token)
    assert gate.window == 960
    assert gate.credit() == 960 - BINDING_BUDGET // 10


def test_shrinking_never_lets_a_queue_exceed_the_configured_window() -> None:
    """A watcher joining while others lag shrinks the window; lags stay below what was allowed."""
    gate = FlowGate()
    gate.window = 960
    gate.register(0)
    for _ in range(900):
        gate.next_seq()
    for token in range(1, 20):
        gate.register(token)  # registered at produced=900: lag 0
    assert gate.credit() == 0  # watcher 0 lags 900 > the new window
    gate.consumed(0, 900)
    assert gate.credit() == gate.window == max(MIN_WINDOW, BINDING_BUDGET // 20)


@pytest.mark.parametrize(
    ("batch_bytes", "watchers", "expected"),
    [
        (0, 100, 20),  # per-message mode: messages in flight are not scaled
        (65_536, 1, 20),
        (65_536, 10, 20),  # 51 by the budget: the configured 20 binds
        (65_536, 100, 5),
        (262_144, 100, 2),  # 1 by the budget: the floor
        (65_536, 1000, 2),
        (65_536, 0, 20),
    ],
)
def test_batches_in_flight_keep_unpersisted_event_bytes_within_the_budget(
    batch_bytes: int, watchers: int, expected: int
) -> None:
    assert EVENT_BYTES_BUDGET == 32 * 1024 * 1024 and MIN_BATCHES_IN_FLIGHT == 2  # the table is for these
    assert scaled_in_flight(20, batch_bytes, watchers) == expected


def test_batch_credit_shrinks_as_watchers_join_and_widens_as_they_leave() -> None:
    gate = FlowGate()
    gate.window = 960
    gate.max_in_flight = 20
    gate.count_batches(65_536)
    gate.register(0)
    assert gate.credit() == 20
    for token in range(1, 100):
        gate.register(token)
    assert gate.max_in_flight == 5
    for _ in range(gate.credit()):
        gate.next_seq()
    assert gate.credit() == 0
    gate.advanced(5)
    for token in range(100):
        gate.consumed(token, 5)
    assert gate.credit() == 5
    for token in range(1, 100):
        gate.unregister(token)
    assert gate.max_in_flight == 20
    assert gate.credit() == 20


@pytest.mark.parametrize(("watchers", "first_round"), [(1, 512), (4, 128), (10, 51), (100, 16)])
def test_slow_start_fans_out_a_first_round_then_doubles_per_round(watchers: int, first_round: int) -> None:
    assert SLOW_START_EVENTS == 512 and MIN_START_IN_FLIGHT == 16  # the table is for these
    gate = FlowGate()
    gate.window = 100_000
    gate.max_in_flight = 10_000
    gate.begin_slow_start()
    for token in range(watchers):
        gate.register(token)

    def fan_out() -> int:
        """Yield what the gate allows, every watcher pulling it at once, until it allows no more."""
        sent = 0
        while (credit := gate.credit()) > 0:
            for _ in range(credit):
                gate.next_seq()
            for token in range(watchers):
                gate.consumed(token, gate.produced)
            sent += credit
        return sent

    rounds = [fan_out()]
    assert rounds == [first_round]
    assert gate.credit() == 0  # nothing more until the first round is advanced
    while gate.in_flight_limit < gate.max_in_flight:
        gate.advanced(gate.in_flight)
        rounds.append(fan_out())
    assert rounds[:4] == [first_round, 2 * first_round, 4 * first_round, 8 * first_round]
    assert gate.credit() == 0 and gate.in_flight == 10_000  # ramped up: the configured bound
    gate.advanced(10_000)
    assert gate.in_flight_limit == 10_000  # and it stays there: slow start is over


def test_batch_mode_needs_no_slow_start_its_byte_budget_bounds_the_first_round() -> None:
    gate = FlowGate()
    gate.window = 100_000
    gate.max_in_flight = 20
    gate.count_batches(65_536)
    gate.begin_slow_start()
    for token in range(10):
        gate.register(token)
    # 20 batches x 10 watchers = 200 events in flight, within the 512 the byte budget allows.
    assert gate.in_flight_limit == gate.max_in_flight == 20
    assert gate.credit() == 20


def test_a_gate_without_slow_start_gives_the_whole_bound() -> None:
    gate = FlowGate()
    gate.max_in_flight = 3_000
    gate.window = 100_000
    gate.register(0)
    assert gate.credit() == 3_000
