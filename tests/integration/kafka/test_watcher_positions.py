"""
Watcher positions (``position_store="watchers"``, the default; _core/positions.py): each stream reads
every partition, each watcher's position lives in its asset's state store, and a watcher that joins
a running stream late replays from its own position while its siblings skip what they had.

Real broker (Tansu or KAFKA_BOOTSTRAP_SERVERS) and the real ``SharedStreamManager`` driven like the
triggerer (RunnerSim). The asset state store is :class:`MemoryStateStore`: Airflow's accessor needs a
triggerer's supervisor behind it (the end-to-end test tests/e2e/test_two_triggerers_e2e.py runs the
real one). Two RunnerSims with two managers stand for two triggerers; their streams differ in one
tuning setting (``max_in_flight``) so that this one process keeps them apart (flow gates are per
stream key and process), while their position scope (connection, topics, group) is the same.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.cohort import identity_of
from airflow_shared_stream_provider._core.positions import position_key
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import KafkaAdapter

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

PER_PARTITION = 10


class MemoryStateStore:
    """One asset's state store (the methods of Airflow's ``AssetStateStoreAccessor`` the provider calls)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.frozen = False  # a crashed triggerer: nothing it would write arrives any more
        self.writes = 0

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        if self.frozen:
            return
        self.values[key] = json.loads(json.dumps(value))  # what a JSON column gives back
        self.writes += 1


class Accessors:
    """The shape of ``BaseEventTrigger.asset_state_store`` for a watcher of one asset."""

    def __init__(self, asset: str, store: MemoryStateStore) -> None:
        self._by_name = {asset: store}
        self._by_uri: dict[str, MemoryStateStore] = {}


@pytest.fixture(autouse=True)
def _fast_position_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__POSITION_INTERVAL", "0.2")
    yield


def watcher(adapter: KafkaAdapter, asset: str, store: MemoryStateStore, **kwargs: Any) -> KafkaSharedStreamTrigger:
    """A watcher of ``asset`` whose state store is ``store``; no dead-letter topic unless ``kwargs`` name one."""
    trigger = adapter.make_trigger(**{"dlq_topic": None, **kwargs})
    trigger.asset_state_store = Accessors(asset, store)  # type: ignore[assignment]
    return trigger


def stored_positions(adapter: KafkaAdapter, asset: str, store: MemoryStateStore) -> dict[str, int] | None:
    probe = adapter.make_trigger(dlq_topic=None)
    identity = identity_of([asset], probe._watcher_spec())
    record = store.values.get(position_key(probe.settings.position_scope(), identity))
    return None if record is None else dict(record["positions"])


def offsets_of(runner: RunnerSim, trigger_id: int) -> Counter[str]:
    return Counter(runner.message_ids(trigger_id))


def expected_ids(adapter: KafkaAdapter, first: int, end: int) -> set[str]:
    return {f"{adapter.topic}/{p}/{o}" for p in range(adapter.partitions) for o in range(first, end)}


async def publish_round(adapter: KafkaAdapter, count_per_partition: int) -> None:
    await adapter.publish([json.dumps({"n": n}).encode() for n in range(count_per_partition * adapter.partitions)])


