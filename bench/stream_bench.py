"""
One simulated-runner benchmark over the broker registry: N watchers on one stream, per broker.

Not a test. From the repository root::

    .venv/bin/python -m bench.stream_bench                                   # every broker, N = 1, 10, 100
    .venv/bin/python -m bench.stream_bench --brokers sqs,redis --ns 1,10 --messages 2000 --idle 15
    .venv/bin/python -m bench.stream_bench --brokers pubsub --impls ours,upstream --kill

For each registry broker with a bench harness (``harness.bench``: ``bench/triggerer_bench.py``'s
``BenchBroker`` over the broker's test kit, ``devkit/kits/<broker>.py``) it starts the kit's local
broker, or reaches the real one the kit's environment variable names (``KAFKA_BOOTSTRAP_SERVERS``,
``SQS_ENDPOINT_URL``, ``PUBSUB_EMULATOR_HOST``, ``SERVICEBUS_CONNECTION_STRING``, ``REDIS_URL``); a
broker that cannot start here is reported as skipped. Every broker runs outside this process
(Tansu, a ``moto_server`` process, the emulator's JVM, the test broker in a child process,
``redis-server``), so CPU and RSS are the client side's alone. Each case gets a fresh stream.

Implementations (``--impls``):

* **ours**: the registry's trigger x N through the real ``SharedStreamManager`` driven like the
  triggerer (``devkit.runner.RunnerSim``: per-event executor hop, persistence confirmed every
  50 ms, events counted rather than kept). Backlog of ``--messages`` published through the kit
  (``KitStream.publish_bytes``) before the clock starts. The clock runs from subscribe until every
  watcher persisted every message **and** the broker is settled (the kit's ``unsettled() == 0``:
  nothing left uncommitted / undeleted / unacked / uncompleted). Settlement is polled once every
  watcher persisted everything, so the time includes up to one check (``settle_check_s`` in the
  JSON); CPU is the process's over subscribe -> every watcher persisted (the checks' own client
  work excluded).
* **ceiling**: broker-neutral, once per N: the same watchers on ``bench.common``'s
  ``PrebuiltMemoryTrigger`` (envelopes decoded before the clock, no broker): the framework's cost.
* **upstream**: where ``bench/upstream/<broker>.py`` exists, the upstream provider's trigger loop
  as an AssetWatcher user runs it (see that module), on a backlog of at most
  ``--upstream-messages``.

Besides: **latency** (ours): N watchers on an empty stream; once a warm-up message reached every
watcher (connections, group joins and first polls are not latency), ``--latency-messages`` are
published one by one at ``--rate`` per second, each stamped with its send time in the body;
p50 / p95 of persist time - send time over every (watcher, message). **Idle** calls per minute:
the same watchers for ``--idle`` seconds with nothing to read; ours counts the producers' own
``api_calls`` counter (none where the harness' ``counts_api_calls`` is false: Kafka's producer
counts its commits, not aiokafka's background fetches), upstream what its module counts. Where
a producer counts its calls by kind (Pub/Sub: ``pull_calls``, ``ack_calls``, ``modify_calls``,
``publish_calls``), the backlog rows also give them (``calls_by_kind``) and the pulls' mean size.
``--kill`` runs an upstream module's ``kill_check`` (Pub/Sub: kill -9 while consuming).

Writes ``bench/results/stream-<date>[-<label>].json`` and prints markdown tables. The Kafka
matrix with the upstream confluent-kafka trigger stays in ``bench/kafka_bench.py``; the real
triggerer with a metadata DB is ``bench/triggerer_bench.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from types import ModuleType
from typing import Any, Final

from bench.common import (  # first: a throwaway AIRFLOW_HOME before Airflow is imported
    RESULTS_DIR,
    CountingRunner,
    PrebuiltMemoryTrigger,
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
    peak_rss_mb,
    prebuild,
    source_state,
)
from bench.triggerer_bench import BROKER_CLASSES, BenchBroker, BenchStream, message_body
from bench.upstream import Drained, new_stream, until, upstream_available, upstream_module
from devkit.latency import percentile
from devkit.runner import RunnerSim

IMPLS: Final = ("ours", "ceiling", "upstream")
CONFIRM_INTERVAL: Final = 0.05  # seconds between persistence confirmations (RunnerSim)
WARM_UP_TIMEOUT: Final = 120.0  # a first message through every watcher (Kafka group joins included)

# Every producer this process builds (the registry's and the ceiling's), to read its api_calls.
PRODUCERS: list[Any] = []


def _record_producers() -> None:
    """
    Record every ``SharedStreamProducerBase`` built from now on (every broker's producer calls
    its ``__init__``): the idle and backlog call counts read their ``counters.api_calls``.
    """
    from airflow_shared_stream_provider._core.producer import SharedStreamProducerBase

    original = SharedStreamProducerBase.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        PRODUCERS.append(self)

    SharedStreamProducerBase.__init__ = record  # type: ignore[method-assign]


def api_calls(since: int, broker: BenchBroker | None = None) -> int | None:
    """
    Broker calls of the producers built since ``len(PRODUCERS)`` was ``since``; None when the
    broker's producer does not count every call (its harness' ``counts_api_calls``).
    """
    if broker is not None and not broker.counts_api_calls:
        return None
    return sum(producer.counters.api_calls for producer in PRODUCERS[since:])


def calls_by_kind(since: int) -> dict[str, int] | None:
    """
    The ``api_calls`` of the producers built since ``since``, by kind, where a producer counts
    them (Pub/Sub: ``pull_calls``, ``ack_calls``, ``modify_calls``, ``publish_calls``); None elsewhere.
    """
    kinds: dict[str, int] = {}
    for producer in PRODUCERS[since:]:
        for name, value in vars(producer).items():
            if name.endswith("_calls") and isinstance(value, int):
                kinds[name.removesuffix("_calls")] = kinds.get(name.removesuffix("_calls"), 0) + value
    return kinds or None


# -- results -------------------------------------------------------------------------------------
@dataclass
class Row:
    """One backlog drain: ``messages`` handled (persisted by at least one watcher) in ``seconds``."""

    broker: str
    impl: str
    n: int
    messages: int
    seconds: float
    cpu: float
    seen: float  # mean share of the messages one watcher persisted
    calls: int | None
    rss_mb: float  # this process's resident set right after the drain
    persisted_s: float | None = None  # ours: subscribe -> every watcher persisted (before settling)
    settle_check_s: float | None = None  # ours: how long the settle check that answered 0 took
    note: str = ""
    calls_by_kind: dict[str, int] | None = None  # ours, where the producer counts them (calls_by_kind)

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def events_per_s(self) -> float:
        return self.messages * self.seen * self.n / self.seconds if self.seconds else 0.0


@dataclass
class Steady:
    """Ours on a live stream: publish -> persist latency, then idle broker calls per minute."""

    broker: str
    n: int
    latencies_ms: list[float]
    idle_calls_per_min: float | None
    upstream_idle_calls_per_min: float | None = None

    @property
    def p50_ms(self) -> float | None:
        return statistics.median(self.latencies_ms) if self.latencies_ms else None

    @property
    def p95_ms(self) -> float | None:
        return percentile(self.latencies_ms, 0.95)


# -- helpers -------------------------------------------------------------------------------------
def backlog_body(i: int) -> bytes:
    return message_body(i, "backlog", stamp=False)


def warm_up_body(i: int) -> bytes:
    return message_body(i, "warm-up", stamp=False)


def steady_body(i: int) -> bytes:
    """Stamped with ``published_at`` right before its send (``publish_bytes`` takes bodies as they are due)."""
    return message_body(i, "steady", stamp=True)


def case_id(what: str, n: int) -> str:
    return f"{what}-n{n}-{uuid.uuid4().hex[:6]}"


def connect(stream: BenchStream, impl: str) -> None:
    """The stream's Airflow connections as ``AIRFLOW_CONN_*`` and the kit's environment, in this process."""
    for conn_id, connection in stream.connections(impl).items():
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(connection)
    os.environ.update(stream.env())


def ours_triggers(stream: BenchStream, n: int) -> list[Any]:
    """N of the registry's trigger on ``stream`` (its class path and arguments from the bench harness)."""
    path, kwargs = stream.trigger("ours")
    module, _, attribute = path.rpartition(".")
    trigger_class = getattr(importlib.import_module(module), attribute)
    connect(stream, "ours")
    return [trigger_class(**kwargs) for _ in range(n)]


