"""
Split detection (_core/split.py) on a real Cohort with in-memory asset state stores; the real
triggerer's state store is exercised by tests/e2e/test_two_triggerers_e2e.py.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

from airflow_shared_stream_provider._core.cohort import Cohort, identity_of
from airflow_shared_stream_provider._core.split import SplitWatch, assets_of, heartbeat_key

KEY = ("airflow-shared-stream-provider", "sqs", (("queue_url", "q"),))


class Store:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        self.values[key] = value


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def identity(asset: str) -> str:
    return identity_of([asset], {"match": None})


@pytest.fixture
def stores() -> dict[str, Store]:
    return {name: Store() for name in ("a1", "a2", "b1")}


def cohort_with(stores: dict[str, Store], present: list[str], recorded: list[str]) -> Cohort:
    cohort = Cohort()
    for token, name in enumerate(present):
        cohort.join(token, identity(name), [], "record")  # no lookup task: the record is set below
        cohort.members[token].stores = [(name, stores[name])]
    cohort.recorded = Counter(identity(name) for name in recorded)
    return cohort


def watch(cohort: Cohort, stores: dict[str, Store], clock: Clock, *, competing: bool = True) -> SplitWatch:
    return SplitWatch(
        cohort,
        stream_key=KEY,
        stream="q",
        competing=competing,
        interval=30.0,
        accessor_for=lambda name: stores[name],
        clock=clock,
    )


def test_assets_are_read_back_from_an_identity() -> None:
    assert assets_of(identity_of(["orders_eu", "orders_uk"], {})) == ["orders_eu", "orders_uk"]
    assert assets_of(identity_of([], {})) == []


async def test_a_fresh_heartbeat_of_an_absent_member_from_another_triggerer_is_a_split(
    stores: dict[str, Store], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    here = watch(cohort_with(stores, ["a1", "a2"], ["a1", "a2", "b1"]), stores, clock)
    there = watch(cohort_with(stores, ["b1"], ["b1"]), stores, clock)  # the other triggerer's stream
    await there.beat()
    assert stores["b1"].values[heartbeat_key(KEY)]["owner"] == there.owner
    with caplog.at_level(logging.ERROR):
        found = await here.check()
    assert found == {identity("b1"): there.owner}
    assert "is SPLIT across triggerers: 1 of its watchers" in caplog.text
    assert there.owner in caplog.text


async def test_no_split_for_a_stale_heartbeat_its_own_or_none(stores: dict[str, Store]) -> None:
    clock = Clock()
    here = watch(cohort_with(stores, ["a1"], ["a1", "a2", "b1"]), stores, clock)
    there = watch(cohort_with(stores, ["b1"], ["b1"]), stores, clock)
    await there.beat()
    await here.beat()  # a1 (present) carries this stream's own heartbeat
    stores["a2"].values[heartbeat_key(KEY)] = {"owner": here.owner, "at": clock.now}  # its own, earlier
    clock.now += 3 * 30.0 + 1  # b1's stream stopped beating more than 3 intervals ago
    assert await here.check() == {}


async def test_with_watcher_positions_a_split_is_only_information(
    stores: dict[str, Store], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    here = watch(cohort_with(stores, ["a1"], ["a1", "b1"]), stores, clock, competing=False)
    there = watch(cohort_with(stores, ["b1"], ["b1"]), stores, clock, competing=False)
    await there.beat()
    with caplog.at_level(logging.INFO):
        assert await here.check() == {identity("b1"): there.owner}
    assert "fine with watcher positions" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
