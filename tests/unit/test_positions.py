"""Watcher positions without a broker: the record format, the lane thresholds, the farewell write."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from airflow_shared_stream_provider._core.positions import WatcherPositions, parse_record, position_key
from airflow_shared_stream_provider.producers.kafka_lanes import Lane


class Store:
    def __init__(self, initial: dict[str, Any] | None = None) -> None:
        self.values: dict[str, Any] = dict(initial or {})

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        self.values[key] = value


@pytest.mark.parametrize(
    ("record", "parsed"),
    [
        ({"v": 1, "positions": {"t/0": 5, "t/1": 0}}, {"t/0": 5, "t/1": 0}),
        ({"v": 1, "positions": {"t/0": -1, "t/1": "7", "t/2": True, "t/3": 3}}, {"t/3": 3}),
        ({"v": 2, "positions": {"t/0": 5}}, None),
        ({"positions": {"t/0": 5}}, None),
        (["t/0", 5], None),
        (None, None),
    ],
)
def test_only_well_formed_positions_are_read(record: Any, parsed: dict[str, int] | None) -> None:
    assert parse_record(record) == parsed


def test_the_key_depends_on_scope_and_identity_only() -> None:
    assert position_key(("kafka", "c", ("t",), None), "a#1") == position_key(("kafka", "c", ("t",), None), "a#1")
    assert position_key(("kafka", "c", ("t",), None), "a#1") != position_key(("kafka", "c", ("t",), "g"), "a#1")
    assert position_key(("kafka", "c", ("t",), None), "a#1") != position_key(("kafka", "c", ("t",), None), "b#1")


def test_a_lane_names_who_skips_only_below_its_floor() -> None:
    lane = Lane.placed(1, 4, attempts={}, thresholds={1: 10, 2: 10, 3: 4})
    assert lane.position() == 4 and lane.next_read() == 4
    assert lane.skip_for(4) == frozenset({1, 2})
    assert lane.skip_for(9) == frozenset({1, 2})
    assert lane.skip_for(10) is None  # the hot path: everybody
    assert Lane.placed(1, 0, attempts={}, thresholds={}).skip_for(0) is None
    # A lane placed at 0 with nothing read yet has a position (0), unlike a group-mode lane.
    assert Lane.placed(1, 0, attempts={}, thresholds={1: 0}).position() == 0
    assert Lane(epoch=1).position() is None


async def placed_member(positions: WatcherPositions, store: Store, *, trigger_id: int | None = None) -> int:
    """Watcher ``a#1`` (key ``k``, stored in ``store``) joins and is placed; returns its member number."""
    number = positions.join("a#1", "k", [("a", store)], trigger_id=trigger_id)
    await positions.wait_lookups(timeout=1)
    for member in positions.take_placeable():
        member.placed = True
    return number


async def settle_writes() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_leaving_watcher_stores_the_position_it_had_when_it_left() -> None:
    positions = WatcherPositions()
    store = Store()
    number = await placed_member(positions, store)
    now = {"t/0": 7}
    positions.positions_of = lambda m: dict(now)
    positions.leave(number)
    now["t/0"] = 99  # the lane moves on without it: must not be what is stored
    await settle_writes()
    assert store.values["k"] == {"v": 1, "positions": {"t/0": 7}}


async def test_a_watcher_without_a_state_store_is_placeable_at_once_and_never_written() -> None:
    positions = WatcherPositions()
    number = positions.join("a#1", "k", [])
    [member] = positions.take_placeable()
    assert member.number == number and member.stored is None
    member.placed = True
    positions.schedule_write(lambda m: {"t/0": 1})
    assert positions._writer is None


