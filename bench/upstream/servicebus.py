"""
Service Bus upstream: N independent ``AzureServiceBusQueueTrigger.run()`` loops
(apache-airflow-providers-microsoft-azure) for a fixed window, with the AssetWatcher user's
defaults (``poll_interval=60``) and once with ``poll_interval=0.1`` (its best case). They complete
each message before the event is persisted and compete for the queue: each watcher sees only some
of the messages. They run in a fresh child process: the trigger's sync reads stay blocked in
asgiref's thread after cancellation, and measured in the bench's process that slowed a later
asyncio run ~15x (GIL hand-offs). Calls are the AMQP frames the test broker received in the window.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from bench.common import cpu_seconds
from bench.upstream import Drained, installed

if TYPE_CHECKING:
    from bench.triggerer_bench import BenchStream

LABEL = "upstream AzureServiceBusQueueTrigger"
WINDOW = 20.0  # seconds each variant runs: they do not drain a backlog at poll_interval=60
# One row each, on a fresh backlog: the trigger's default poll interval (None: 60 s), then its best case.
VARIANTS: dict[str, float | None] = {"poll=60": None, "poll=0.1": 0.1}


def _child(
    conn_id: str, connection_string: str, queue: str, n: int, window: float, poll: float | None, pipe: Connection
) -> None:
    """Drive N upstream triggers in a fresh process; send back (messages, CPU s, seconds)."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("azure").setLevel(logging.ERROR)
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(
        {"conn_type": "azure_service_bus", "schema": connection_string}
    )
    from airflow.providers.microsoft.azure.triggers.message_bus import AzureServiceBusQueueTrigger

    logging.getLogger("airflow").setLevel(logging.WARNING)
    counts = [0] * n

    async def drive(i: int) -> None:
        trigger = AzureServiceBusQueueTrigger(queues=[queue], azure_service_bus_conn_id=conn_id, poll_interval=poll)
        async for _event in trigger.run():
            counts[i] += 1

    async def main() -> tuple[float, float]:
        started, cpu0 = time.monotonic(), cpu_seconds()
        tasks = [asyncio.create_task(drive(i)) for i in range(n)]
        await asyncio.sleep(window)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return cpu_seconds() - cpu0, time.monotonic() - started

    cpu, elapsed = asyncio.run(main())
    pipe.send((counts, cpu, elapsed))
    pipe.close()
    os._exit(0)  # do not wait for the sync reads still blocked in asgiref's thread


def available() -> bool:
    """Whether apache-airflow-providers-microsoft-azure is installed (it is not a dependency of this repo)."""
    return installed("airflow.providers.microsoft.azure")


def _frames(stream: BenchStream) -> int:
    handle = stream.broker.kit.handle  # type: ignore[attr-defined]  # ServiceBusKit's test broker
    return sum(handle.operations().received.values()) if handle is not None else 0


async def _window(
    stream: BenchStream, n: int, window: float, poll: float | None
) -> tuple[list[int], float, float, int]:
    frames0 = _frames(stream)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    kit = stream.broker.kit
    args = (stream.conn_id, kit.connection()["schema"], stream.kit_stream.source, n, window, poll, child)
    process = context.Process(target=_child, args=args, daemon=True)
    process.start()

    def receive() -> tuple[list[int], float, float]:
        while not parent.poll(0.5):  # a child that died sends nothing: do not wait for it forever
            if not process.is_alive():
                raise RuntimeError(f"the upstream child exited ({process.exitcode}) without a result")
        result: tuple[list[int], float, float] = parent.recv()
        return result

    counts, cpu, seconds = await asyncio.to_thread(receive)
    await asyncio.to_thread(process.join, 10)
    return counts, cpu, seconds, _frames(stream) - frames0


async def drain(stream: BenchStream, n: int, messages: int, timeout: float, variant: str) -> Drained:
    """What the N watchers take off the queue in one window (they do not drain it at 60 s polls)."""
    window = min(WINDOW, timeout)
    counts, cpu, seconds, frames = await _window(stream, n, window, VARIANTS[variant])
    received = sum(counts)
    seen = received / n / max(1, received)
    return Drained(f"{LABEL} {variant}", received, seconds, cpu, seen, frames, f"{window:.0f} s window")


async def idle_calls(stream: BenchStream, n: int, seconds: float) -> float:
    """AMQP frames per minute on an empty queue (default poll interval)."""
    _, _, elapsed, frames = await _window(stream, n, seconds, None)
    return frames * 60.0 / elapsed
