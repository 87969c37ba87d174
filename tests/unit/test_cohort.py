"""
Late siblings with Airflow's default settings (no cohort grace period), on the real manager.

A triggerer takes at most 50 new triggers per loop: after a restart a stream with 120 watchers is
re-formed in three waves. The producer must not read before the last wave has subscribed
(``cohort_settle``), and must wait for every member of its last formation (the cohort record in
each watcher's asset state store) even when the waves come slower than the settle time.

The asset state store here is a dict behind the accessor interface Airflow gives a watcher
(``aget`` / ``aset``); in a triggerer it is the supervisor's Execution API.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.cohort import record_key
from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

_names = itertools.count()


class StateStore:
    """One asset's state store: what ``AssetStateStoreAccessor`` offers a watcher, in memory."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.writes = 0

    async def aget(self, key: str, default: Any = None) -> Any:
        await asyncio.sleep(0.001)  # a round trip through the supervisor
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        await asyncio.sleep(0.001)
        if key.startswith("shared-stream-cohort/"):  # the record (not the split heartbeats)
            self.writes += 1
        self.values[key] = value


class Accessors:
    """``BaseEventTrigger.asset_state_store`` as the triggerer injects it: accessors by asset name."""

    def __init__(self, by_name: dict[str, StateStore]) -> None:
        self._by_name = by_name
        self._by_uri: dict[str, StateStore] = {}


class Assets:
    """The metadata DB's asset state store: it outlives triggerer restarts."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}
        self.stores: dict[str, StateStore] = {}

    def accessors(self, asset: str) -> Accessors:
        store = self.stores.setdefault(asset, StateStore(self.values.setdefault(asset, {})))
        return Accessors({asset: store})


@pytest.fixture
def broker() -> Any:
    name = f"cohort-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


def watcher(broker: MemoryBroker, asset: str, assets: Assets | None) -> MemorySharedStreamTrigger:
    trigger = MemorySharedStreamTrigger(broker_name=broker.name, match={"body.kind": "order"})
    if assets is not None:
        trigger.asset_state_store = assets.accessors(asset)  # type: ignore[assignment]
    return trigger


def publish(broker: MemoryBroker, count: int) -> None:
    for i in range(count):
        broker.publish(json.dumps({"kind": "order", "n": i}))


async def add_in_waves(
    runner: RunnerSim, broker: MemoryBroker, assets: Assets | None, total: int, *, wave: int, pause: float
) -> None:
    """Subscribe ``total`` watchers ``wave`` at a time, ``pause`` seconds apart (a triggerer's loops)."""
    for start in range(0, total, wave):
        for trigger_id in range(start, min(total, start + wave)):
            runner.add(trigger_id, watcher(broker, f"asset_{trigger_id}", assets))
        await asyncio.sleep(pause)


def short_of(runner: RunnerSim, total: int, messages: int) -> dict[int, int]:
    """Watchers that did not get every message: ``trigger_id -> messages missed``."""
    return {t: messages - runner.count(t) for t in range(total) if runner.count(t) < messages}


async def test_120_watchers_in_waves_of_50_all_get_the_whole_backlog(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0.5")
    publish(broker, 300)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, None, 120, wave=50, pause=0.2)
        await wait_until(lambda: len(broker.committed) == 300, timeout=60, what="300 commits")
        assert not runner.failures
    assert short_of(runner, 120, 300) == {}


async def test_without_the_settle_time_late_waves_lose_messages(broker: MemoryBroker) -> None:
    """Negative control (cohort_settle=0, as the conftest sets): the loss the settle time prevents."""
    publish(broker, 300)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, None, 120, wave=50, pause=0.2)
        await wait_until(lambda: len(broker.committed) == 300, timeout=60, what="300 commits")
    assert short_of(runner, 120, 300), "the late waves should have missed the start of the backlog"


async def test_the_cohort_record_brings_back_every_member_even_after_the_settle_time(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0.2")
    assets = Assets()
    # First formation: all five at once; the cohort record is written to each asset.
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, assets, 5, wave=5, pause=0)
        key = record_key(runner._keys[0])
        await wait_until(lambda: all(key in assets.values.get(f"asset_{i}", {}) for i in range(5)), timeout=10)
    assert len(assets.values["asset_0"][key]) == 5
    # A restart whose triggerer loops are slower than the settle time (0.5 s apart, settle 0.2 s).
    publish(broker, 40)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, assets, 5, wave=2, pause=0.5)
        await wait_until(lambda: len(broker.committed) == 40, timeout=30, what="40 commits")
    assert short_of(runner, 5, 40) == {}
    assert all(assets.stores[f"asset_{i}"].writes == 1 for i in range(5)), "an unchanged record is not rewritten"


async def test_a_member_that_never_comes_back_is_waited_for_once_then_forgotten(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0.1")
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_MAX_WAIT", "1.0")
    assets = Assets()
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, assets, 3, wave=3, pause=0)
        key = record_key(runner._keys[0])
        await wait_until(lambda: all(key in assets.values.get(f"asset_{i}", {}) for i in range(3)), timeout=10)
    publish(broker, 10)
    loop = asyncio.get_running_loop()
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        started = loop.time()
        await add_in_waves(runner, broker, assets, 2, wave=2, pause=0)  # asset_2's Dag was deleted
        await wait_until(lambda: len(broker.committed) == 10, timeout=30, what="10 commits")
        waited = loop.time() - started
        await wait_until(lambda: len(assets.values["asset_0"][key]) == 2, timeout=10, what="record rewritten")
    assert 1.0 <= waited < 10
    assert short_of(runner, 2, 10) == {}
    assert len(assets.values["asset_1"][key]) == 2


async def test_cohort_record_off_touches_no_state_store(broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_RECORD", "False")
    assets = Assets()
    publish(broker, 5)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        await add_in_waves(runner, broker, assets, 3, wave=3, pause=0)
        await wait_until(lambda: len(broker.committed) == 5, timeout=10, what="5 commits")
    assert short_of(runner, 3, 5) == {}
    assert all(store.writes == 0 for store in assets.stores.values())
    assert all(not values for values in assets.values.values())
