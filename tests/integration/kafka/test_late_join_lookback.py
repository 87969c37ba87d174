"""
A watcher whose triggerer dies **before its first position write lands** (docs/production.md,
finding 4), then joins another triggerer's running stream without a stored position.

Found by the production chaos run in ``kafka-ha`` mode: the first messages such a watcher had
received on the killed triggerer, not yet persisted, were lost for it, because a late watcher
without a stored position started at the running stream's read end. Now it starts where that
stream was ``[shared_stream_provider] late_join_lookback`` seconds ago (default 300); ``0`` is the
old behaviour, kept as the negative control.

Real broker (Tansu or KAFKA_BOOTSTRAP_SERVERS), the real ``SharedStreamManager`` in two RunnerSims
(two triggerers; their streams differ in ``max_in_flight`` only, so this one process keeps them
apart while the position scope is the same). The dying triggerer's state store is frozen from
the start: none of its writes arrive, as when the supervisor answered none before the kill.
"""

from __future__ import annotations

import asyncio

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider.producers.kafka_placement import WatcherPlacement
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import KafkaAdapter
from .test_watcher_positions import MemoryStateStore, expected_ids_published, offsets_of, publish_round, watcher

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

X_STREAM = {"max_in_flight": 9_998}  # the triggerer that dies
Y_STREAM = {"max_in_flight": 9_999}  # the one that keeps running


@pytest.mark.parametrize("lookback", [None, "0"], ids=["default-lookback", "lookback-0-negative-control"])
async def test_a_watcher_moved_before_its_first_position_write_loses_nothing(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch, lookback: str | None
) -> None:
    if lookback is not None:
        monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__LATE_JOIN_LOOKBACK", lookback)
    stores = {name: MemoryStateStore() for name in ("moved", "stays")}
    stores["moved"].frozen = True
    x = RunnerSim(SharedStreamManager(), confirm_interval=3600)  # persists nothing before it dies
    y = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    async with y:
        y.add(2, watcher(adapter, "stays", stores["stays"], **Y_STREAM))
        async with x:
            x.add(1, watcher(adapter, "moved", stores["moved"], **X_STREAM))
            await asyncio.sleep(2.0)  # both streams formed and placed
            await publish_round(adapter, 4)
            await wait_until(lambda: y.count(2) >= 12, timeout=60, what="y's watcher delivering")
            await wait_until(lambda: len(x.pending) >= 12, timeout=60, what="x's watcher received them")
            x.crash()
        assert stores["moved"].writes == 0, "the test needs a watcher without any stored position"
        stores["moved"].frozen = False
        # x is gone; its watcher comes back on y, whose stream has read past those messages.
        y.add(10, watcher(adapter, "moved", stores["moved"], **Y_STREAM))
        await asyncio.sleep(1.0)
        await publish_round(adapter, 2)
        published = expected_ids_published(adapter)
        await wait_until(lambda: published <= set(offsets_of(y, 2)), timeout=60, what="y's watcher has everything")
        newest = {f"{adapter.topic}/{p}/{o}" for p in range(adapter.partitions) for o in (4, 5)}
        await wait_until(lambda: newest <= set(offsets_of(y, 10)), timeout=60, what="the moved watcher's new ones")
        await asyncio.sleep(1.0)
        lost = sorted(published - set(offsets_of(y, 10)))
        assert not x.failures and not y.failures
        # The sibling skipped the replay it had.
        assert max(offsets_of(y, 2).values()) == 1
        if lookback == "0":  # the old rule: the read end; what x had received is lost for it
            assert len(lost) == 12, lost
        else:
            assert not lost, f"lost for the watcher that moved before its first position write: {lost}"
            assert max(offsets_of(y, 10).values()) == 1


@pytest.mark.parametrize("old_rule", [False, True], ids=["subscribed-at", "committed-offset-negative-control"])
async def test_a_stream_that_forms_after_another_triggerers_commits_loses_nothing(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch, old_rule: bool
) -> None:
    """
    docs/production.md, finding 10: triggerer A's stream forms and commits for its watcher; B's
    stream forms seconds later for a watcher that subscribed before those messages and has no
    stored position. It must not start at the offsets A's stream committed (they say nothing
    about what B's watcher received) but where the partitions were when it subscribed (the
    broker's time index). The negative control is the old rule: the committed offset.
    """
    if old_rule:

        async def nothing_by_time(*_args: object, **_kwargs: object) -> dict[object, int]:
            return {}

        monkeypatch.setattr(WatcherPlacement, "offsets_since", nothing_by_time)
    stores = {name: MemoryStateStore() for name in ("first", "second")}
    async with (
        RunnerSim(SharedStreamManager(), confirm_interval=0.05) as a,
        RunnerSim(SharedStreamManager(), confirm_interval=0.05) as b,
    ):
        a.add(1, watcher(adapter, "first", stores["first"], **X_STREAM))
        await asyncio.sleep(2.0)  # A's stream formed and placed
        # B's watcher subscribes now, before the orders; its stream forms only 12 s later (a
        # triggerer slow to form its cohort), when A's stream has committed them.
        monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "12")
        b.add(2, watcher(adapter, "second", stores["second"], **Y_STREAM))
        forms_at = asyncio.get_running_loop().time() + 12.0
        await asyncio.sleep(0.5)
        await publish_round(adapter, 4)
        published = expected_ids_published(adapter)
        await wait_until(lambda: published <= set(offsets_of(a, 1)), timeout=60, what="A's watcher has them")

        async def committed_all() -> bool:
            return sum((await adapter.committed()).values()) >= 12

        await wait_until_async(committed_all, timeout=10)  # A's stream committed them, B still forming
        assert not offsets_of(b, 2), "B's stream formed too early for this test"
        await asyncio.sleep(max(0.0, forms_at - asyncio.get_running_loop().time()) + 2.0)  # B formed, placed
        await publish_round(adapter, 1)
        newest = {f"{adapter.topic}/{p}/4" for p in range(adapter.partitions)}
        await wait_until(lambda: newest <= set(offsets_of(b, 2)), timeout=60, what="B's watcher has the newest")
        await asyncio.sleep(1.0)
        missed = sorted(published - set(offsets_of(b, 2)))
        assert not a.failures and not b.failures
    if old_rule:  # the committed offset, past everything A's watcher had
        assert len(missed) == 12, missed
    else:
        assert not missed, f"B's watcher never got what A's stream had committed: {missed}"