async def test_a_late_watcher_replays_from_its_own_position_and_siblings_skip_it(adapter: KafkaAdapter) -> None:
    stores = {name: MemoryStateStore() for name in ("a", "b", "c")}
    await publish_round(adapter, PER_PARTITION)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as runner:
        runner.add(1, watcher(adapter, "a", stores["a"]))
        runner.add(2, watcher(adapter, "b", stores["b"]))
        await wait_until(lambda: runner.count(1) == runner.count(2) == 30, timeout=60, what="a and b read all")
        everything = {f"{adapter.topic}/{p}": PER_PARTITION for p in range(3)}
        await wait_until(
            lambda: stored_positions(adapter, "a", stores["a"]) == everything, timeout=30, what="a's positions"
        )
        # c was at offset 4 of every partition (it ran on a triggerer that died): it must get 4..9.
        probe = adapter.make_trigger(dlq_topic=None)
        key = position_key(probe.settings.position_scope(), identity_of(["c"], probe._watcher_spec()))
        stores["c"].values[key] = {"v": 1, "positions": {f"{adapter.topic}/{p}": 4 for p in range(3)}}
        runner.add(3, watcher(adapter, "c", stores["c"]))
        await wait_until(lambda: runner.count(3) == 18, timeout=60, what="c replayed 4..9")
        await publish_round(adapter, 3)
        await wait_until(
            lambda: runner.count(1) >= 39 and runner.count(2) >= 39 and runner.count(3) >= 27,
            timeout=60,
            what="the next messages reached all three",
        )
        await asyncio.sleep(0.5)
        assert set(offsets_of(runner, 3)) == expected_ids(adapter, 4, 13)
        for trigger_id in (1, 2):
            seen = offsets_of(runner, trigger_id)
            assert set(seen) == expected_ids(adapter, 0, 13)
            assert max(seen.values()) == 1, f"watcher {trigger_id} got a replay it had: {seen.most_common(3)}"
        assert max(offsets_of(runner, 3).values()) == 1
        await wait_until(
            lambda: stored_positions(adapter, "c", stores["c"]) == {f"{adapter.topic}/{p}": 13 for p in range(3)},
            timeout=30,
            what="c's positions",
        )
    assert await adapter.unsettled() == 0


async def test_without_watcher_positions_a_late_watcher_misses_what_was_committed(adapter: KafkaAdapter) -> None:
    """The negative control of the test above: ``position_store="group"`` (the old behaviour)."""
    stores = {name: MemoryStateStore() for name in ("a", "c")}
    await publish_round(adapter, PER_PARTITION)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as runner:
        runner.add(1, watcher(adapter, "a", stores["a"], position_store="group"))
        await wait_until(lambda: runner.count(1) == 30, timeout=60, what="a read all")
        await wait_until_async(lambda: _settled(adapter), timeout=30)
        runner.add(3, watcher(adapter, "c", stores["c"], position_store="group"))
        await publish_round(adapter, 1)
        await wait_until(lambda: runner.count(3) >= 3, timeout=60, what="c got the new ones")
        assert set(offsets_of(runner, 3)) == expected_ids(adapter, 10, 11)


async def _settled(adapter: KafkaAdapter) -> bool:
    return await adapter.unsettled() == 0


async def test_siblings_on_two_triggerers_each_see_everything_and_survive_a_crash(adapter: KafkaAdapter) -> None:
    """
    Two "triggerers" (two managers), three watchers each, one group: no partition split, every
    watcher sees every message. Then one triggerer crashes (its state-store writes stop, its
    unpersisted events are dropped) while messages keep coming, and its three watchers are
    re-created on the other one, whose stream is running: they replay from their own positions.
    Lost per watcher: 0. Duplicates are counted (what the positions' lag costs).
    """
    names = [f"w{i}" for i in range(6)]
    stores = {name: MemoryStateStore() for name in names}
    x = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    y = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    publishing = True

    async def publisher() -> None:
        while publishing:
            await publish_round(adapter, 1)
            await asyncio.sleep(0.1)

    async with y:
        async with x:
            for i, name in enumerate(names[:3]):
                x.add(i, watcher(adapter, name, stores[name]))
            for i, name in enumerate(names[3:], start=3):
                y.add(i, watcher(adapter, name, stores[name], max_in_flight=9_999))
            task = asyncio.create_task(publisher())
            await wait_until(lambda: all(x.count(i) >= 30 for i in range(3)), timeout=60, what="x delivering")
            await wait_until(lambda: all(y.count(i) >= 30 for i in range(3, 6)), timeout=60, what="y delivering")
            await asyncio.sleep(1.0)  # positions written at least once
            for name in names[:3]:
                stores[name].frozen = True
            x.crash()
        # x is gone. Its watchers come back on y (another triggerer took them over).
        for name in names[:3]:
            stores[name].frozen = False
        for i, name in enumerate(names[:3]):
            y.add(10 + i, watcher(adapter, name, stores[name], max_in_flight=9_999))
        await asyncio.sleep(3.0)
        publishing = False
        await task
        published = expected_ids_published(adapter)

        def seen(i: int) -> Counter[str]:
            moved = offsets_of(y, 10 + i) if i < 3 else Counter()
            return offsets_of(x if i < 3 else y, i) + moved

        await wait_until(
            lambda: all(published <= set(seen(i)) for i in range(6)), timeout=90, what="every watcher has everything"
        )
        dups = {names[i]: sum(seen(i).values()) - len(set(seen(i))) for i in range(6)}
        print(f"\nPOSITIONS two triggerers: messages={len(published)} dup per watcher={dups}")
        assert not x.failures and not y.failures
        for i in range(3, 6):  # never moved: exactly once
            assert dups[names[i]] == 0


