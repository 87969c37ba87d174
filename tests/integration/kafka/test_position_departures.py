"""
Watcher positions of watchers that *move* (a triggerer cancels them, another one or the same one
starts them again): they must replay only what their events were not persisted for, never the
whole history.

Found by the production chaos run (bench/production.py, kafka-ha): two real triggerers whose
supervisors persisted a backlog for ~16 s and then, in one state sync, confirmed those events and
cancelled two watchers (the scheduler had handed them to the other triggerer). Each came back
with a stored position of 0 and received every message again, twice (once on each triggerer).

Real broker (Tansu) and the real ``SharedStreamManager`` (RunnerSim) with manual persistence: the
supervisor's timing is what the scenario is about. Asset state stores are :class:`MemoryStateStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.cohort import identity_of
from airflow_shared_stream_provider._core.positions import position_key
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import dead_lettered_at_least, orders, wait_until_async

from .conftest import KafkaAdapter
from .test_watcher_positions import (
    MemoryStateStore,
    expected_ids,
    publish_round,
    stored_positions,
    watcher,
)

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

PER_PARTITION = 10


@pytest.fixture(autouse=True)
def _position_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The production default (5 s): the periodic write must not be what makes these tests pass.
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__POSITION_INTERVAL", "5")
    yield


def pending(runner: RunnerSim, trigger_id: int) -> int:
    """Events a watcher fired that the (stalled) supervisor has not persisted yet."""
    return sum(1 for item in runner.pending if item.trigger_id == trigger_id)


@contextlib.asynccontextmanager
async def persisting(runner: RunnerSim) -> AsyncIterator[None]:
    """The supervisor persists again (every 50 ms)."""

    async def loop() -> None:
        while True:
            runner.persist()
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        runner.persist()


def duplicates(seen: Counter[str]) -> int:
    return sum(seen.values()) - len(seen)


async def test_a_watcher_cancelled_in_the_sync_that_confirms_its_events_does_not_replay_them(
    adapter: KafkaAdapter,
) -> None:
    """
    The backlog is fired by a and b; the supervisor persists it late and, in the same sync,
    confirms it and cancels b (Airflow's runner: ``confirm_persisted`` then ``cancel_triggers`` in
    one loop turn). b's position at that instant is behind what the producer advances a moment
    later; b comes back on the same triggerer and must not get the backlog again.
    """
    stores = {name: MemoryStateStore() for name in ("a", "b")}
    await publish_round(adapter, PER_PARTITION)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, watcher(adapter, "a", stores["a"]))
        runner.add(2, watcher(adapter, "b", stores["b"]))
        await wait_until(lambda: pending(runner, 1) == pending(runner, 2) == 30, timeout=60, what="both fired")
        runner.persist()  # one sync: the confirmations ...
        await runner.remove(2)  # ... and the cancellation
        async with persisting(runner):
            await asyncio.sleep(2.0)  # less than position_interval: no periodic write helps
            # b is back (same triggerer, as B did), as the same trigger: a moved watcher keeps its id.
            runner.add(2, watcher(adapter, "b", stores["b"]))
            # Placed before anything new is read: a watcher also gets what is read between its
            # subscription and its placement, and again from its position if that is lower.
            await asyncio.sleep(1.0)
            await publish_round(adapter, 2)
            await wait_until(
                lambda: len(set(runner.message_ids(1))) == 36 and len(set(runner.message_ids(2))) == 36,
                timeout=60,
                what="a and b have everything",
            )
            await asyncio.sleep(0.5)
        a = Counter(runner.message_ids(1))
        b = Counter(runner.message_ids(2))
        everything = expected_ids(adapter, 0, PER_PARTITION + 2)
        print(
            f"\nDEPARTURE cancel+confirm: lost a={len(everything - set(a))} b={len(everything - set(b))} "
            f"dup a={duplicates(a)} b={duplicates(b)}"
        )
        assert set(a) == set(b) == everything  # lost: 0
        assert duplicates(a) == 0
        assert duplicates(b) == 0, f"b replayed what it had: {b.most_common(3)}"
        assert not runner.failures


async def test_siblings_keep_their_position_while_the_lanes_replay_for_a_late_watcher(adapter: KafkaAdapter) -> None:
    """
    a and b have read (and persisted) 0..9; c joins with a stored position of 0, so the lanes are
    rewound and a and b skip 0..9 (their threshold is 10). While c's replay is unconfirmed the
    lanes' position is 0, below a's and b's threshold: their periodic writes must store 10 (they
    had everything below), not keep the 0 they wrote before the rewind. Then the triggerer
    crashes; a and b restart elsewhere and must not get 0..9 again.
    """
    stores = {name: MemoryStateStore() for name in ("a", "b", "c")}
    await publish_round(adapter, PER_PARTITION)
    x = RunnerSim(SharedStreamManager())
    async with x:
        x.add(1, watcher(adapter, "a", stores["a"]))
        x.add(2, watcher(adapter, "b", stores["b"]))
        await wait_until(lambda: pending(x, 1) == pending(x, 2) == 30, timeout=60, what="a, b fired")
        async with persisting(x):
            await wait_until(lambda: x.count(1) == x.count(2) == 30, timeout=30, what="persisted")
            for _ in range(300):
                if await adapter.unsettled() == 0:
                    break
                await asyncio.sleep(0.05)
            assert await adapter.unsettled() == 0
        probe = adapter.make_trigger(dlq_topic=None)
        key = position_key(probe.settings.position_scope(), identity_of(["c"], probe._watcher_spec()))
        stores["c"].values[key] = {"v": 1, "positions": {f"{adapter.topic}/{p}": 0 for p in range(3)}}
        x.add(3, watcher(adapter, "c", stores["c"]))
        await wait_until(lambda: pending(x, 3) == 30, timeout=60, what="c replayed 0..9")
        await asyncio.sleep(6.0)  # a periodic write (position_interval 5 s) while c's replay is unconfirmed
        for store in stores.values():
            store.frozen = True
        x.crash()
    for store in stores.values():
        store.frozen = False
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as y:
        for trigger_id, name in enumerate(("a", "b", "c"), start=1):
            y.add(trigger_id, watcher(adapter, name, stores[name]))
        await publish_round(adapter, 1)
        await wait_until(
            lambda: all(len(set(x.message_ids(i)) | set(y.message_ids(i))) == 33 for i in (1, 2, 3)),
            timeout=60,
            what="everyone has everything",
        )
        await asyncio.sleep(0.5)
        seen = {name: Counter(x.message_ids(i)) + Counter(y.message_ids(i)) for i, name in enumerate("abc", start=1)}
        dups = {name: duplicates(counts) for name, counts in seen.items()}
        print(f"\nDEPARTURE crash during a rewind: dup={dups}")
        everything = expected_ids(adapter, 0, PER_PARTITION + 1)
        assert all(set(counts) == everything for counts in seen.values())  # lost: 0
        assert dups == {"a": 0, "b": 0, "c": 0}
        assert not y.failures


async def test_a_stream_that_forms_late_places_its_watchers_at_their_newest_stored_positions(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Triggerer Y starts watcher w while w still runs on triggerer X (Airflow reassigns before X
    lets go). Y reads w's position as w joins, then waits for its cohort; meanwhile w moves on
    on X and X stops it (writing its position on the way out). Y must place w at what X stored
    last, not at what it read before its cohort wait (it would replay what X delivered meanwhile).
    """
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__POSITION_INTERVAL", "0.2")
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "5")
    store = MemoryStateStore()
    await publish_round(adapter, PER_PARTITION)

    def at(n: int) -> dict[str, int]:
        return {f"{adapter.topic}/{p}": n for p in range(3)}

    async with (
        RunnerSim(SharedStreamManager(), confirm_interval=0.05) as x,
        RunnerSim(SharedStreamManager(), confirm_interval=0.05) as y,
    ):
        x.add(1, watcher(adapter, "w", store))
        await wait_until(lambda: stored_positions(adapter, "w", store) == at(10), timeout=60, what="w at 10 on X")
        y.add(1, watcher(adapter, "w", store, max_in_flight=9_999))  # its own stream key (another triggerer)
        await publish_round(adapter, PER_PARTITION)
        await wait_until(lambda: stored_positions(adapter, "w", store) == at(20), timeout=4, what="w at 20 on X")
        await x.remove(1)  # X lets go of w; Y's stream is still waiting for its cohort
        await publish_round(adapter, 1)  # for w on Y only
        await wait_until(
            lambda: len(set(x.message_ids(1)) | set(y.message_ids(1))) == 63, timeout=60, what="w has everything"
        )
        await asyncio.sleep(0.5)
        seen = Counter(x.message_ids(1)) + Counter(y.message_ids(1))
        print(f"\nDEPARTURE stale read: dup w={duplicates(seen)} (on Y: {len(y.message_ids(1))})")
        assert set(seen) == expected_ids(adapter, 0, 2 * PER_PARTITION + 1)  # lost: 0
        assert duplicates(seen) == 0, f"Y replayed what X had delivered: {seen.most_common(3)}"
        assert not x.failures and not y.failures