async def settled(stream: BenchStream, timeout: float) -> tuple[float | None, float]:
    """
    ``(perf_counter when the kit last saw the stream settled, that check's seconds)``, polling
    ``unsettled()`` in a thread (the kits' clients are sync); ``(None, ...)`` when it never settled.
    The end of the check is taken: the broker was settled at some point during it.
    """
    deadline = time.monotonic() + timeout
    while True:
        began = time.perf_counter()
        left = await asyncio.to_thread(stream.kit_stream.unsettled)
        ended = time.perf_counter()
        if left == 0:
            return ended, ended - began
        if time.monotonic() > deadline:
            return None, ended - began
        await asyncio.sleep(0.05)


# -- the implementations -------------------------------------------------------------------------
async def ours_backlog(broker: BenchBroker, n: int, args: argparse.Namespace) -> Row:
    from airflow.triggers.shared_stream import SharedStreamManager

    stream = await new_stream(broker, case_id("backlog", n), settle=True)
    messages = args.messages
    await asyncio.to_thread(stream.publish, messages, backlog_body)
    triggers = ours_triggers(stream, n)
    mark = len(PRODUCERS)
    runner = CountingRunner(manager=SharedStreamManager(), executor_hop=True, confirm_interval=CONFIRM_INTERVAL)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    async with runner:
        for i, trigger in enumerate(triggers):
            runner.add(i, trigger)
        done = await until(lambda: all(runner.per_trigger[i] >= messages for i in range(n)), args.timeout)
        persisted_at, cpu = time.perf_counter(), cpu_seconds() - cpu0
        settled_at, check_s = await settled(stream, args.timeout if done else 5.0)
        calls, rss, failures = api_calls(mark, broker), current_rss_mb(), runner.failure_summary()
        kinds = calls_by_kind(mark)
        seen = min(runner.per_trigger[i] for i in range(n)) / messages
    notes = [] if done else ["timed out"]
    if settled_at is None:
        notes.append(f"not settled: {await asyncio.to_thread(stream.kit_stream.diagnostics)}")
    if failures:
        notes.append(f"failed watchers {failures}")
    end = settled_at if settled_at is not None else time.perf_counter()
    return Row(
        broker.name, "ours", n, messages, end - t0, cpu, seen, calls, rss,
        persisted_s=persisted_at - t0, settle_check_s=check_s, note="; ".join(notes), calls_by_kind=kinds,
    )  # fmt: skip


