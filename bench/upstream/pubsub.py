"""
Pub/Sub upstream: N independent watchers in upstream ``PubsubPullTrigger``'s pattern as an
AssetWatcher user runs it (``max_messages=1``, ack before the event is persisted, a new client per
trigger run, the trigger re-run after every event, a 10 s poke interval when the pull is empty).
apache-airflow-providers-google itself is not installed (115 packages, downgrades two of ours), so
its loop is reproduced here; pull and acknowledge RPCs are counted as it makes them.

:func:`kill_check` (``stream_bench --kill``) kills -9 a child process consuming a backlog (ours,
then the upstream pattern) and counts messages neither persisted nor left on the subscription.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any

from bench.common import cpu_seconds
from bench.upstream import Drained, cancel_all, new_stream, until

if TYPE_CHECKING:
    from bench.triggerer_bench import BenchBroker, BenchStream

LABEL = "upstream PubsubPullTrigger pattern"
POKE_INTERVAL = 10.0  # PubsubPullTrigger's default poke_interval


async def watcher(subscription: str, persisted: list[str], stop: asyncio.Event, rpcs: list[int]) -> None:
    """PubsubPullTrigger as an AssetWatcher runs it: one event per trigger run, ack before persisting."""
    from google.pubsub_v1 import SubscriberAsyncClient

    loop = asyncio.get_running_loop()
    while not stop.is_set():
        client = SubscriberAsyncClient()  # the hook (and its client) is per trigger instance
        try:
            while not stop.is_set():
                rpcs[0] += 1
                response = await client.pull(
                    request={"subscription": subscription, "max_messages": 1, "return_immediately": True}
                )
                if response.received_messages:
                    rpcs[0] += 1
                    ack_ids = [m.ack_id for m in response.received_messages]
                    await client.acknowledge(request={"subscription": subscription, "ack_ids": ack_ids})
                    await loop.run_in_executor(None, lambda: None)  # the runner's log.ainfo hop
                    persisted.extend(m.message.message_id for m in response.received_messages)
                    break  # the trigger returns after one event; the triggerer runs a new one
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=POKE_INTERVAL)
        finally:
            await client.transport.close()


async def drain(stream: BenchStream, n: int, messages: int, timeout: float, variant: str = "") -> Drained:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    persisted: list[list[str]] = [[] for _ in range(n)]
    rpcs = [0]
    stop = asyncio.Event()
    subscription = stream.kit_stream.source
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    tasks = [asyncio.create_task(watcher(subscription, persisted[i], stop, rpcs)) for i in range(n)]
    await until(lambda: sum(map(len, persisted)) >= messages, timeout)
    seconds, cpu, calls = time.perf_counter() - t0, cpu_seconds() - cpu0, rpcs[0]
    stop.set()
    await cancel_all(tasks)
    received = sum(map(len, persisted))
    seen = statistics.mean(len(p) for p in persisted) / max(1, received)
    return Drained(LABEL, received, seconds, cpu, seen, calls, "" if received >= messages else "timed out")


async def idle_calls(stream: BenchStream, n: int, seconds: float) -> float:
    """Pull RPCs per minute on an empty subscription."""
    rpcs = [0]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watcher(stream.kit_stream.source, [], stop, rpcs)) for _ in range(n)]
    await asyncio.sleep(seconds)
    calls = rpcs[0]
    stop.set()
    await cancel_all(tasks)
    return calls * 60.0 / seconds


# -- kill -9 ---------------------------------------------------------------------------------------
def kill_child(mode: str, subscription: str, conn_id: str, out_path: str) -> None:
    """Child process: consume ``subscription`` and append each persisted message id to ``out_path``."""
    from airflow.triggers.base import TriggerEvent
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
    from devkit.runner import RunnerSim

    async def main() -> None:
        with open(out_path, "a", encoding="utf-8") as out:  # noqa: ASYNC230 - child process only

            def on_persist(trigger_id: int, event: TriggerEvent) -> None:
                out.write(event.payload["message_id"] + "\n")
                out.flush()

            if mode == "ours":
                async with RunnerSim(SharedStreamManager(), confirm_interval=0.05, on_persist=on_persist) as runner:
                    runner.add(0, PubSubSharedStreamTrigger(subscription=subscription, gcp_conn_id=conn_id))
                    await asyncio.Event().wait()
                return
            pending: list[str] = []

            async def persist_loop() -> None:
                while True:  # the supervisor persists queued events every 50 ms
                    await asyncio.sleep(0.05)
                    batch, pending[:] = list(pending), []
                    out.writelines(message_id + "\n" for message_id in batch)
                    out.flush()

            persister = asyncio.create_task(persist_loop())
            await watcher(subscription, pending, asyncio.Event(), [0])
            persister.cancel()

    asyncio.run(main())


async def kill_check(broker: BenchBroker, messages: int, kills: int) -> dict[str, Any]:
    """``{mode: [messages lost per kill]}``: lost = published, not persisted, not on the subscription."""
    from bench.triggerer_bench import message_body

    losses: dict[str, list[int]] = {"ours": [], "upstream": []}
    for mode, lost in losses.items():
        for _ in range(kills):
            stream = await new_stream(broker, f"kill-{uuid.uuid4().hex[:8]}", settle=True)
            kit_stream: Any = stream.kit_stream
            bodies = [message_body(i, "backlog", stamp=False) for i in range(messages)]
            ids = set(await asyncio.to_thread(kit_stream.publish_bytes, bodies))
            out_path = tempfile.mkstemp(prefix="pubsub-kill-")[1]
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, "--child", mode, kit_stream.source, stream.conn_id, out_path
            )
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # kill while the backlog is being consumed
                await asyncio.sleep(0.2)
                with open(out_path, encoding="utf-8") as f:  # noqa: ASYNC230 - tiny local file
                    if sum(1 for _ in f) >= messages // 3:
                        break
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            with open(out_path, encoding="utf-8") as f:  # noqa: ASYNC230 - tiny local file
                persisted = {line.strip() for line in f if line.strip()}
            os.unlink(out_path)
            # Every message must be persisted or still on the subscription (to be redelivered).
            lost.append(len(ids - persisted - await asyncio.to_thread(kit_stream.unacked_ids)))
            await asyncio.to_thread(kit_stream.delete)
    return losses


if __name__ == "__main__":
    import bench.common  # noqa: F401  (a throwaway AIRFLOW_HOME before Airflow is imported)

    parser = argparse.ArgumentParser(description="the --kill child of bench.stream_bench (Pub/Sub)")
    parser.add_argument("--child", nargs=4, required=True, metavar=("MODE", "SUBSCRIPTION", "CONN_ID", "OUT"))
    kill_child(*parser.parse_args().child)
