"""
A graceful triggerer stop in Airflow 3.3.2's order, on the real ``SharedStreamManager``.

On SIGTERM the trigger runner stops syncing with its supervisor (no event fired from then on is
persisted or confirmed), calls ``manager.stop_all()`` (which empties the manager's group map, then
stops the groups one after the other) and only then cancels the trigger tasks. A group waiting for
its turn keeps polling, and its watchers' events bind to nothing (``bind_pending_event`` finds no
group): without ``_core/binding.py`` the manager takes them as persisted and the producer settles
messages whose events exist nowhere. Found by the soak (docs/reliability.md, "Soak").
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

_names = itertools.count()


@pytest.fixture
def make_broker() -> Any:
    made: list[str] = []

    def make(close_delay: float = 0.0) -> MemoryBroker:
        name = f"graceful-{next(_names)}"
        made.append(name)
        broker = memory_broker(name)
        broker.close_delay = close_delay
        return broker

    yield make
    for name in made:
        brokers.pop(name, None)


@pytest.mark.parametrize("batch_size", [1, 10])
async def test_events_fired_while_another_group_stops_first_are_redelivered(make_broker: Any, batch_size: int) -> None:
    slow, busy = make_broker(close_delay=1.0), make_broker()
    manager = SharedStreamManager(ack_timeout=60)
    runner = RunnerSim(manager, confirm_interval=0.05)
    await runner.__aenter__()
    # The slow stream subscribes first, so stop_all() stops it first (its close takes 1 s).
    runner.add(1, MemorySharedStreamTrigger(broker_name=slow.name))
    # A lane per message, like unordered SQS / Pub/Sub / Service Bus messages: a resolved message
    # is advanced at once, whatever is still pending before it.
    options: dict[str, Any] = {"broker_name": busy.name, "lanes": True, "batch_size": batch_size, "batch_timeout": 0.05}
    runner.add(2, MemorySharedStreamTrigger(**options))
    runner.add(3, MemorySharedStreamTrigger(**options))
    for index in range(5):
        busy.publish(json.dumps({"order_id": index}), lane=f"order-{index}")
    await wait_until(lambda: runner.count(2) + runner.count(3) >= 2 * (1 if batch_size > 1 else 5), timeout=10)
    await wait_until(lambda: len(busy.committed) == 5, timeout=10, what="the first 5 committed")
    await runner.stop_persisting()  # SIGTERM: the runner no longer syncs; nothing more is persisted

    async def keep_publishing() -> None:
        for index in range(5, 25):
            busy.publish(json.dumps({"order_id": index}), lane=f"order-{index}")
            await asyncio.sleep(0.04)

    sending = asyncio.create_task(keep_publishing())
    await asyncio.sleep(0.2)
    await runner.stop_in_airflow_order()
    await sending
    await asyncio.sleep(0.2)  # held messages come back after the memory broker's 50 ms hold
    assert runner.pending, "the busy stream fired nothing while the slow one stopped: no case made"
    # Nothing but the first 5 was persisted, so nothing else may be committed.
    assert sorted(busy.committed) == sorted(f"{busy.name}-{index}" for index in range(5)), busy.committed
    # And everything else is back for the next triggerer.
    assert len(busy.available) + len(busy.in_flight) == 20
