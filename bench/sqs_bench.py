"""
SQS benchmark: N watchers on one queue, ours vs N upstream ``SqsSensorTrigger``s vs a bare loop.

Not a test. Run from the repository root::

    .venv/bin/python bench/sqs_bench.py                              # N = 1, 10, 100
    .venv/bin/python bench/sqs_bench.py --ns 1,10 --messages 200 --idle 20 --write

The SQS endpoint is moto's server in a **child process** (``moto_server``), so its CPU does not
count against the client's. Every API call the client side makes goes through aiobotocore and is
counted there (the bench's own publishing/admin client is a plain boto3 client in a thread and is
not counted; publishing happens before the clock starts).

* **Ours**: ``SqsSharedStreamTrigger`` x N (defaults: long polling 20 s, one receive in flight)
  through the real ``SharedStreamManager``, driven like the triggerer (``RunnerSim``: per-event
  executor hop, persistence confirmed every 50 ms). Backlog of ``--messages``, timed from subscribe
  until every message is deleted **and** every watcher persisted every message.
* **Upstream**: N independent ``SqsSensorTrigger`` loops (apache-airflow-providers-amazon) with the
  AssetWatcher user's defaults (``max_messages=5``, ``wait_time_seconds=1``, ``waiter_delay=60``),
  each ``run()`` restarted after it fires, as the triggerer does for an asset watcher, with the
  same executor hop per event. They delete on reception (before any persistence) and compete:
  each watcher sees only part of the queue.
* **Bare**: one aiobotocore client, ``ReceiveMessage`` (10, long poll) + ``DeleteMessageBatch``:
  the endpoint's own ceiling in the same run.
* **Latency**: N watchers on an empty queue, ``--latency-messages`` published one by one at
  ``--rate`` per second; publish (SentTimestamp) -> event persisted.
* **Idle**: N watchers on an empty queue for ``--idle`` seconds; API calls scaled to a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.scratch import throwaway_dir  # noqa: E402  (needs the sys.path entry above)

os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-sqs-bench-")

CONN_ID = "aws_sqs_bench"
REGION = "us-east-1"

# -- API call accounting (every aiobotocore client in this process) --------------------------------
API_CALLS: Counter[str] = Counter()
DELETED = [0]


def _install_call_counter() -> None:
    from aiobotocore.client import AioBaseClient

    original = AioBaseClient._make_api_call

    async def counted(self: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
        API_CALLS[operation_name] += 1
        response = await original(self, operation_name, api_params)
        if operation_name == "DeleteMessageBatch":
            DELETED[0] += len(response.get("Successful") or [])
        elif operation_name == "DeleteMessage":
            DELETED[0] += 1
        return response

    AioBaseClient._make_api_call = counted  # type: ignore[method-assign]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _executor_noop() -> None:
    return None


# -- endpoint --------------------------------------------------------------------------------------
class Endpoint:
    def __init__(self) -> None:
        from devkit.ports import free_port, wait_for_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        binary = Path(sys.executable).parent / "moto_server"
        self.process = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for_port(self.port, timeout=30)
        import boto3

        self.admin = boto3.client(
            "sqs",
            region_name=REGION,
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    async def new_queue(self) -> str:
        response = await asyncio.to_thread(self.admin.create_queue, QueueName=f"bench-{uuid.uuid4().hex[:10]}")
        return str(response["QueueUrl"])

    async def publish(self, queue_url: str, count: int) -> None:
        def send() -> None:
            for start in range(0, count, 10):
                entries = [
                    {"Id": str(i), "MessageBody": json.dumps({"n": start + i, "region": "eu"})}
                    for i in range(min(10, count - start))
                ]
                self.admin.send_message_batch(QueueUrl=queue_url, Entries=entries)

        await asyncio.to_thread(send)

    async def publish_one(self, queue_url: str, n: int) -> None:
        await asyncio.to_thread(self.admin.send_message, QueueUrl=queue_url, MessageBody=json.dumps({"n": n}))

    async def depth(self, queue_url: str) -> int:
        response = await asyncio.to_thread(
            self.admin.get_queue_attributes,
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )
        attrs = response["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


# -- results ---------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    n: int
    messages: int
    seconds: float
    cpu: float
    calls: int
    seen_per_watcher: float = 0.0
    note: str = ""

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def events_per_s(self) -> float:
        return self.messages * self.seen_per_watcher * self.n / self.seconds if self.seconds else 0.0


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            print(f"  ! timed out waiting for {what}", flush=True)
            return False
        await asyncio.sleep(0.02)
    return True


def _reset() -> None:
    API_CALLS.clear()
    DELETED[0] = 0


# -- ours ------------------------------------------------------------------------------------------
async def run_ours(endpoint: Endpoint, n: int, messages: int, timeout: float) -> Row:
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
    from devkit.runner import RunnerSim

    queue_url = await endpoint.new_queue()
    await endpoint.publish(queue_url, messages)
    _reset()
    cpu0, t0 = _cpu(), time.perf_counter()
    async with RunnerSim(SharedStreamManager(), executor_hop=True, confirm_interval=0.05) as runner:
        for trigger_id in range(n):
            runner.add(trigger_id, SqsSharedStreamTrigger(queue_url=queue_url, aws_conn_id=CONN_ID))
        done = await wait_for(
            lambda: DELETED[0] >= messages and all(runner.count(t) >= messages for t in range(n)),
            timeout,
            "ours to drain",
        )
        seconds, cpu, calls = time.perf_counter() - t0, _cpu() - cpu0, sum(API_CALLS.values())
        breakdown = dict(API_CALLS)
        failures = len(runner.failures)
        seen = min(runner.count(t) for t in range(n)) / messages
    note = "" if done else "timed out"
    if os.environ.get("SQS_BENCH_VERBOSE"):
        print(f"  api calls: {breakdown}", flush=True)
    if failures:
        note += f" {failures} watcher(s) failed"
    return Row("ours", n, messages, seconds, cpu, calls, seen, note.strip())


async def latency_ours(endpoint: Endpoint, n: int, count: int, rate: float) -> list[float]:
    from airflow.triggers.base import TriggerEvent
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
    from devkit.runner import RunnerSim

    queue_url = await endpoint.new_queue()
    latencies: list[float] = []

    def on_persist(trigger_id: int, event: TriggerEvent) -> None:
        if trigger_id == 0:
            sent = datetime.fromisoformat(event.payload["published_at"]).timestamp()
            latencies.append(time.time() - sent)

    async with RunnerSim(SharedStreamManager(), executor_hop=True, confirm_interval=0.05, on_persist=on_persist) as r:
        for trigger_id in range(n):
            r.add(trigger_id, SqsSharedStreamTrigger(queue_url=queue_url, aws_conn_id=CONN_ID))
        await asyncio.sleep(1.0)  # the first long poll is in flight
        for i in range(count):
            await endpoint.publish_one(queue_url, i)
            await asyncio.sleep(1.0 / rate)
        await wait_for(lambda: len(latencies) >= count, 30, "latency events")
    return latencies


async def idle_ours(endpoint: Endpoint, n: int, seconds: float) -> float:
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
    from devkit.runner import RunnerSim

    queue_url = await endpoint.new_queue()
    async with RunnerSim(SharedStreamManager(), executor_hop=True, confirm_interval=0.05) as runner:
        for trigger_id in range(n):
            runner.add(trigger_id, SqsSharedStreamTrigger(queue_url=queue_url, aws_conn_id=CONN_ID))
        await asyncio.sleep(2.0)  # connect + queue checks are not idle traffic
        _reset()
        await asyncio.sleep(seconds)
        calls = sum(API_CALLS.values())
    return calls * 60.0 / seconds


# -- upstream --------------------------------------------------------------------------------------
def upstream_available() -> bool:
    try:
        import airflow.providers.amazon.aws.triggers.sqs  # noqa: F401
    except ImportError:
        return False
    return True


async def _upstream_watcher(queue_url: str, seen: list[int], index: int, stop: asyncio.Event) -> None:
    from airflow.providers.amazon.aws.triggers.sqs import SqsSensorTrigger

    loop = asyncio.get_running_loop()
    while not stop.is_set():
        trigger = SqsSensorTrigger(sqs_queue=queue_url, aws_conn_id=CONN_ID)  # the AssetWatcher defaults
        async for event in trigger.run():
            await loop.run_in_executor(None, _executor_noop)  # the runner's log.ainfo hop
            seen[index] += len(event.payload["message_batch"])


async def run_upstream(endpoint: Endpoint, n: int, messages: int, timeout: float) -> Row:
    queue_url = await endpoint.new_queue()
    await endpoint.publish(queue_url, messages)
    _reset()
    seen = [0] * n
    stop = asyncio.Event()
    cpu0, t0 = _cpu(), time.perf_counter()
    tasks = [asyncio.create_task(_upstream_watcher(queue_url, seen, i, stop)) for i in range(n)]
    done = await wait_for(lambda: sum(seen) >= messages, timeout, "upstream to drain")
    seconds, cpu, calls = time.perf_counter() - t0, _cpu() - cpu0, sum(API_CALLS.values())
    stop.set()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task
    received = sum(seen)
    return Row(
        "upstream",
        n,
        received,
        seconds,
        cpu,
        calls,
        statistics.mean(seen) / max(1, received),
        "" if done else "timed out",
    )


async def idle_upstream(endpoint: Endpoint, n: int, seconds: float) -> float:
    queue_url = await endpoint.new_queue()
    seen = [0] * n
    stop = asyncio.Event()
    _reset()
    tasks = [asyncio.create_task(_upstream_watcher(queue_url, seen, i, stop)) for i in range(n)]
    await asyncio.sleep(seconds)
    calls = sum(v for k, v in API_CALLS.items() if k == "ReceiveMessage")
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task
    # Each watcher polls once per waiter_delay (60 s): the window sees one round of N calls.
    return calls * 60.0 / max(seconds, 60.0)


# -- bare loop -------------------------------------------------------------------------------------
async def run_bare(endpoint: Endpoint, messages: int, timeout: float) -> Row:
    from aiobotocore.session import get_session

    queue_url = await endpoint.new_queue()
    await endpoint.publish(queue_url, messages)
    _reset()
    cpu0, t0 = _cpu(), time.perf_counter()
    async with get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=endpoint.url, aws_access_key_id="x", aws_secret_access_key="y"
    ) as client:
        received = 0
        deadline = time.monotonic() + timeout
        while received < messages and time.monotonic() < deadline:
            response = await client.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
            batch = response.get("Messages") or []
            if batch:
                await client.delete_message_batch(
                    QueueUrl=queue_url,
                    Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(batch)],
                )
                received += len(batch)
    seconds, cpu, calls = time.perf_counter() - t0, _cpu() - cpu0, sum(API_CALLS.values())
    return Row("bare aiobotocore", 1, received, seconds, cpu, calls, 1.0)


# -- report ----------------------------------------------------------------------------------------
HEADER = (
    "| side | N | msgs | msgs/s | events/s | each watcher saw | client CPU ms/msg | API calls/msg | note |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---|"
)


def fmt(row: Row) -> str:
    per_msg = 1000 * row.cpu / max(1, row.messages)
    calls = row.calls / max(1, row.messages)
    return (
        f"| {row.name} | {row.n} | {row.messages} | {row.msgs_per_s:.1f} | {row.events_per_s:.1f} | "
        f"{100 * row.seen_per_watcher:.0f}% | {per_msg:.2f} | {calls:.2f} | {row.note} |"
    )


async def main(args: argparse.Namespace) -> None:
    _install_call_counter()
    endpoint = Endpoint()
    conn = {
        "conn_type": "aws",
        "login": "testing",
        "password": "testing",
        "extra": {"region_name": REGION, "endpoint_url": endpoint.url},
    }
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(conn)
    ns = [int(x) for x in args.ns.split(",")]
    with_upstream = upstream_available() and not args.skip_upstream
    lines: list[str] = []
    latency_lines: list[str] = []
    idle_lines: list[str] = []
    try:
        bare = await run_bare(endpoint, args.messages, args.timeout)
        print(HEADER)
        print(fmt(bare), flush=True)
        lines.append(fmt(bare))
        for n in ns:
            row = await run_ours(endpoint, n, args.messages, args.timeout)
            print(fmt(row), flush=True)
            lines.append(fmt(row))
            if with_upstream:
                row = await run_upstream(endpoint, n, args.messages, args.timeout)
                print(fmt(row), flush=True)
                lines.append(fmt(row))
        for n in ns:
            latencies = await latency_ours(endpoint, n, args.latency_messages, args.rate)
            if latencies:
                ordered = sorted(latencies)
                p50 = statistics.median(ordered)
                p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
                text = f"| ours | {n} | {len(ordered)} | {1000 * p50:.0f} | {1000 * p95:.0f} |"
            else:
                text = f"| ours | {n} | 0 | - | - |"
            print(text, flush=True)
            latency_lines.append(text)
        for n in sorted({ns[0], ns[-1]}):
            per_minute = await idle_ours(endpoint, n, args.idle)
            text = f"| ours | {n} | {per_minute:.1f} |"
            print(text, flush=True)
            idle_lines.append(text)
        if with_upstream:
            n = ns[-1]
            per_minute = await idle_upstream(endpoint, n, args.idle)
            text = f"| upstream | {n} | {per_minute:.1f} (ReceiveMessage only; plus a new client per poll) |"
            print(text, flush=True)
            idle_lines.append(text)
    finally:
        endpoint.stop()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    command = "python bench/sqs_bench.py " + " ".join(sys.argv[1:])
    report = "\n".join(
        [
            "## SQS",
            "",
            f"Command: `{command.strip()}` (moto {_moto_version()} server in a child process, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; "
            f"peak RSS of the bench process {rss_mb:.0f} MB).",
            "",
            "Backlog drain (client CPU and API calls counted in the bench process only; the endpoint runs apart):",
            "",
            HEADER,
            *lines,
            "",
            f"Publish-to-event latency (messages published one by one at {args.rate}/s, event persisted):",
            "",
            "| side | N | msgs | p50 ms | p95 ms |",
            "|---|---:|---:|---:|---:|",
            *latency_lines,
            "",
            f"Idle API calls per minute (empty queue, {args.idle:.0f} s window):",
            "",
            "| side | N | calls/min |",
            "|---|---:|---:|",
            *idle_lines,
            "",
        ]
    )
    if args.write:
        target = ROOT / "docs" / "performance-sqs.md"
        existing = target.read_text() if target.exists() else ""
        marker = "<!-- bench output -->"
        head = existing.split(marker)[0] if marker in existing else existing
        target.write_text(head.rstrip() + "\n\n" + marker + "\n\n" + report)
        print(f"wrote {target}")
    else:
        print(report)


def _moto_version() -> str:
    try:
        import moto

        return str(moto.__version__)
    except ImportError:
        return "?"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="1,10,100", help="watcher counts (comma separated)")
    parser.add_argument("--messages", type=int, default=300, help="backlog size per run")
    parser.add_argument("--latency-messages", type=int, default=20)
    parser.add_argument("--rate", type=float, default=5.0, help="messages per second in the latency run")
    parser.add_argument("--idle", type=float, default=45.0, help="seconds of the idle measurement")
    parser.add_argument("--timeout", type=float, default=180.0, help="cap per drain run, seconds")
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--write", action="store_true", help="write docs/performance-sqs.md")
    asyncio.run(main(parser.parse_args()))