# Airflow's triggerer creates the triggers of a sync before it cancels the ones of the same sync:
# a Dag paused and unpaused between two syncs brings the new trigger up (it reads the stored
# record) before the old one leaves (and writes where it was a lookback ago).
@pytest.mark.parametrize(
    "comes_back_as", ["a new trigger", "a new trigger, started before the old one leaves", "the same trigger"]
)
async def test_a_watcher_whose_trigger_was_deleted_gets_back_what_its_last_events_lost(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch, comes_back_as: str
) -> None:
    """
    w's Dag is paused while w works: the dag-processor drops the asset's reference to w's trigger
    and the triggerer deletes the row; w's events of round 2 are then confirmed persisted and
    stored for no asset (Airflow 3.3's ``Trigger.submit_event``), and only then is w cancelled. On
    unpause w comes back as a new trigger (a deleted row never returns) and must get round 2 again,
    from the position it had ``late_join_lookback`` seconds before it left (round 1 it keeps).

    The same trigger id coming back is a move (the row was never deleted, its events were stored):
    it keeps its exact position, so here, where round 2 really was dropped, it does not get round 2.
    That is the control: it shows what the trigger id decides.
    """
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__POSITION_INTERVAL", "0.2")
    lookback = 6.0
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__LATE_JOIN_LOOKBACK", str(lookback))
    stores = {name: MemoryStateStore() for name in ("a", "w")}
    round_1 = expected_ids(adapter, 0, PER_PARTITION)
    round_2 = expected_ids(adapter, PER_PARTITION, PER_PARTITION + 2)
    await publish_round(adapter, PER_PARTITION)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, watcher(adapter, "a", stores["a"]))
        runner.add(2, watcher(adapter, "w", stores["w"]))
        async with persisting(runner):
            await wait_until(lambda: set(runner.message_ids(2)) == round_1, timeout=60, what="round 1 stored")
            await asyncio.sleep(lookback + 1.0)  # w's position after round 1 is now older than the lookback
            runner.deleted.add(2)  # the Dag is paused: w's trigger row is gone, w still runs
            await publish_round(adapter, 2)
            await wait_until(lambda: runner.dropped[2] == len(round_2), timeout=30, what="w's round 2 dropped")
            await wait_until(lambda: set(runner.message_ids(1)) == round_1 | round_2, timeout=30, what="a has all")
            await asyncio.sleep(1.0)  # w's position passes round 2 (its events were "confirmed")
            assert set(stored_positions(adapter, "w", stores["w"]) or {}) and runner.dropped[2] == len(round_2)
            comeback = 2 if comes_back_as == "the same trigger" else 3
            if comes_back_as.endswith("before the old one leaves"):
                runner.add(comeback, watcher(adapter, "w", stores["w"]))  # the Dag is unpaused ...
                await runner.remove(2)  # ... and the old trigger cancelled in the same sync
            else:
                await runner.remove(2)  # ... and then the triggerer cancels it
                await asyncio.sleep(1.0)  # its farewell write
                runner.add(comeback, watcher(adapter, "w", stores["w"]))  # the Dag is unpaused
            await asyncio.sleep(3.0)
        got = Counter(runner.message_ids(comeback)) if comeback == 3 else Counter(runner.message_ids(2)[len(round_1) :])
        print(
            f"\nDELETED TRIGGER, back as {comes_back_as}: round 2 {len(set(got) & round_2)}/{len(round_2)}, {dict(got)}"
        )
        if comes_back_as != "the same trigger":
            assert set(got) == round_2  # every dropped event again; round 1 (older than the lookback) not
            assert duplicates(got) == 0
        else:
            assert not set(got)  # a move keeps its exact position: nothing again
        assert not runner.failures


