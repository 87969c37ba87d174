"""
Service Bus benchmark: N watchers on one queue, ours vs N upstream ``AzureServiceBusQueueTrigger``s.

Not a test. Run from the repository root::

    .venv/bin/python bench/servicebus_bench.py                      # N = 1, 10, 100
    .venv/bin/python bench/servicebus_bench.py --ns 1,10 --messages 1000 --idle 20

The wire-level test broker (``tests/servicebus_broker``) runs in a **child process**, so its CPU
does not count against the client's, and counts every AMQP frame clients send: that is the
"AMQP operations" figure, the same for both sides (attach / flow / transfer / disposition /
detach / open / close, management requests included).

Ours: ``ServiceBusSharedStreamTrigger`` x N through the real ``SharedStreamManager`` driven like
the triggerer (``RunnerSim``: per-event executor hop, persistence confirmed every 50 ms). Timed
from subscribe until the queue is empty **and** every watcher persisted every message.

Upstream: N independent ``AzureServiceBusQueueTrigger.run()`` loops (apache-airflow-providers-
microsoft-azure) for a fixed window, with the AssetWatcher user's defaults (``poll_interval=60``)
and once with ``poll_interval=0.1`` (its best case). They complete each message before the event
is persisted and compete for the queue: each watcher sees only some of the messages.

Idle: N watchers on an empty queue for ``--idle`` seconds; frames scaled to a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import resource
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

CONN_ID = "servicebus_bench"


# -- the broker in a child process ---------------------------------------------------------------
def _broker_main(pipe: Connection) -> None:
    from tests.servicebus_broker.broker import start_broker

    handle = start_broker()
    pipe.send(handle.connection_string)
    while True:
        command, args = pipe.recv()
        if command == "stop":
            handle.stop()
            pipe.send(None)
            return
        try:
            if command == "create_queue":
                handle.create_queue(args[0], lock_duration=args[1])
                result: Any = None
            elif command == "counts":
                counts = handle.counts(args[0])
                result = counts.active + counts.locked + counts.deferred
            elif command == "frames":
                ops = handle.operations()
                result = (sum(ops.received.values()), sum(ops.management.values()))
            elif command == "errors":
                result = [str(e) for e in handle.errors]
            else:
                result = ValueError(command)
        except Exception as exc:  # surfaced in the parent
            result = exc
        pipe.send(result)


class BrokerProcess:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._process = ctx.Process(target=_broker_main, args=(child,), daemon=True)
        self._process.start()
        self.connection_string: str = self._pipe.recv()

    def call(self, command: str, *args: Any) -> Any:
        self._pipe.send((command, args))
        result = self._pipe.recv()
        if isinstance(result, Exception):
            raise result
        return result

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call("stop")
        self._process.join(10)


# -- helpers -------------------------------------------------------------------------------------
async def publish(connection_string: str, queue: str, count: int) -> None:
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    async with (
        ServiceBusClient.from_connection_string(connection_string) as client,
        client.get_queue_sender(queue) as sender,
    ):
        for start in range(0, count, 200):
            batch = await sender.create_message_batch()
            for i in range(start, min(count, start + 200)):
                batch.add_message(ServiceBusMessage(json.dumps({"order_id": i, "region": ("eu", "us")[i % 2]})))
            await sender.send_messages(batch)


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


@dataclass
class Row:
    system: str
    n: int
    messages: int
    seconds: float
    events: int
    frames: int
    management: int
    cpu: float

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def frames_per_min(self) -> float:
        return self.frames * 60.0 / self.seconds if self.seconds else 0.0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- ours ----------------------------------------------------------------------------------------
async def run_ours(broker: BrokerProcess, n: int, messages: int) -> Row:
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
    from devkit.runner import RunnerSim

    queue = f"bench-{uuid.uuid4().hex[:6]}"
    broker.call("create_queue", queue, 30.0)
    await publish(broker.connection_string, queue, messages)
    frames0, mgmt0 = broker.call("frames")
    cpu0 = _cpu()
    start = time.monotonic()
    manager = SharedStreamManager(ack_timeout=120)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.05) as runner:
        for i in range(n):
            runner.add(i, ServiceBusSharedStreamTrigger(queue_name=queue, azure_service_bus_conn_id=CONN_ID))
        await wait_for(
            lambda: all(runner.count(i) >= messages for i in range(n)), 600, f"ours N={n}: every watcher persisted"
        )
        last_check = 0.0

        def drained() -> bool:
            nonlocal last_check
            now = time.monotonic()
            if now - last_check < 0.05:
                return False
            last_check = now
            return bool(broker.call("counts", queue) == 0)

        await wait_for(drained, 120, f"ours N={n}: queue drained")
        seconds = time.monotonic() - start
        cpu = _cpu() - cpu0
        frames1, mgmt1 = broker.call("frames")
        if runner.failures:
            raise RuntimeError(f"watchers failed: {runner.failures}")
        events = sum(runner.count(i) for i in range(n))
    return Row("ours", n, messages, seconds, events, frames1 - frames0, mgmt1 - mgmt0, cpu)


async def idle_ours(broker: BrokerProcess, n: int, seconds: float) -> Row:
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
    from devkit.runner import RunnerSim

    queue = f"idle-{uuid.uuid4().hex[:6]}"
    broker.call("create_queue", queue, 30.0)
    manager = SharedStreamManager(ack_timeout=120)
    async with RunnerSim(manager, executor_hop=True, confirm_interval=0.05) as runner:
        for i in range(n):
            runner.add(i, ServiceBusSharedStreamTrigger(queue_name=queue, azure_service_bus_conn_id=CONN_ID))
        await asyncio.sleep(3)  # connected and receiving
        frames0, mgmt0 = broker.call("frames")
        cpu0 = _cpu()
        await asyncio.sleep(seconds)
        frames1, mgmt1 = broker.call("frames")
        cpu = _cpu() - cpu0
    return Row("ours idle", n, 0, seconds, 0, frames1 - frames0, mgmt1 - mgmt0, cpu)


# -- upstream ------------------------------------------------------------------------------------
def _upstream_child(
    connection_string: str, queue: str, n: int, window: float, poll: float | None, pipe: Connection
) -> None:
    """Drive N upstream triggers in a fresh process (their sync reads run in asgiref's one thread)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("azure").setLevel(logging.ERROR)
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {"conn_type": "azure_service_bus", "schema": connection_string}
    )
    from airflow.providers.microsoft.azure.triggers.message_bus import AzureServiceBusQueueTrigger

    logging.getLogger("airflow").setLevel(logging.WARNING)
    counts = [0] * n

    async def drive(i: int) -> None:
        trigger = AzureServiceBusQueueTrigger(queues=[queue], azure_service_bus_conn_id=CONN_ID, poll_interval=poll)
        async for _event in trigger.run():
            counts[i] += 1

    async def main() -> tuple[float, float]:
        started = time.monotonic()
        tasks = [asyncio.create_task(drive(i)) for i in range(n)]
        cpu0 = _cpu()
        await asyncio.sleep(window)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return _cpu() - cpu0, time.monotonic() - started

    cpu, elapsed = asyncio.run(main())
    pipe.send((sum(counts), cpu, elapsed))
    pipe.close()
    os._exit(0)  # do not wait for the sync reads still blocked in asgiref's thread


