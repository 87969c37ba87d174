"""
Memory bounded in bytes: a backlog of maximum-size messages, with and without the byte budget.

Usage::

    .venv/bin/python -m bench.memory_budget_bench [--brokers pubsub,servicebus] [--messages 40]
        [--watchers 3] [--budgets 64,off]

For each broker and budget the parent publishes a backlog of ``--messages`` maximum-size messages
(Pub/Sub: 9,999,000-byte bodies on Google's emulator, the 10 MB limit less the request's own
bytes; Service Bus: 4 MiB less 16 KiB, the largest the in-repo test broker takes by default,
``tests/servicebus_broker``), then starts a **child process** that runs the real
``SharedStreamManager`` through :class:`devkit.runner.RunnerSim` (runner-style: executor hop per
event, persistence confirmed every ``--confirm-interval`` seconds, default 1 s like the triggerer's
supervisor sync, so that a backlog builds up in flight) with ``--watchers`` watchers of one stream, with
``oversize_policy="truncate"`` (the default 64 KiB event cap cannot store such bodies: the events
fire with the body dropped, the broker message is committed). A real triggerer (devkit/airflow_env)
runs the same manager and producer; the child is used instead because what is measured is the
producer's memory, and a triggerer's start-up and DB add minutes per run without changing it.

The child reports its RSS (psutil) after importing everything and before its first receive
("idle"), its peak RSS (``ru_maxrss``), and the peak of the bytes the stream's flow gate counted
in flight; the parent then checks that nothing was lost: every watcher fired once for every
message, and the subscription / queue holds nothing afterwards. ``off`` is a budget of 2**50
bytes: the flow control as it was before the byte budget (messages only).

``--trace-top N`` (a diagnosis, slower): the child also traces Python allocations
(``tracemalloc``, ``--trace-frames`` frames each) from the moment the stream opens, snapshots the
heap each time the traced size reaches a new high (by 4 MiB or more), and prints the N places that
grew the most between the open stream and that peak: which Python lines hold the memory beyond the
messages in flight, as opposed to what grows below Python (the SDK's C buffers, the allocator).
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

from devkit.scratch import throwaway_dir

os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-bench-")
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0")

ROOT = Path(__file__).resolve().parent.parent
CONN_ID = "memory_budget_bench"
MiB = 1024 * 1024
OFF = 2**50
PUBSUB_BODY = 9_999_000
SERVICEBUS_BODY = 4 * MiB - 16 * 1024


def body(i: int, size: int) -> bytes:
    return f"{i:08d}".encode().ljust(size, b"x")


# -- the child: the manager, its watchers and the producer ---------------------------------------
async def child(args: argparse.Namespace) -> dict[str, Any]:
    import psutil
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider._core.flow import gates
    from airflow_shared_stream_provider._core.producer import SharedStreamProducerBase
    from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
    from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
    from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
    from devkit.runner import RunnerSim, wait_until

    options: dict[str, Any] = {"max_in_flight_bytes": args.budget, "oversize_policy": "truncate"}
    triggers: list[SharedStreamTrigger] = []
    for _ in range(args.watchers):
        if args.child == "pubsub":
            triggers.append(PubSubSharedStreamTrigger(subscription=args.entity, pull_timeout=1.0, **options))
        else:
            if args.prefetch is not None:
                options["prefetch_count"] = args.prefetch
            triggers.append(
                ServiceBusSharedStreamTrigger(queue_name=args.entity, azure_service_bus_conn_id=CONN_ID, **options)
            )
    key = triggers[0].shared_stream_key()
    process = psutil.Process()
    idle_rss = process.memory_info().rss
    # "Idle" as a triggerer running this stream is idle: its SDK imported, the client connected,
    # the subscription / queue checked, nothing received yet. The base calls cohort_ready() right
    # after the broker connection is made and before the first receive.
    open_rss: list[int] = []
    original_cohort_ready = SharedStreamProducerBase.cohort_ready

    traced = TracedPeak(args.trace_frames) if args.trace_top else None

    async def cohort_ready(self: Any) -> None:
        if not open_rss:
            open_rss.append(process.memory_info().rss)
            if traced is not None:
                traced.open()
        await original_cohort_ready(self)

    SharedStreamProducerBase.cohort_ready = cohort_ready  # type: ignore[method-assign]
    peak_held = 0
    peak_sampled = 0

    async def sample() -> None:
        nonlocal peak_held, peak_sampled
        while True:
            gate = gates.peek(key)
            if gate is not None:
                peak_held = max(peak_held, gate.held_bytes)
            peak_sampled = max(peak_sampled, process.memory_info().rss)
            if traced is not None:
                traced.sample()
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    start = time.monotonic()
    async with RunnerSim(
        SharedStreamManager(ack_timeout=600), executor_hop=True, confirm_interval=args.confirm_interval
    ) as runner:
        for i, trigger in enumerate(triggers):
            runner.add(i, trigger)
        await wait_until(
            lambda: bool(runner.failures) or all(runner.count(i) >= args.messages for i in range(args.watchers)),
            timeout=900,
            interval=0.05,
            what="every watcher fired for every message",
        )
        seconds = time.monotonic() - start
        fired = {i: sorted(set(runner.message_ids(i))) for i in range(args.watchers)}
        counts = {i: runner.count(i) for i in range(args.watchers)}
        failures = {i: repr(exc) for i, exc in runner.failures.items()}
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    return {
        "idle_rss": idle_rss,
        "open_rss": open_rss[0] if open_rss else idle_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_sampled": peak_sampled,
        "peak_held": peak_held,
        "seconds": seconds,
        "fired": fired,
        "counts": counts,
        "failures": failures,
        "trace_top": traced.top(args.trace_top) if traced is not None else [],
    }


class TracedPeak:
    """The Python heap at the open stream and at its traced peak (``--trace-top``)."""

    STEP = 4 * MiB  # a snapshot takes a second or so with Airflow loaded: one per new 4 MiB high

    def __init__(self, frames: int) -> None:
        tracemalloc.start(frames)
        self.base: tracemalloc.Snapshot | None = None
        self.peak: tracemalloc.Snapshot | None = None
        self.peak_traced = 0
        self.base_traced = 0

    def open(self) -> None:
        self.base = tracemalloc.take_snapshot()
        self.base_traced = self.peak_traced = tracemalloc.get_traced_memory()[0]

    def sample(self) -> None:
        if self.base is None:
            return
        current = tracemalloc.get_traced_memory()[0]
        if current >= self.peak_traced + self.STEP:
            self.peak = tracemalloc.take_snapshot()
            self.peak_traced = current

    def top(self, count: int) -> list[str]:
        if self.base is None or self.peak is None:
            return ["no traced peak (the stream never grew by 4 MiB of Python objects)"]
        lines = [f"traced Python heap: +{(self.peak_traced - self.base_traced) / MiB:.1f} MiB at its peak"]
        for stat in self.peak.compare_to(self.base, "traceback")[:count]:
            lines.append(f"{stat.size_diff / MiB:+8.1f} MiB {stat.count_diff:+7d} blocks")
            lines += [f"    {line}" for line in stat.traceback.format(most_recent_first=True)]
        return lines


def run_child(broker: str, entity: str, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.memory_budget_bench", "--child", broker, "--entity", entity]
    argv += ["--budget", str(budget), "--messages", str(args.messages), "--watchers", str(args.watchers)]
    argv += ["--confirm-interval", str(args.confirm_interval)]
    if args.prefetch is not None:
        argv += ["--prefetch", str(args.prefetch)]
    if args.trace_top:
        argv += ["--trace-top", str(args.trace_top), "--trace-frames", str(args.trace_frames)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for line in result.get("trace_top", []):
        print(line, flush=True)
    return result


def check(result: dict[str, Any], expected: set[str], left: int, args: argparse.Namespace) -> str:
    """Nothing lost: every watcher fired once per message, nothing left on the broker."""
    problems = []
    if result["failures"]:
        problems.append(f"watcher failures {result['failures']}")
    for watcher, ids in result["fired"].items():
        if set(ids) != expected:
            problems.append(f"watcher {watcher} fired for {len(ids)}/{len(expected)} messages")
        if result["counts"][watcher] != args.messages:
            problems.append(f"watcher {watcher} fired {result['counts'][watcher]} events")
    if left:
        problems.append(f"{left} message(s) left on the broker")
    return "; ".join(problems) or "none lost"


# -- Pub/Sub -------------------------------------------------------------------------------------
def pubsub_backlog(kit: Any, count: int) -> tuple[Any, set[str]]:
    """A new topic and subscription (with the kit's probe, for what is left) and ``count`` messages, one per request."""
    stream = kit.stream(f"mem-{uuid.uuid4().hex[:8]}", ack_deadline=60)
    ids: set[str] = set()
    for i in range(count):
        ids.update(stream.publish_bytes([body(i, PUBSUB_BODY)]))
    return stream, ids


async def pubsub_rows(args: argparse.Namespace, budgets: list[int]) -> list[dict[str, Any]]:
    from devkit.kits.pubsub import PubSubKit

    rows = []
    # The emulator PUBSUB_EMULATOR_HOST names, else one of the kit's own (it sets the variable,
    # which the child inherits).
    with PubSubKit(own=False) as kit:
        for budget in budgets:
            # Publishing returns the server's ids; the envelope's message_id is the same id.
            stream, expected = pubsub_backlog(kit, args.messages)
            try:
                result = run_child("pubsub", stream.subscription, budget, args)
                left = len(stream.unacked_ids())
                rows.append(row("pubsub", PUBSUB_BODY, budget, result, check(result, expected, left, args), args))
            finally:
                stream.delete()
                stream.close()
    return rows


# -- Service Bus ---------------------------------------------------------------------------------
async def servicebus_publish(connection_string: str, queue: str, count: int) -> None:
    """One message per send (a batch is capped at 1 MiB; these are 4 MiB), ``message_id`` m-<i>."""
    from azure.servicebus import ServiceBusMessage
    from azure.servicebus.aio import ServiceBusClient

    async with (
        ServiceBusClient.from_connection_string(connection_string) as client,
        client.get_queue_sender(queue) as sender,
    ):
        for i in range(count):
            await sender.send_messages(ServiceBusMessage(body(i, SERVICEBUS_BODY), message_id=f"m-{i}"))


async def servicebus_rows(args: argparse.Namespace, budgets: list[int]) -> list[dict[str, Any]]:
    from devkit.kits.servicebus import ServiceBusKit

    rows = []
    # The test broker in a child process: its memory and CPU stay out of the parent's.
    with ServiceBusKit(in_subprocess=True) as kit:
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(kit.connection())
        for budget in budgets:
            stream = kit.stream(f"mem-{uuid.uuid4().hex[:6]}", lock_duration=120.0)
            await servicebus_publish(kit.connection_string, stream.queue, args.messages)
            result = run_child("servicebus", stream.queue, budget, args)
            expected = {f"m-{i}" for i in range(args.messages)}
            rows.append(
                row(
                    "servicebus", SERVICEBUS_BODY, budget, result, check(result, expected, stream.backlog(), args), args
                )
            )
    return rows


# -- report --------------------------------------------------------------------------------------
def row(
    broker: str, size: int, budget: int, result: dict[str, Any], lost: str, args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "broker": broker,
        "message_mb": size / 1e6,
        "backlog_mb": size * args.messages / 1e6,
        "budget": ("off" if budget == OFF else f"{budget // MiB} MiB")
        + (f", prefetch {args.prefetch}" if broker == "servicebus" and args.prefetch is not None else ""),
        "idle_rss_mb": result["idle_rss"] / MiB,
        "open_rss_mb": result["open_rss"] / MiB,
        "peak_rss_mb": result["peak_rss"] / MiB,
        "growth_mb": (result["peak_rss"] - result["open_rss"]) / MiB,
        "peak_held_mb": result["peak_held"] / MiB,
        "seconds": result["seconds"],
        "lost": lost,
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| broker | message | backlog | budget | RSS at start | RSS stream open | peak RSS | growth"
        " | peak held | time | lost |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['broker']} | {r['message_mb']:.1f} MB | {r['backlog_mb']:.0f} MB | {r['budget']} "
            f"| {r['idle_rss_mb']:.0f} MiB | {r['open_rss_mb']:.0f} MiB | {r['peak_rss_mb']:.0f} MiB "
            f"| {r['growth_mb']:.0f} MiB "
            f"| {r['peak_held_mb']:.0f} MiB | {r['seconds']:.1f} s | {r['lost']} |"
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    budgets = [OFF if b == "off" else int(b) * MiB for b in args.budgets.split(",")]
    rows: list[dict[str, Any]] = []
    for broker in args.brokers.split(","):
        if broker == "pubsub":
            rows += await pubsub_rows(args, budgets)
        elif broker == "servicebus":
            rows += await servicebus_rows(args, budgets)
        else:
            raise SystemExit(f"unknown broker {broker!r}")
        print(table(rows), flush=True)
    print(json.dumps(rows, indent=1))


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="pubsub,servicebus")
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--watchers", type=int, default=3)
    parser.add_argument("--budgets", default="64,off", help="MiB per stream, comma-separated; off = no byte budget")
    parser.add_argument(
        "--confirm-interval",
        type=float,
        default=1.0,
        help="seconds between persistence rounds (the triggerer's supervisor syncs about every second)",
    )
    parser.add_argument("--prefetch", type=int, help="Service Bus prefetch_count (default: the trigger's, 100)")
    parser.add_argument("--trace-top", type=int, default=0, help="print the N Python places that grew most")
    parser.add_argument("--trace-frames", type=int, default=4, help="frames per traced allocation (--trace-top)")
    parser.add_argument("--child", choices=("pubsub", "servicebus"), help=argparse.SUPPRESS)
    parser.add_argument("--entity", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