async def ceiling_backlog(n: int, args: argparse.Namespace) -> Row:
    from airflow.triggers.shared_stream import SharedStreamManager

    name = f"ceiling-{uuid.uuid4().hex[:8]}"
    prebuilt = prebuild(name, [backlog_body(i) for i in range(args.messages)], messages=args.messages)
    runner = CountingRunner(manager=SharedStreamManager(), executor_hop=True, confirm_interval=CONFIRM_INTERVAL)
    mark = len(PRODUCERS)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    async with runner:
        for i in range(n):
            runner.add(i, PrebuiltMemoryTrigger(broker_name=name))
        done = await until(
            lambda: prebuilt.settled >= args.messages and all(runner.per_trigger[i] >= args.messages for i in range(n)),
            args.timeout,
        )
        seconds, cpu, rss = time.perf_counter() - t0, cpu_seconds() - cpu0, current_rss_mb()
        seen = min(runner.per_trigger[i] for i in range(n)) / args.messages
    note = "" if done else "timed out"
    return Row("(memory)", "ceiling", n, args.messages, seconds, cpu, seen, api_calls(mark), rss, note=note)


async def upstream_backlog(broker: BenchBroker, module: ModuleType, n: int, args: argparse.Namespace) -> list[Row]:
    rows = []
    messages = min(args.messages, args.upstream_messages)
    for variant in getattr(module, "VARIANTS", ("",)):
        stream = await new_stream(broker, case_id("upstream", n))
        connect(stream, "upstream")
        await asyncio.to_thread(stream.publish, messages, backlog_body)
        drained: Drained = await module.drain(stream, n, messages, args.timeout, variant)
        rows.append(
            Row(broker.name, drained.label, n, drained.messages, drained.seconds, drained.cpu, drained.seen,
                drained.calls, current_rss_mb(), note=drained.note)
        )  # fmt: skip
    return rows