async def run_upstream(
    broker: BrokerProcess, n: int, messages: int, window: float, poll_interval: float | None, *, idle: bool = False
) -> Row:
    queue = f"up-{uuid.uuid4().hex[:6]}"
    broker.call("create_queue", queue, 30.0)
    if not idle:
        await publish(broker.connection_string, queue, messages)
    frames0, mgmt0 = broker.call("frames")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=_upstream_child, args=(broker.connection_string, queue, n, window, poll_interval, child), daemon=True
    )
    process.start()
    done, cpu, seconds = await asyncio.to_thread(parent.recv)
    await asyncio.to_thread(process.join, 10)
    frames1, mgmt1 = broker.call("frames")
    label = f"upstream poll={poll_interval if poll_interval else 60}" + (" idle" if idle else "")
    # messages/s here is what the N watchers together took off the queue in the window.
    return Row(label, n, done, seconds, done, frames1 - frames0, mgmt1 - mgmt0, cpu)


def upstream_available() -> bool:
    try:
        import airflow.providers.microsoft.azure.triggers.message_bus  # noqa: F401
    except ImportError:
        return False
    return True


# -- main ----------------------------------------------------------------------------------------
def fmt(row: Row) -> str:
    per_event_cpu = row.cpu / row.messages * 1000 if row.messages else 0.0
    return (
        f"| {row.system:<26} | {row.n:>4} | {row.messages:>6} | {row.seconds:7.2f} | {row.msgs_per_s:9.1f} "
        f"| {row.events:>7} | {row.frames:>7} | {row.frames_per_min:9.0f} | {row.management:>5} "
        f"| {row.cpu:6.2f} | {per_event_cpu:7.2f} |"
    )


HEADER = (
    "| system                     |    N |   msgs |       s |   msgs/s |  events |  frames | frames/min |  mgmt "
    "|  CPU s | ms CPU/msg |\n"
    "|----------------------------|------|--------|---------|----------|---------|---------|------------|-------"
    "|--------|------------|"
)


async def main(args: argparse.Namespace) -> None:
    broker = BrokerProcess()
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {"conn_type": "azure_service_bus", "schema": broker.connection_string}
    )
    ns = [int(x) for x in args.ns.split(",")]
    rows: list[Row] = []
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(HEADER)
    try:
        # Ours first, for every N: the upstream trigger leaves its sync client blocked in a thread
        # after cancellation (asgiref's executor), and measured here that slowed a later asyncio
        # run in the same process ~15x (GIL hand-offs), which would be unfair to whoever runs last.
        for n in ns:
            for row in (
                await run_ours(broker, n, args.messages),
                await idle_ours(broker, n, args.idle),
            ):
                rows.append(row)
                print(fmt(row), flush=True)
        if upstream_available() and not args.no_upstream:
            for n in ns:
                for poll in (None, 0.1):
                    row = await run_upstream(broker, n, args.messages, args.upstream_window, poll)
                    rows.append(row)
                    print(fmt(row), flush=True)
                row = await run_upstream(broker, n, 0, args.idle, None, idle=True)
                rows.append(row)
                print(fmt(row), flush=True)
        errors = broker.call("errors")
        if errors:
            print("broker errors:", *errors, sep="\n")
    finally:
        broker.stop()
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", default="1,10,100")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--idle", type=float, default=30.0, help="idle window in seconds")
    parser.add_argument("--upstream-window", type=float, default=20.0)
    parser.add_argument("--no-upstream", action="store_true")
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("azure").setLevel(logging.ERROR)
    logging.getLogger("airflow_shared_stream_provider").setLevel(logging.WARNING)
    asyncio.run(main(parser.parse_args()))
