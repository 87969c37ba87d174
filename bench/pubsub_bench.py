"""
Pub/Sub shared stream vs upstream-style pull watchers vs the framework ceiling, on the emulator.

Usage::

    .venv/bin/python -m bench.pubsub_bench [--messages 5000] [--watchers 1,10,100] [--hop] [--kill]

Starts Google's Pub/Sub emulator (or uses ``PUBSUB_EMULATOR_HOST``). For each N it measures, in
one process and one run:

* **ours**: N ``PubSubSharedStreamTrigger`` watchers on one subscription through the real
  ``SharedStreamManager`` (runner-style: bind after each event, persistence confirmed every 50 ms),
  from subscribe until every watcher persisted every message and the subscription has nothing
  unacked;
* **upstream**: N independent watchers in upstream ``PubsubPullTrigger``'s pattern as an
  AssetWatcher user runs it (``max_messages=1``, ack before the event is persisted, a new client
  per trigger run, the trigger re-run after every event); apache-airflow-providers-google itself
  is not installed (115 packages, downgrades two of ours), so its loop is reproduced here;
* **ceiling**: the same N watchers on ``devkit.memory``'s in-memory producer (pre-built messages).

Reported: msgs/s (messages fully handled per second), events/s (events persisted per second over
all watchers), share of messages each watcher saw, p50/p95 publish-to-event latency (live
stream, 20 msgs/s), pull/ack/modify RPCs per minute busy and idle. ``--kill`` also kills -9 a child
process consuming a backlog (ours, then upstream) and counts messages neither persisted nor left
on the subscription.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Hashable, Sequence
from typing import Any

from devkit.scratch import throwaway_dir

os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-bench-")
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

from airflow.triggers.base import TriggerEvent
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider.producers.pubsub import PubSubSharedStreamProducer
from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
from devkit.memory import MemorySharedStreamTrigger, memory_broker
from devkit.runner import RunnerSim, wait_until

PROJECT = "bench-project"
PRODUCERS: list[CountingProducer] = []


class CountingProducer(PubSubSharedStreamProducer):
    """The real producer, registered so the bench can read its RPC counts."""

    def __init__(self, settings: Any, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        PRODUCERS.append(self)

    def rpcs(self) -> int:
        return self.pull_calls + self.ack_calls + self.modify_calls + self.publish_calls


class BenchTrigger(PubSubSharedStreamTrigger):
    # __name__ works both imported and run with -m (then the manager imports it from __main__).
    producer_class_path = f"{__name__}.CountingProducer"


def body(i: int) -> bytes:
    return json.dumps({"order_id": i, "region": ("eu", "us", "apac")[i % 3], "amount": i * 1.5}).encode()


class Emulator:
    def __init__(self) -> None:
        self.handle: Any = None

    def __enter__(self) -> str:
        host = os.environ.get("PUBSUB_EMULATOR_HOST")
        if not host:
            from devkit.brokers import start_pubsub_emulator

            self.handle = start_pubsub_emulator()
            host = self.handle.address
            os.environ["PUBSUB_EMULATOR_HOST"] = host
        return host

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.stop()
            os.environ.pop("PUBSUB_EMULATOR_HOST", None)


class Stream:
    """A topic + subscription (+ probe subscription for counting unacked messages)."""

    def __init__(self) -> None:
        from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient

        suffix = uuid.uuid4().hex[:10]
        self.topic = f"projects/{PROJECT}/topics/bt-{suffix}"
        self.subscription = f"projects/{PROJECT}/subscriptions/bs-{suffix}"
        self.probe = f"projects/{PROJECT}/subscriptions/bp-{suffix}"
        self.pub = PublisherAsyncClient()
        self.sub = SubscriberAsyncClient()
        self.snapshots = 0

    async def create(self) -> Stream:
        await self.pub.create_topic(request={"name": self.topic})
        for name in (self.subscription, self.probe):
            await self.sub.create_subscription(request={"name": name, "topic": self.topic, "ack_deadline_seconds": 60})
        return self

    async def publish(self, bodies: Sequence[bytes]) -> list[str]:
        ids: list[str] = []
        for start in range(0, len(bodies), 1000):
            chunk = [{"data": b} for b in bodies[start : start + 1000]]
            response = await self.pub.publish(request={"topic": self.topic, "messages": chunk}, timeout=60)
            ids.extend(response.message_ids)
        return ids

    async def unacked(self) -> int:
        return len(await self.unacked_ids())

    async def unacked_ids(self) -> set[str]:
        from google.api_core import exceptions as gexc

        self.snapshots += 1
        snap = f"projects/{PROJECT}/snapshots/{self.subscription.rsplit('/', 1)[1]}-{self.snapshots}"
        await self.sub.create_snapshot(request={"name": snap, "subscription": self.subscription})
        await self.sub.seek(request={"subscription": self.probe, "snapshot": snap})
        await self.sub.delete_snapshot(request={"snapshot": snap})
        ids: set[str] = set()
        while True:
            try:
                response = await self.sub.pull(
                    request={"subscription": self.probe, "max_messages": 1000}, timeout=0.5, retry=None
                )
            except gexc.DeadlineExceeded:
                break
            if not response.received_messages:
                break
            ids.update(r.message.message_id for r in response.received_messages)
        return ids

    async def close(self) -> None:
        for name in (self.subscription, self.probe):
            await self.sub.delete_subscription(request={"subscription": name})
        await self.pub.delete_topic(request={"topic": self.topic})
        await self.pub.transport.close()
        await self.sub.transport.close()


async def wait_unacked_zero(stream: Stream, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await stream.unacked():
        if time.monotonic() > deadline:
            raise TimeoutError("subscription never settled")
        await asyncio.sleep(0.05)


# -- ours -------------------------------------------------------------------------------------------


async def run_ours(n: int, messages: int, hop: bool) -> dict[str, Any]:
    stream = await Stream().create()
    try:
        await stream.publish([body(i) for i in range(messages)])
        PRODUCERS.clear()
        cpu0 = time.process_time()
        start = time.perf_counter()
        async with RunnerSim(SharedStreamManager(ack_timeout=300), executor_hop=hop, confirm_interval=0.05) as runner:
            for i in range(n):
                runner.add(i, BenchTrigger(subscription=stream.subscription, pull_timeout=1.0))
            await wait_until(
                lambda: all(runner.count(i) >= messages for i in range(n)), timeout=900, interval=0.05, what="all"
            )
            producer = PRODUCERS[-1]
            await producer.flush()
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu0
            busy_rpcs = producer.rpcs()
            seen = min(runner.count(i) for i in range(n)) / messages
            await wait_unacked_zero(stream, 60)
            assert not runner.failures, runner.failures
            # Idle: RPCs in 15 s with nothing to read.
            idle0 = producer.rpcs()
            await asyncio.sleep(15)
            idle_rpcs = (producer.rpcs() - idle0) * 4
            # Latency on a live stream: 20 msgs/s for 5 s.
            latencies = await live_latency(stream, runner, n)
        return {
            "msgs_s": messages / elapsed,
            "events_s": messages * n / elapsed,
            "seen": seen,
            "cpu_s": cpu,
            "busy_rpm": busy_rpcs / elapsed * 60,
            "rpc_per_msg": busy_rpcs / messages,
            "idle_rpm": idle_rpcs,
            "p50_ms": statistics.median(latencies) * 1000,
            "p95_ms": statistics.quantiles(latencies, n=20)[-1] * 1000,
        }
    finally:
        await stream.close()


async def live_latency(stream: Stream, runner: RunnerSim, n: int) -> list[float]:
    sent: dict[str, float] = {}
    got: dict[str, float] = {}

    def on_persist(trigger_id: int, event: TriggerEvent) -> None:
        message_id = event.payload["message_id"]
        if message_id in sent:
            got.setdefault(message_id, time.perf_counter())

    runner.on_persist = on_persist
    runner.confirm_interval = 0.01
    for i in range(100):
        t = time.perf_counter()
        (message_id,) = await stream.publish([body(i)])
        sent[message_id] = t
        await asyncio.sleep(0.05)
    await wait_until(lambda: len(got) >= len(sent), timeout=60, what="live events")
    return [got[m] - sent[m] for m in sent]


# -- upstream pattern ---------------------------------------------------------------------------------


async def upstream_watcher(
    subscription: str, persisted: list[str], stop: asyncio.Event, counter: list[int], hop: bool, poke: float
) -> None:
    """PubsubPullTrigger as an AssetWatcher runs it: one event per trigger run, ack before persisting."""
    from google.pubsub_v1 import SubscriberAsyncClient

    loop = asyncio.get_running_loop()
    while not stop.is_set():
        client = SubscriberAsyncClient()  # the hook (and its client) is per trigger instance
        try:
            while not stop.is_set():
                counter[0] += 1
                response = await client.pull(
                    request={"subscription": subscription, "max_messages": 1, "return_immediately": True}
                )
                if response.received_messages:
                    counter[0] += 1
                    await client.acknowledge(
                        request={
                            "subscription": subscription,
                            "ack_ids": [m.ack_id for m in response.received_messages],
                        }
                    )
                    if hop:
                        await loop.run_in_executor(None, lambda: None)
                    persisted.extend(m.message.message_id for m in response.received_messages)
                    break  # the trigger returns after one event; the triggerer runs a new one
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=poke)
        finally:
            await client.transport.close()


async def run_upstream(n: int, messages: int, hop: bool) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    stream = await Stream().create()
    try:
        await stream.publish([body(i) for i in range(messages)])
        persisted: list[list[str]] = [[] for _ in range(n)]
        counter = [0]
        stop = asyncio.Event()
        cpu0 = time.process_time()
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(upstream_watcher(stream.subscription, persisted[i], stop, counter, hop, 10.0))
            for i in range(n)
        ]
        await wait_until(lambda: sum(map(len, persisted)) >= messages, timeout=900, interval=0.05, what="upstream")
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        busy = counter[0]
        idle0 = counter[0]
        await asyncio.sleep(15)
        idle = (counter[0] - idle0) * 4
        stop.set()
        await asyncio.gather(*tasks)
        return {
            "msgs_s": messages / elapsed,
            "events_s": messages / elapsed,
            "seen": statistics.mean(len(p) for p in persisted) / messages,
            "cpu_s": cpu,
            "busy_rpm": busy / elapsed * 60,
            "rpc_per_msg": busy / messages,
            "idle_rpm": idle,
        }
    finally:
        await stream.close()


# -- framework ceiling ----------------------------------------------------------------------------------


async def run_ceiling(n: int, messages: int, hop: bool) -> dict[str, Any]:
    name = f"ceiling-{uuid.uuid4().hex[:8]}"
    broker = memory_broker(name)
    for i in range(messages):
        broker.publish(body(i))
    start = time.perf_counter()
    async with RunnerSim(SharedStreamManager(ack_timeout=300), executor_hop=hop, confirm_interval=0.05) as runner:
        for i in range(n):
            runner.add(i, MemorySharedStreamTrigger(broker_name=name))
        await wait_until(lambda: len(broker.committed) >= messages, timeout=900, interval=0.05, what="ceiling")
        elapsed = time.perf_counter() - start
    return {"msgs_s": messages / elapsed, "events_s": messages * n / elapsed}


# -- kill -9 ---------------------------------------------------------------------------------------------


def kill_child(mode: str, subscription: str, out_path: str) -> None:
    """Child process: consume ``subscription`` and append each persisted message id to ``out_path``."""

    async def main() -> None:
        with open(out_path, "a", encoding="utf-8") as out:  # noqa: ASYNC230 - child process only

            def on_persist(trigger_id: int, event: TriggerEvent) -> None:
                out.write(event.payload["message_id"] + "\n")
                out.flush()

            if mode == "ours":
                async with RunnerSim(SharedStreamManager(), confirm_interval=0.05, on_persist=on_persist) as runner:
                    runner.add(0, PubSubSharedStreamTrigger(subscription=subscription))
                    await asyncio.Event().wait()
            else:
                pending: list[str] = []
                stop = asyncio.Event()

                async def persist_loop() -> None:
                    while True:  # the supervisor persists queued events every 50 ms
                        await asyncio.sleep(0.05)
                        batch, pending[:] = list(pending), []
                        for message_id in batch:
                            out.write(message_id + "\n")
                        out.flush()

                persister = asyncio.create_task(persist_loop())
                await upstream_watcher(subscription, pending, stop, [0], True, 10.0)
                persister.cancel()

    asyncio.run(main())


async def run_kill(mode: str, messages: int, kills: int) -> list[int]:
    losses: list[int] = []
    for _ in range(kills):
        stream = await Stream().create()
        ids = set(await stream.publish([body(i) for i in range(messages)]))
        out_path = tempfile.mkstemp(prefix="pubsub-kill-")[1]
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.pubsub_bench", "--child", mode, stream.subscription, out_path
        )
        # Kill while the backlog is being consumed.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            with open(out_path, encoding="utf-8") as f:  # noqa: ASYNC230 - tiny local file
                if sum(1 for _ in f) >= messages // 3:
                    break
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        with open(out_path, encoding="utf-8") as f:  # noqa: ASYNC230 - tiny local file
            persisted = {line.strip() for line in f if line.strip()}
        os.unlink(out_path)
        unacked = await stream.unacked_ids()
        # Every message must be persisted or still on the subscription (to be redelivered).
        losses.append(len(ids - persisted - unacked))
        await stream.close()
    return losses


# -- main -------------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


async def bench(args: argparse.Namespace) -> None:
    watchers = [int(x) for x in args.watchers.split(",")]
    rows = []
    for n in watchers:
        # Ceiling right before ours, so both see the same machine (the emulator's JVM shares the
        # 2 cores and keeps working after a run); the upstream run, which loads it most, goes last.
        ceiling = await run_ceiling(n, args.messages, args.hop)
        ours = await run_ours(n, args.messages, args.hop)
        upstream_messages = min(args.messages, args.upstream_messages)
        upstream = await run_upstream(n, upstream_messages, args.hop)
        rows.append((n, ours, upstream, ceiling))
        print(f"N={n}: ours={ours}\n      upstream={upstream}\n      ceiling={ceiling}", flush=True)
    print()
    print(
        "| N | ours msgs/s | ours events/s | ceiling msgs/s | ours/ceiling | upstream msgs/s | ours/upstream "
        "| seen per watcher (ours / upstream) | p50 / p95 latency ms | RPC/min busy (ours / upstream) "
        "| RPC/msg (ours / upstream) | RPC/min idle (ours / upstream) | CPU s (ours / upstream) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, ours, upstream, ceiling in rows:
        print(
            f"| {n} | {fmt(ours['msgs_s'])} | {fmt(ours['events_s'])} | {fmt(ceiling['msgs_s'])} "
            f"| {ours['msgs_s'] / ceiling['msgs_s']:.0%} | {fmt(upstream['msgs_s'])} "
            f"| {ours['msgs_s'] / upstream['msgs_s']:.1f}x | {ours['seen']:.0%} / {upstream['seen']:.0%} "
            f"| {fmt(ours['p50_ms'])} / {fmt(ours['p95_ms'])} | {fmt(ours['busy_rpm'])} / {fmt(upstream['busy_rpm'])} "
            f"| {ours['rpc_per_msg']:.3f} / {upstream['rpc_per_msg']:.2f} "
            f"| {fmt(ours['idle_rpm'])} / {fmt(upstream['idle_rpm'])} "
            f"| {ours['cpu_s']:.1f} / {upstream['cpu_s']:.1f} |"
        )
    if args.kill:
        for mode in ("ours", "upstream"):
            losses = await run_kill(mode, args.kill_messages, args.kills)
            print(f"kill -9 ({mode}, {args.kill_messages} msgs backlog): lost per kill = {losses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--upstream-messages", type=int, default=2000, help="backlog for the (slow) upstream run")
    parser.add_argument("--watchers", default="1,10,100")
    parser.add_argument("--hop", action="store_true", help="reproduce the runner's per-event executor hop")
    parser.add_argument("--kill", action="store_true", help="also run the kill -9 loss check")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kill-messages", type=int, default=2000)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kill_child(*args.child)
        return
    with Emulator():
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