async def ours_steady(broker: BenchBroker, n: int, args: argparse.Namespace) -> Steady:
    """Latency at ``--rate``, then ``--idle`` seconds of nothing to read, on one stream and one set of watchers."""
    from airflow.triggers.shared_stream import SharedStreamManager

    latencies: list[float] = []

    def on_persist(trigger_id: int, event: Any) -> None:
        body = event.payload.get("body")
        if isinstance(body, dict) and body.get("phase") == "steady":
            latencies.append(1000 * (time.time() - float(body["published_at"])))

    stream = await new_stream(broker, case_id("steady", n))
    triggers = ours_triggers(stream, n)
    mark = len(PRODUCERS)
    runner = RunnerSim(
        SharedStreamManager(), executor_hop=True, confirm_interval=CONFIRM_INTERVAL, on_persist=on_persist
    )
    async with runner:
        for i, trigger in enumerate(triggers):
            runner.add(i, trigger)
        await asyncio.to_thread(stream.publish, 1, warm_up_body)
        if not await until(lambda: all(runner.count(i) >= 1 for i in range(n)), WARM_UP_TIMEOUT):
            raise TimeoutError(f"{broker.name} N={n}: the warm-up message did not reach every watcher")
        count = args.latency_messages
        await asyncio.to_thread(stream.publish, count, steady_body, rate=args.rate)
        await until(lambda: len(latencies) >= count * n, 60)
        idle = None
        if args.idle > 0 and broker.counts_api_calls:
            await asyncio.sleep(2.0)  # the last commits / acks are not idle traffic
            calls0 = api_calls(mark) or 0
            await asyncio.sleep(args.idle)
            idle = ((api_calls(mark) or 0) - calls0) * 60.0 / args.idle
    return Steady(broker.name, n, [round(x, 2) for x in latencies], idle)