@pytest.mark.parametrize("field", ["earlier", "before_leave"])  # before_leave: an earlier version's records
@pytest.mark.parametrize(
    ("reader", "parsed"),
    [
        (7, {"t/0": 50}),  # the trigger that wrote it (a moved watcher): its exact position
        (None, {"t/0": 50}),  # not run by a triggerer: no id to compare
        (8, {"t/0": 20}),  # re-created (its old row was deleted): where the writer was a lookback earlier
    ],
)
def test_a_re_created_watcher_reads_the_position_its_writer_had_a_lookback_earlier(
    field: str, reader: int | None, parsed: dict[str, int]
) -> None:
    record = {"v": 1, "positions": {"t/0": 50}, "trigger": 7, field: {"t/0": 20}}
    assert parse_record(record, trigger_id=reader) == parsed


def test_a_re_created_watcher_without_an_old_enough_position_starts_as_one_without_a_position() -> None:
    assert parse_record({"v": 1, "positions": {"t/0": 50}, "trigger": 7, "earlier": {}}, trigger_id=8) is None
    # A record without either field (a version of this provider older than both): taken as it is.
    assert parse_record({"v": 1, "positions": {"t/0": 50}, "trigger": 7}, trigger_id=8) == {"t/0": 50}


async def leave_by_cancellation(positions: WatcherPositions, number: int) -> None:
    """Member ``number`` leaves as a cancelled trigger does (in its ``finally``), and its writes land."""

    async def cancelled_watcher() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            positions.leave(number)

    task = asyncio.create_task(cancelled_watcher())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle_writes()


async def test_a_running_watcher_writes_where_it_was_a_lookback_earlier_with_every_record() -> None:
    """
    Airflow starts the triggers of a sync before it cancels those of the same sync: a re-created
    watcher can read the record of its old trigger while that one still runs (it has not left
    and written ``earlier`` on leaving), so every periodic record carries it.
    """
    now = [1000.0]
    positions = WatcherPositions(clock=lambda: now[0], recreated_lookback=30.0)
    store = Store()
    await placed_member(positions, store, trigger_id=7)
    lane = {"t/0": 10}
    positions.positions_of = lambda m: dict(lane)
    for position in (10, 20, 30, 40, 50):  # one periodic write every 10 s, 1000 .. 1040
        lane["t/0"] = position
        positions.schedule_write(positions.positions_of)
        await settle_writes()
        now[0] += 10.0
    # Written at 1040: 30 s before it, at 1010, it was at 20.
    assert store.values["k"] == {"v": 1, "positions": {"t/0": 50}, "trigger": 7, "earlier": {"t/0": 20}}
    assert parse_record(store.values["k"], trigger_id=8) == {"t/0": 20}


async def test_a_watcher_cancelled_after_its_re_created_trigger_joined_writes_nothing() -> None:
    """
    The old trigger leaves after the new one (same watcher, same key) joined here: the new one's
    writes take over; a farewell of the old one would put its trigger id back on the record.
    """
    positions = WatcherPositions()
    store = Store()
    old = await placed_member(positions, store, trigger_id=7)
    positions.positions_of = lambda m: {"t/0": 50}
    await placed_member(positions, store, trigger_id=8)
    await leave_by_cancellation(positions, old)
    assert "k" not in store.values and not positions.departed


async def test_a_cancelled_watcher_writes_where_it_was_a_lookback_before_it_left() -> None:
    now = [1000.0]
    positions = WatcherPositions(clock=lambda: now[0], recreated_lookback=30.0)
    store = Store()
    number = await placed_member(positions, store, trigger_id=7)
    lane = {"t/0": 10}
    positions.positions_of = lambda m: dict(lane)
    for position in (10, 20, 30, 40):  # one periodic write every 10 s
        lane["t/0"] = position
        positions.schedule_write(positions.positions_of)
        now[0] += 10.0
    lane["t/0"] = 50  # confirmed in the syncs that cancel it: maybe stored for no asset
    await leave_by_cancellation(positions, number)
    # Left at 1040: 30 s before it, at 1010, it was at 20.
    assert store.values["k"] == {"v": 1, "positions": {"t/0": 50}, "trigger": 7, "earlier": {"t/0": 20}}
