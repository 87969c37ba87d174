"""The flow gate's window arithmetic (the no-overflow behaviour on the real manager is in test_core_on_manager)."""

from __future__ import annotations

import pytest

from airflow_shared_stream_provider._core.flow import BINDING_BUDGET, MIN_WINDOW, FlowGate, scaled_window


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