# -- one broker ----------------------------------------------------------------------------------
async def bench_broker(name: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    broker: BenchBroker = BROKER_CLASSES[name]()
    try:
        described = await asyncio.to_thread(broker.start)
    except Exception as exc:  # a broker this machine cannot run: reported, the others go on
        result["skipped"][name] = f"{type(exc).__name__}: {exc}"
        print(f"# {name}: skipped ({result['skipped'][name]})", flush=True)
        broker.stop()
        return
    print(f"# {name}: {described}", flush=True)
    result["brokers"][name] = described
    try:
        module = upstream_module(name) if "upstream" in args.impls else None
        if module is not None and not upstream_available(module):
            result["skipped"][f"{name} upstream"] = f"{module.LABEL}: its provider is not installed"
            print(f"# {name}: {result['skipped'][f'{name} upstream']}", flush=True)
            module = None
        for n in args.ns:
            if "ours" in args.impls:
                emit(result, await ours_backlog(broker, n, args))
            if module is not None:
                for row in await upstream_backlog(broker, module, n, args):
                    emit(result, row)
        if "ours" in args.impls:
            for n in args.ns:
                steady = await ours_steady(broker, n, args)
                idle_upstream = getattr(module, "idle_calls", None)
                if idle_upstream is not None and args.idle > 0:
                    stream = await new_stream(broker, case_id("idle", n))
                    connect(stream, "upstream")
                    steady.upstream_idle_calls_per_min = await idle_upstream(stream, n, args.idle)
                result["steady"].append(steady)
                print(steady_line(steady), flush=True)
        kill_check = getattr(module, "kill_check", None)
        if args.kill and kill_check is not None:
            result["kill"][name] = await kill_check(broker, args.kill_messages, args.kills)
            print(f"# {name} kill -9, messages lost per kill: {result['kill'][name]}", flush=True)
    except Exception as exc:  # one broker's failure ends its rows, not the run: reported
        result["failed"][name] = f"{type(exc).__name__}: {exc}"
        print(f"# {name}: FAILED ({result['failed'][name]})", flush=True)
    finally:
        await asyncio.to_thread(broker.stop)


def emit(result: dict[str, Any], row: Row) -> None:
    result["rows"].append(row)
    print(backlog_line(row), flush=True)
    if row.calls_by_kind:
        print(f"# {row.broker} {row.impl} N={row.n} calls by kind: {kinds_text(row)}", flush=True)


def kinds_text(row: Row) -> str:
    """``pull 24 (83 msgs each), ack 23, modify 0, publish 0`` (the pulls' size: messages / pull calls)."""
    kinds = row.calls_by_kind or {}
    parts = []
    for kind, count in kinds.items():
        each = f" ({row.messages / count:.0f} msgs each)" if kind == "pull" and count else ""
        parts.append(f"{kind} {count}{each}")
    return ", ".join(parts)


# -- tables --------------------------------------------------------------------------------------
BACKLOG_HEADER: Final = (
    "broker", "impl", "N", "msgs", "msgs/s", "events/s", "each watcher saw",
    "CPU ms/msg", "calls/msg", "RSS MB", "note",
)  # fmt: skip
STEADY_HEADER: Final = ("broker", "N", "msgs", "p50 ms", "p95 ms", "idle calls/min (ours)", "idle calls/min (upstream)")


def backlog_cells(row: Row) -> list[str]:
    calls = "-" if row.calls is None else fmt_num(row.calls / max(1, row.messages), 3)
    return [
        row.broker, row.impl, str(row.n), str(row.messages), fmt_rate(row.msgs_per_s), fmt_rate(row.events_per_s),
        f"{100 * row.seen:.0f}%", fmt_num(1000 * row.cpu / max(1, row.messages)), calls, f"{row.rss_mb:.0f}", row.note,
    ]  # fmt: skip


def steady_cells(steady: Steady) -> list[str]:
    return [
        steady.broker, str(steady.n), str(len(steady.latencies_ms)), fmt_num(steady.p50_ms, 0),
        fmt_num(steady.p95_ms, 0), fmt_num(steady.idle_calls_per_min, 1),
        fmt_num(steady.upstream_idle_calls_per_min, 1),
    ]  # fmt: skip


def backlog_line(row: Row) -> str:
    return "| " + " | ".join(backlog_cells(row)) + " |"


def steady_line(steady: Steady) -> str:
    return "| " + " | ".join(steady_cells(steady)) + " |"


def render(result: dict[str, Any]) -> str:
    parts = [
        f"Backlog ({result['args']['messages']} messages; upstream at most {result['args']['upstream_messages']}):",
        "",
        markdown_table(BACKLOG_HEADER, [backlog_cells(row) for row in result["rows"]]),
    ]
    if result["steady"]:
        parts += [
            "",
            f"Live stream ({result['args']['latency_messages']} messages at {result['args']['rate']}/s, "
            f"publish -> persisted) and idle calls per minute ({result['args']['idle']:.0f} s window):",
            "",
            markdown_table(STEADY_HEADER, [steady_cells(steady) for steady in result["steady"]]),
        ]
    parts += [
        f"calls by kind, {row.broker} {row.impl} N={row.n}: {kinds_text(row)}"
        for row in result["rows"]
        if row.calls_by_kind
    ]
    for what in ("skipped", "failed"):
        parts += [f"{what}: {name}: {reason}" for name, reason in result[what].items()]
    parts += [f"kill -9, {name}: messages lost per kill {losses}" for name, losses in result["kill"].items()]
    return "\n".join(parts)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--brokers", type=comma_words(list(BROKER_CLASSES)), default=list(BROKER_CLASSES))
    parser.add_argument("--ns", type=comma_ints, default=[1, 10, 100])
    parser.add_argument("--impls", type=comma_words(IMPLS), default=list(IMPLS))
    parser.add_argument("--messages", type=int, default=2000, help="backlog per drain")
    parser.add_argument("--upstream-messages", type=int, default=500, help="backlog cap of the upstream drains")
    parser.add_argument("--latency-messages", type=int, default=50)
    parser.add_argument("--rate", type=float, default=10.0, help="messages per second in the latency run")
    parser.add_argument("--idle", type=float, default=30.0, help="idle window, seconds (0: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="cap per drain, seconds")
    parser.add_argument("--kill", action="store_true", help="also run the upstream modules' kill -9 checks")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kill-messages", type=int, default=2000)
    parser.add_argument("--label", default="", help="suffix of the result file's name")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    _record_producers()
    result: dict[str, Any] = {
        "bench": "stream_bench",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.stream_bench", *sys.argv[1:]]),
        "args": vars(args),
        "machine": machine_info(),
        "source": source_state("airflow_shared_stream_provider", "devkit", "bench"),
        "brokers": {},
        "skipped": {},
        "failed": {},
        "rows": [],
        "steady": [],
        "kill": {},
    }
    print("| " + " | ".join(BACKLOG_HEADER) + " |", flush=True)
    if "ceiling" in args.impls:
        for n in args.ns:
            emit(result, await ceiling_backlog(n, args))
    for name in args.brokers:
        await bench_broker(name, args, result)
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    # The SDKs and the upstream triggers log every poll at INFO: noise between the table's rows.
    for noisy in ("airflow", "airflow_shared_stream_provider", "werkzeug", "botocore", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("azure").setLevel(logging.ERROR)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_signal)  # brokers are stopped in finally blocks
    signal.signal(signal.SIGINT, exit_on_signal)
    result = asyncio.run(run(args))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d-%H%M")
    target = RESULTS_DIR / f"stream-{stamp}{'-' + args.label if args.label else ''}.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(as_json(result), indent=1) + "\n")
    print()
    print(render(result))
    print(f"\npeak RSS {result['peak_rss_mb']} MB; wrote {target}")
    return 0


if __name__ == "__main__":
    # Run as ``python -m bench.stream_bench``: one copy of this module for the registry's paths.
    sys.modules.setdefault("bench.stream_bench", sys.modules[__name__])
    raise SystemExit(main())
