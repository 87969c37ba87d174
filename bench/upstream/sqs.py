"""
SQS upstream: N independent ``SqsSensorTrigger`` loops (apache-airflow-providers-amazon) with the
AssetWatcher user's defaults (``max_messages=5``, ``wait_time_seconds=1``, ``waiter_delay=60``),
each ``run()`` restarted after it fires, as the triggerer does for an asset watcher, with the
runner's executor hop per event. They delete on reception (before any persistence) and compete:
each watcher sees only part of the queue. Every call an aiobotocore client of this process makes
is counted (the bench's publisher is boto3, not counted).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.common import cpu_seconds
from bench.upstream import Drained, cancel_all, installed, until

if TYPE_CHECKING:
    from bench.triggerer_bench import BenchStream

LABEL = "upstream SqsSensorTrigger"
# Calls per operation name of every aiobotocore client in this process, once counting is installed.
API_CALLS: Counter[str] = Counter()
_installed = [False]


def _count_calls() -> None:
    """Wrap aiobotocore's one call path (idempotent): every client of this process is counted from now on."""
    if _installed[0]:
        return
    from aiobotocore.client import AioBaseClient

    original = AioBaseClient._make_api_call

    async def counted(self: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
        API_CALLS[operation_name] += 1
        return await original(self, operation_name, api_params)

    AioBaseClient._make_api_call = counted  # type: ignore[method-assign]
    _installed[0] = True


def available() -> bool:
    """Whether apache-airflow-providers-amazon (SqsSensorTrigger) is installed."""
    return installed("airflow.providers.amazon")


def _executor_noop() -> None:
    return None


async def _watcher(queue_url: str, conn_id: str, seen: list[int], index: int) -> None:
    from airflow.providers.amazon.aws.triggers.sqs import SqsSensorTrigger

    loop = asyncio.get_running_loop()
    while True:
        trigger = SqsSensorTrigger(sqs_queue=queue_url, aws_conn_id=conn_id)  # the AssetWatcher defaults
        async for event in trigger.run():
            await loop.run_in_executor(None, _executor_noop)  # the runner's log.ainfo hop
            seen[index] += len(event.payload["message_batch"])


async def drain(stream: BenchStream, n: int, messages: int, timeout: float, variant: str = "") -> Drained:
    _count_calls()
    API_CALLS.clear()
    queue_url = stream.kit_stream.source
    seen = [0] * n
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    tasks = [asyncio.create_task(_watcher(queue_url, stream.conn_id, seen, i)) for i in range(n)]
    await until(lambda: sum(seen) >= messages, timeout)
    seconds, cpu, calls = time.perf_counter() - t0, cpu_seconds() - cpu0, sum(API_CALLS.values())
    await cancel_all(tasks)
    received = sum(seen)
    note = "" if received >= messages else "timed out"
    return Drained(LABEL, received, seconds, cpu, statistics.mean(seen) / max(1, received), calls, note)


async def idle_calls(stream: BenchStream, n: int, seconds: float) -> float:
    """ReceiveMessage calls per minute on an empty queue (each watcher polls once per ``waiter_delay``, 60 s)."""
    _count_calls()
    API_CALLS.clear()
    seen = [0] * n
    tasks = [asyncio.create_task(_watcher(stream.kit_stream.source, stream.conn_id, seen, i)) for i in range(n)]
    await asyncio.sleep(seconds)
    calls = API_CALLS["ReceiveMessage"]
    await cancel_all(tasks)
    # A window shorter than waiter_delay sees one round of N calls: scale by the minute it stands for.
    return calls * 60.0 / max(seconds, 60.0)