def expected_ids_published(adapter: KafkaAdapter) -> set[str]:
    per_partition = adapter.published // adapter.partitions
    return expected_ids(adapter, 0, per_partition)


def failed(runner: RunnerSim, trigger_id: int) -> bool:
    return trigger_id in runner.failures


def explode_on_poison(envelope: dict[str, Any]) -> bool:
    """A watcher filter that raises on ``{"poison": true}`` (with ``on_filter_error="fail"``)."""
    body = envelope.get("body")
    if isinstance(body, dict) and body.get("poison"):
        raise ValueError("poison")
    return True


async def test_the_poison_cap_holds_for_a_watcher_that_keeps_coming_back(adapter: KafkaAdapter) -> None:
    """
    A watcher whose filter fails on one message leaves (``on_filter_error="fail"``); its sibling
    takes the redelivery and the offset is committed; the watcher is re-created (as the triggerer
    does) behind the stream, which rewinds for it, and it fails again. The attempt count must go on
    across those comebacks, so after ``max_delivery_attempts`` the message is dead-lettered and the
    watcher moves past it, instead of failing forever.
    """
    stores = {name: MemoryStateStore() for name in ("fragile", "sturdy")}
    options: dict[str, Any] = {"max_delivery_attempts": 2, "dlq_topic": adapter.dlq_topic}

    def fragile() -> KafkaSharedStreamTrigger:
        trigger = adapter.make_trigger(
            filter_function=f"{__name__}.explode_on_poison", on_filter_error="fail", **options
        )
        trigger.asset_state_store = Accessors("fragile", stores["fragile"])  # type: ignore[assignment]
        return trigger

    await adapter.publish([b'{"n": 0}', b'{"poison": true}', b'{"n": 2}'], partition=0)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as runner:
        sturdy = adapter.make_trigger(**options)
        sturdy.asset_state_store = Accessors("sturdy", stores["sturdy"])  # type: ignore[assignment]
        runner.add(100, sturdy)
        runner.add(1, fragile())
        comebacks = 0
        while not await adapter.dead_letter_records():
            await wait_until(functools.partial(failed, runner, comebacks + 1), timeout=60, what="the next failure")
            assert comebacks < 4, "the poison message was never dead-lettered"
            comebacks += 1
            runner.add(comebacks + 1, fragile())  # the triggerer re-creates the failed trigger
            await asyncio.sleep(1.0)
        records = await adapter.dead_letter_records()
        assert len(records) == 1, [(r.value, dict(r.headers)["x-dead-letter-source"]) for r in records]
        [record] = records
        assert record.value == b'{"poison": true}'
        headers = {k: v.decode() for k, v in record.headers}
        assert headers["x-dead-letter-reason"].startswith("poison message: failed 2 delivery attempt(s)")
        # The watcher that met it the last time failed on it (that is what dead-lettered it); the
        # next comeback starts past it.
        await wait_until(lambda: comebacks + 1 in runner.failures, timeout=60, what="the last failure")
        last = comebacks + 2
        runner.add(last, fragile())
        await publish_round(adapter, 1)
        try:
            await wait_until(lambda: f"{adapter.topic}/0/3" in runner.message_ids(last), timeout=60, what="moved past")
        except TimeoutError:
            seen = {t: runner.message_ids(t) for t in range(1, last + 1)}
            raise AssertionError(f"comebacks={comebacks} failures={runner.failures} seen={seen}") from None
        assert last not in runner.failures
