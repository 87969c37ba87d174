"""
Deferred release (``_core/release.py``): advanced batches are freed one message per message read,
bounded, and all at once when the stream goes quiet. The effect on CPython's GC is measured in
``bench/`` (docs/performance.md); these tests pin the behaviour the effect relies on.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.producer import flow_window, held_release_limit
from airflow_shared_stream_provider._core.release import ENTRIES_PER_MESSAGE, DeferredRelease
from devkit.memory import QUIET_POLL, MemoryBroker, MemorySharedStreamProducer, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until
from tests.unit.test_core_on_manager import persist_until, publish_orders, trigger

_names = itertools.count()


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"release-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


class Entry:
    """A stand-in for an advanced entry that can tell whether it was freed."""


def test_release_some_frees_one_message_worth_oldest_first() -> None:
    deferred = DeferredRelease(limit=100)
    entries = [Entry() for _ in range(5)]
    refs = [weakref.ref(entry) for entry in entries]
    deferred.hold(entries)
    del entries
    deferred.release_some()
    assert len(deferred) == 5 - ENTRIES_PER_MESSAGE
    # Freed by the release itself (reference counting, no GC pass): that is the point.
    assert [ref() is None for ref in refs] == [True, True, False, False, False]
    deferred.release_some()
    deferred.release_some()
    assert len(deferred) == 0
    assert all(ref() is None for ref in refs)
    deferred.release_some()  # nothing held: a no-op


def test_over_the_limit_the_oldest_go_at_once() -> None:
    deferred = DeferredRelease(limit=4)
    entries = [Entry() for _ in range(7)]
    refs = [weakref.ref(entry) for entry in entries]
    deferred.hold(entries)
    del entries
    assert len(deferred) == 4
    assert [ref() is None for ref in refs] == [True, True, True, False, False, False, False]


def test_release_all_frees_everything() -> None:
    deferred = DeferredRelease(limit=10)
    entry = Entry()
    ref = weakref.ref(entry)
    deferred.hold([entry])
    del entry
    deferred.release_all()
    assert len(deferred) == 0
    assert ref() is None


def test_the_limit_is_a_few_windows_never_more_than_may_be_in_flight() -> None:
    assert held_release_limit(1024, 10_000) == ENTRIES_PER_MESSAGE * 2 * flow_window(1024)
    assert held_release_limit(1024, 100) == ENTRIES_PER_MESSAGE * 100


async def test_on_the_manager_advanced_messages_wait_for_the_next_reads(broker: MemoryBroker) -> None:
    publish_orders(broker, 40)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker))
        await persist_until(runner, lambda: len(broker.committed) == 40, what="40 commits")
        producer: MemorySharedStreamProducer = broker.producers[-1]
        # Everything advanced is held (the stream has not been quiet for a whole poll yet), ...
        held = len(producer.deferred)
        assert 0 < held <= ENTRIES_PER_MESSAGE * 40
        # ... each message read frees one message's worth, ...
        publish_orders(broker, 5)
        await wait_until(lambda: len(runner.pending) == 5, timeout=10, what="5 more events")
        assert len(producer.deferred) == max(0, held - 5 * ENTRIES_PER_MESSAGE)
        runner.persist()
        await wait_until(lambda: len(broker.committed) == 45, timeout=10, what="45 commits")
        # ... and an empty receive releases the rest.
        await wait_until(lambda: len(producer.deferred) == 0, timeout=10 * QUIET_POLL, what="release when quiet")
    assert not runner.failures


async def test_on_the_manager_no_more_than_the_limit_is_held(broker: MemoryBroker) -> None:
    publish_orders(broker, 60)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, max_in_flight=8))
        high = 0

        def step() -> bool:
            nonlocal high
            runner.persist()
            if broker.producers:
                high = max(high, len(broker.producers[-1].deferred))
            return len(broker.committed) == 60

        await wait_until(step, timeout=10, what="60 commits")
        assert broker.producers[-1].deferred.limit == ENTRIES_PER_MESSAGE * 8  # min(max_in_flight, 2 windows)
    assert 0 < high <= ENTRIES_PER_MESSAGE * 8
