"""
A cancellation is never lost (``_core/tasks.wait_for``).

Before Python 3.12, ``asyncio.wait_for`` swallows a cancellation of its caller that arrives in the
loop turn its awaitable completes. The manager stops a group by cancelling its poll task, often in
the turn a watcher's departure sets the event the stream waits on: with ``asyncio.wait_for`` the
stream then ran on with no watcher, and ``unsubscribe`` never returned (the last test below hung
before the fix).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider._core.tasks import wait_for
from devkit.memory import MemoryMessage, MemorySharedStreamProducer, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_shared_stream_provider"


async def _cancel_as_it_completes(waiter: object) -> asyncio.Task[object]:
    event = asyncio.Event()
    task: asyncio.Task[object] = asyncio.ensure_future(waiter(event.wait(), 30))  # type: ignore[operator]
    await asyncio.sleep(0)  # the task now waits on the event
    event.set()  # its awaitable completes in this turn ...
    task.cancel()  # ... and its caller is cancelled in the same turn
    await asyncio.wait((task,))
    return task


async def test_a_cancellation_in_the_turn_the_awaitable_completes_is_kept() -> None:
    task = await _cancel_as_it_completes(wait_for)
    assert task.cancelled()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for is fixed in Python 3.12")
async def test_the_race_is_real_with_asyncio_wait_for_before_312() -> None:
    # The control: the scenario above does hit the bug this module's helper avoids.
    task = await _cancel_as_it_completes(asyncio.wait_for)
    assert not task.cancelled() and task.result() is True


async def test_the_timeout_still_raises_and_cancels_the_awaitable() -> None:
    inner = asyncio.ensure_future(asyncio.sleep(30))
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(inner, 0.01)
    assert inner.cancelled()


def test_the_package_uses_no_asyncio_wait_for() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "tasks.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line
    ]
    assert not offenders, f"use airflow_shared_stream_provider._core.tasks.wait_for: {offenders}"


async def test_a_stream_whose_only_watcher_fails_at_once_stops() -> None:
    # The watcher fails while the stream is in its cohort wait: its departure wakes that wait in
    # the turn the manager cancels the poll task.
    name = "cancel-safety"
    broker = memory_broker(name)
    runner = RunnerSim(SharedStreamManager())

    async def scenario() -> None:
        async with runner:  # its exit stops the manager: that hung forever before the fix
            runner.add(1, MemorySharedStreamTrigger(broker_name=name, filter_function="json.no_such_function"))
            await wait_until(lambda: 1 in runner.failures, timeout=10, what="watcher 1 failed")

    try:
        broker.publish(json.dumps({"order_id": 1}))
        # asyncio.wait, not wait_for: the bug under test would swallow wait_for's own timeout here.
        task = asyncio.ensure_future(scenario())
        await asyncio.wait((task,), timeout=20)
        assert task.done(), "the manager did not stop: the stream's poll task lost its cancellation"
        task.result()
        assert isinstance(runner.failures[1], SharedStreamConfigError)
    finally:
        brokers.pop(name, None)


class LosesCancellationsProducer(MemorySharedStreamProducer):
    """
    A client call that loses a cancellation arriving mid-call, as a client library may: in the
    receive (redis-py's send did) or in one of the loop's hooks that call a client (Kafka's
    placement, Redis's lease renewal in ``_admit``, Service Bus's settlements in ``_before_receive``).
    The chosen call takes 0.2 s, the others 0.01 s: the cancellation lands in the chosen one.
    """

    loses_in: ClassVar[str] = "receive"
    lost: ClassVar[int] = 0
    calling: ClassVar[asyncio.Event]

    async def _client_call(self, where: str) -> None:
        if where != self.loses_in:
            await asyncio.sleep(0.01)
            return
        type(self).calling.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            type(self).lost += 1

    async def _receive(self, count: int) -> list[MemoryMessage]:
        await self._client_call("receive")
        return []

    async def _before_receive(self) -> None:
        await self._client_call("before_receive")

    async def _admit(self, received: list[Any]) -> list[Any]:
        await self._client_call("admit")
        return received

    async def _after_empty(self, received: list[Any]) -> None:
        await self._client_call("after_empty")


class LosesInBeforeReceive(LosesCancellationsProducer):
    loses_in = "before_receive"


class LosesInAdmit(LosesCancellationsProducer):
    loses_in = "admit"


class LosesInAfterEmpty(LosesCancellationsProducer):
    loses_in = "after_empty"


def _trigger_of(producer: type[LosesCancellationsProducer]) -> type[MemorySharedStreamTrigger]:
    return type(
        f"{producer.__name__}Trigger",
        (MemorySharedStreamTrigger,),
        {"producer_class_path": f"{__name__}.{producer.__name__}", "__module__": __name__},
    )


# Where the call loses the cancellation -> (producer, its trigger).
LOSERS: dict[str, tuple[type[LosesCancellationsProducer], type[MemorySharedStreamTrigger]]] = {
    producer.loses_in: (producer, _trigger_of(producer))
    for producer in (LosesCancellationsProducer, LosesInBeforeReceive, LosesInAdmit, LosesInAfterEmpty)
}


@pytest.mark.parametrize("loses_in", sorted(LOSERS))
async def test_a_cancellation_a_client_library_loses_still_ends_the_stream(loses_in: str) -> None:
    # The manager stops a group by cancelling its poll task and awaiting it: the receive loop ends
    # after the call that lost it (redis-py's send through asyncio.wait_for did: the stream then
    # read on with no watcher and unsubscribe never returned; _core/tasks.call_keeping_cancellation).
    # Before the fix this test hung until pytest-timeout (the receive; the hooks until they were
    # wrapped too).
    name = f"cancel-lost-{loses_in}"
    memory_broker(name)
    producer, trigger_class = LOSERS[loses_in]
    producer.lost, producer.calling = 0, asyncio.Event()
    manager = SharedStreamManager()
    runner = RunnerSim(manager)
    try:
        async with runner:
            runner.add(1, trigger_class(broker_name=name))
            await asyncio.wait_for(producer.calling.wait(), 10)
            task = asyncio.ensure_future(runner.remove(1))
            await asyncio.wait((task,), timeout=10)
            assert task.done(), f"the stream did not end: its poll task lost its cancellation in {loses_in}"
            task.result()
        assert producer.lost == 1
        assert not manager._groups  # the group is gone, not polling on
    finally:
        brokers.pop(name, None)