async def test_a_re_created_watcher_gets_again_what_a_siblings_filter_dead_lettered(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    CI's production chaos run (stop 37) lost one order for the paused eu watcher: a malformed eu
    order, which the eu filter (region only) fires on and the validating watcher rejects. The eu
    watcher fired it after Airflow had dropped its trigger (stored for no asset), the validator's
    rejection dead-lettered it, and the rewind for the re-created eu watcher skipped it as "in the
    DLQ already". A sibling's rejection is that sibling's judgement: the re-created watcher must
    get the message again, and the DLQ must still hold it once.
    """
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__POSITION_INTERVAL", "0.2")
    lookback = 6.0
    monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__LATE_JOIN_LOOKBACK", str(lookback))
    stores = {name: MemoryStateStore() for name in ("v", "w")}
    validator = functools.partial(
        watcher,
        adapter,
        "v",
        stores["v"],
        dlq_topic=adapter.dlq_topic,
        filter_function="tests.integration.contract.reject_flagged",
    )
    everything = functools.partial(watcher, adapter, "w", stores["w"], dlq_topic=adapter.dlq_topic)
    await adapter.publish(orders(6))  # two per partition (offsets 0 and 1); round 2: offsets 2 and 3
    round_1, round_2 = expected_ids(adapter, 0, 2), expected_ids(adapter, 2, 4)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, validator())
        runner.add(2, everything())
        async with persisting(runner):
            await wait_until(lambda: set(runner.message_ids(2)) == round_1, timeout=60, what="round 1 stored")
            await asyncio.sleep(lookback + 1.0)  # w's position after round 1 is older than the lookback
            runner.deleted.add(2)  # w's Dag is paused: its trigger row is gone, w still runs
            flagged = [json.dumps({"order_id": 100 + i, "region": "eu", "bad": True}).encode() for i in range(3)]
            await adapter.publish([*flagged, *orders(3)])
            await wait_until(lambda: runner.dropped[2] == 6, timeout=30, what="w's round 2 dropped")
            await wait_until_async(lambda: dead_lettered_at_least(adapter, 3), timeout=30)
            await asyncio.sleep(1.0)  # w's position passes round 2 (its events were "confirmed")
            await runner.remove(2)
            await asyncio.sleep(1.0)  # its farewell write
            runner.add(3, everything())  # unpaused: a new trigger
            await wait_until(lambda: set(runner.message_ids(3)) >= round_2, timeout=30, what="w has round 2 again")
            await asyncio.sleep(1.0)
        print(f"\nRE-CREATED, a sibling's rejections: {sorted(runner.message_ids(3))}")
        assert set(runner.message_ids(3)) == round_2  # the three flagged ones among them
        assert len(await adapter.dead_lettered()) == 3  # each flagged one dead-lettered once
        assert not runner.failures
