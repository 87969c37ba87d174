"""
Real-triggerer benchmark: how many asset events per second a real ``airflow triggerer`` persists.

Not a test. From the repository root::

    .venv/bin/python -m bench.triggerer_bench --dbs sqlite,postgres --ns 1,10 --messages 2000
    .venv/bin/python -m bench.triggerer_bench --modes per-message,batch --ns 10 --messages 20000
    .venv/bin/python -m bench.triggerer_bench --impls ours,upstream --ns 1,10 --cases backlog
    .venv/bin/python -m bench.triggerer_bench --brokers sqs,pubsub,servicebus --ns 1 --messages 500
    .venv/bin/python -m bench.triggerer_bench --render bench/results/triggerer-<date>.json

Unlike ``kafka_bench`` (which drives the manager in-process with a simulated runner), every case
here runs the **real** Airflow processes of ``devkit.airflow_env``: ``airflow db migrate``, then
``airflow dag-processor`` and ``airflow triggerer`` (``--scheduler`` adds the scheduler and the
api-server; off by default: nothing here needs Dag runs, and a scheduler would compete for the
same DB). The metadata DB is a fresh SQLite file or a fresh PostgreSQL 15 server
(``devkit.postgres``, PostgreSQL's default durability unless ``--pg-fast``) per case.

A case = (broker, db, impl, mode, N). Its Dag file has N assets, each with one AssetWatcher whose
trigger matches **every** message, all on one shared stream (same producer settings), and one
Dag scheduled on any of them; it is unpaused at creation. Two phases, one Airflow:

* **backlog**: M messages are published before Airflow starts. Clock: from the first to the last
  persisted asset event (``asset_event.timestamp``, written by the triggerer's supervisor, one DB
  session per event). The first event starts the clock, so the messages it carries are not
  counted: msgs/s = (message deliveries stamped after the first event) / window / N; events/s
  likewise. Per watcher, the distinct messages delivered must equal M: ``lost`` and ``dup`` (extra
  deliveries, i.e. redeliveries) are reported, never hidden.
* **steady**: once the backlog is in, R messages/s are published for T seconds, each carrying its
  publish time (``published_at``, epoch seconds, taken right before the send). Latency = persisted
  ``timestamp`` - ``published_at``, p50/p95/max over every (watcher, message).

``mode``: ``per-message`` (``batch_size=1``: one envelope per asset event, today's default) or
``batch`` (``batch_size=--batch-size``, ``batch_timeout=--batch-timeout`` or the trigger's default:
one asset event carries ``{"messages": [envelope, ...]}``; counted as ``len(messages)``).
``impl``: ``ours`` or ``upstream`` (``apache-airflow-providers-apache-kafka``'s shared-stream
trigger, per-message only, Kafka only; its payload is the message text).

Measured besides: the triggerer's process tree (supervisor + trigger runner subprocess) resident
set size, sampled every ``--sample-interval`` s with psutil (start / peak / end per phase, summed
over the tree) and its CPU seconds per phase; startup (triggerer start -> watchers assigned ->
first persisted event).

Airflow settings of every case (on top of ``devkit.airflow_env``'s): ``[triggerer]
max_trigger_to_select_per_loop = N + 10`` and ``shared_stream_cohort_grace_period = 5`` (all N
watchers start in one cohort: a sibling subscribed after the backlog started would miss messages,
which is the manager's documented behaviour, not what this measures), ``shared_stream_ack_timeout
= --ack-timeout`` (default 3600: at ~200 events/s a 2000-message backlog x 100 watchers takes far
longer than the 300 s default, and every message is in flight at once).

Brokers: ``kafka`` (Tansu, ``devkit.brokers.start_kafka``), ``sqs`` (a ``moto_server``
subprocess), ``pubsub`` (Google's emulator, ``devkit.brokers.start_pubsub_emulator``),
``servicebus`` (the wire-level test broker of ``tests/servicebus_broker``, in a child process).
Each case gets its own topic / queue / subscription.

The driver polls the metadata DB once per ``--poll`` seconds for new asset events (``id > last``,
read-only) and checks ``count(*)`` at the end of each phase (re-reading everything if a row was
skipped). Every process it starts (Airflow components, PostgreSQL, brokers) is stopped in
``finally``; SIGTERM / SIGINT end the run the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Final

from airflow_shared_stream_provider.brokers import HarnessTable, broker_spec, harness_names, load, sdk_module_prefixes
from bench.common import (
    RESULTS_DIR,
    as_json,
    comma_ints,
    comma_words,
    exit_on_signal,
    fmt_num,
    fmt_rate,
    machine_info,
    markdown_table,
    source_state,
)
from devkit.airflow_env import AirflowEnv, AirflowEnvError
from devkit.kits import BrokerKit, KitStream, kit_class
from devkit.latency import percentile
from devkit.ports import free_port
from devkit.postgres import FAST_SETTINGS, PostgresServer

if __name__ == "__main__":
    # Run as ``python -m bench.triggerer_bench``: the registry's ``bench.triggerer_bench:KafkaBroker``
    # paths must find this module, not import a second copy of it.
    sys.modules.setdefault("bench.triggerer_bench", sys.modules[__name__])

# Every registry broker with a bench harness (harness.bench in airflow_shared_stream_provider/brokers.py).
BROKERS: Final = harness_names("bench")
DBS: Final = ("sqlite", "postgres")
MODES: Final = ("per-message", "batch")
IMPLS: Final = ("ours", "upstream")
CASES: Final = ("backlog", "steady")
DAG_ID: Final = "bench_consumer"
REGIONS: Final = ("eu", "us", "apac")
UPSTREAM_KAFKA: Final = "airflow.providers.apache.kafka.triggers.shared_stream.KafkaSharedStreamTrigger"


# ==================================================================================================
# Messages
# ==================================================================================================
def message_body(seq: int, phase: str, *, stamp: bool) -> bytes:
    """
    One small JSON order (~130 bytes) that says which phase and sequence number it is.

    ``seq`` is the message's identity for the lost / duplicate counts (unique per phase, for every
    broker and both implementations: upstream's payload has no message id). ``published_at`` is
    taken here, i.e. right before the send, when ``stamp``.
    """
    body: dict[str, Any] = {
        "seq": seq,
        "phase": phase,
        "order_id": seq,
        "region": REGIONS[seq % len(REGIONS)],
        "amount": round(10 + (seq * 7919) % 99000 / 100, 2),
    }
    if stamp:
        body["published_at"] = time.time()
    return json.dumps(body, separators=(",", ":")).encode()


BodyFactory = Callable[[int], bytes]


# ==================================================================================================
# Brokers: one server per run, one stream (topic / queue / subscription) per case
# ==================================================================================================
class BenchBroker:
    """
    A broker server for the whole run, a thin layer over the broker's test kit (``devkit.kits``,
    the registry's ``harness.kit``); :meth:`stream` makes a fresh stream for one case. A broker's
    subclass names its connection id and the bench's own kit, stream and trigger options.
    """

    name: ClassVar[str] = ""
    conn_id: ClassVar[str] = ""
    kit_options: ClassVar[dict[str, Any]] = {}
    trigger_options: ClassVar[dict[str, Any]] = {}  # beside the stream's source and the connection
    # Whether the producer's ``api_calls`` counter counts every broker call it makes
    # (``bench/stream_bench.py`` reports broker calls from it; docs/metrics.md lists the brokers).
    counts_api_calls: ClassVar[bool] = True

    def __init__(self) -> None:
        self.kit: BrokerKit = kit_class(self.name)(**self.kit_options)

    def start(self) -> str:
        """Start the server; return a line describing it."""
        return self.kit.start()

    def stop(self) -> None:
        self.kit.stop()

    def stream_options(self, case_id: str, *, settle: bool = False) -> dict[str, Any]:
        """
        The kit's stream options for one case. ``settle``: the stream's ``unsettled()`` must answer
        (``bench/stream_bench.py`` waits on it); without, a kit may publish faster or keep one copy.
        """
        return {}

    def stream(self, case_id: str, *, settle: bool = False) -> BenchStream:
        options = self.stream_options(case_id, settle=settle)
        return BenchStream(self, self.kit.stream(f"bench-{case_id}", **options), case_id)

    def trigger(self, stream: BenchStream, impl: str) -> tuple[str, dict[str, Any]]:
        spec = broker_spec(self.name)
        return spec.trigger_path, {
            **stream.kit_stream.trigger_kwargs(),
            spec.conn_id_arg: self.conn_id,
            **self.trigger_options,
        }

    def connections(self, stream: BenchStream, impl: str) -> dict[str, Any]:
        return {self.conn_id: self.kit.connection()}


class BenchStream:
    """One case's stream: how to publish to it and how the Dag file's triggers reach it."""

    def __init__(self, broker: BenchBroker, kit_stream: KitStream, case_id: str) -> None:
        self.broker = broker
        self.kit_stream = kit_stream
        self.case_id = case_id

    @property
    def conn_id(self) -> str:
        return self.broker.conn_id

    def publish(
        self, count: int, body: BodyFactory, *, rate: float | None = None, stop: threading.Event | None = None
    ) -> int:
        """Publish ``body(i)`` for i in ``0..count-1`` (paced at ``rate``/s); return how many were sent."""
        # A generator: with ``rate``, body(i) (its published_at) is taken right before its send.
        return len(self.kit_stream.publish_bytes((body(i) for i in range(count)), rate=rate, stop=stop))

    def trigger(self, impl: str) -> tuple[str, dict[str, Any]]:
        """
        ``(class import path, kwargs)`` of a trigger that matches every message of this stream; ours
        is the registry's ``broker_spec(name).trigger_path``, not a path written here.
        """
        return self.broker.trigger(self, impl)

    def connections(self, impl: str) -> dict[str, Any]:
        return self.broker.connections(self, impl)

    def env(self) -> dict[str, str]:
        return self.broker.kit.env()


class KafkaBroker(BenchBroker):
    """
    Tansu; three partitions per case, published round robin without keys, acks from the leader,
    pipelined unless ``settle`` (Tansu's end offsets count a pipelined batch as one record: see
    ``KafkaOrders.pipeline``).
    """

    name = "kafka"
    conn_id = "bench_kafka"
    # Offset commits and DLQ sends only: aiokafka fetches in a background task of its own.
    counts_api_calls = False

    def stream_options(self, case_id: str, *, settle: bool = False) -> dict[str, Any]:
        return {"partitions": 3, "group_id": f"bench-group-{case_id}", "acks": 1, "pipeline": not settle}

    def trigger(self, stream: BenchStream, impl: str) -> tuple[str, dict[str, Any]]:
        topics = stream.kit_stream.trigger_kwargs()["topics"]
        if impl == "upstream":
            return UPSTREAM_KAFKA, {"topics": topics, "kafka_config_id": self.conn_id}
        path, kwargs = super().trigger(stream, impl)
        return path, {**kwargs, "group_id": f"bench-group-{stream.case_id}"}

    def connections(self, stream: BenchStream, impl: str) -> dict[str, Any]:
        extra: dict[str, Any] = {
            **self.kit.connection()["extra"],
            # Tansu holds a JoinGroup for half the session timeout: the same value for both clients.
            "session.timeout.ms": 3000,
            "heartbeat.interval.ms": 1000,
        }
        if impl == "upstream":
            # What upstream requires: its own group id in the connection and no auto-commit.
            extra.update({"group.id": f"bench-group-{stream.case_id}", "enable.auto.commit": "false"})
        return {self.conn_id: {"conn_type": "kafka", "extra": extra}}


class SqsBroker(BenchBroker):
    """moto_server as a subprocess rather than a thread: the broker's CPU must not share the driver's GIL."""

    name = "sqs"
    conn_id = "bench_aws"
    kit_options = {"in_subprocess": True}
    trigger_options = {"region_name": "us-east-1"}


class PubSubBroker(BenchBroker):
    name = "pubsub"
    conn_id = "bench_gcp"
    kit_options = {"project": "triggerer-bench"}

    def stream_options(self, case_id: str, *, settle: bool = False) -> dict[str, Any]:
        # The probe subscription (what unacked() reads) keeps a second copy of every message.
        return {"subscription": f"bench-{case_id}", "ack_deadline": 60, "probe": settle}


class ServiceBusBroker(BenchBroker):
    """The test broker in a child process (``devkit.kits.servicebus.ChildBroker``): its CPU stays off the driver."""

    name = "servicebus"
    conn_id = "bench_servicebus"
    kit_options = {"in_subprocess": True}

    def stream_options(self, case_id: str, *, settle: bool = False) -> dict[str, Any]:
        return {"lock_duration": 60.0}


# name -> BenchBroker, loaded from the registry's harness.bench on lookup (a new broker's class may
# live in its own module).
BROKER_CLASSES: Final[Mapping[str, type[BenchBroker]]] = HarnessTable("bench")


# ==================================================================================================
# Airflow: dag-processor + triggerer only
# ==================================================================================================
@dataclass
class BenchAirflowEnv(AirflowEnv):
    """
    :class:`AirflowEnv` that runs only ``run`` (default: dag-processor and triggerer).

    ``AirflowEnv.start`` starts every component; this is the same sequence (home, env, migrate,
    components, health) for a subset. Health without the api-server = a running job row of each
    started kind.
    """

    run: tuple[str, ...] = ("dag-processor", "triggerer")
    migrate_s: float = field(default=0.0, init=False)

    def start(self) -> None:
        import atexit

        if self.home is None:
            self.home = Path(tempfile.mkdtemp(prefix="airflow-bench-"))
            self._created_home = True
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.api_port:
            self.api_port = free_port()
        (self.home / "process-logs").mkdir(exist_ok=True)
        (self.home / "simple_auth_manager_passwords.json").write_text(json.dumps({"admin": self.admin_password}))
        self._process_env = self.build_env()
        atexit.register(self.stop)
        started = time.perf_counter()
        self.migrate()
        self.migrate_s = time.perf_counter() - started
        for name in self.run:
            self.components[name] = self._component(name)
            self.components[name].start()
        self.wait_healthy(timeout=self.startup_timeout)

    def _db_jobs_running(self) -> bool:
        kinds = {"triggerer": "TriggererJob", "dag-processor": "DagProcessorJob", "scheduler": "SchedulerJob"}
        wanted = {kinds[name] for name in self.run if name in kinds}
        rows = self.query_db("SELECT DISTINCT job_type FROM job WHERE state = 'running'")
        return wanted <= {row[0] for row in rows}


DAG_TEMPLATE: Final = '''\
"""Generated by bench.triggerer_bench: {n} asset watchers on one shared stream, every one fires for every message."""

from airflow.sdk import DAG, Asset, AssetAny, AssetWatcher, task
from {module} import {cls}

TRIGGER_KWARGS = {kwargs}
# Our triggers get a filter of their own per watcher (always true: every envelope's "broker" is
# one of the listed values). Airflow keeps ONE trigger row for identical trigger kwargs, whose
# assets then share one subscriber and one TriggerEvent per message: N distinct watchers are N
# subscribers, as in a real deployment where each watcher has its own filter.
DISTINCT = {distinct}


def watcher_kwargs(i):
    if not DISTINCT:
        return TRIGGER_KWARGS
    return {{**TRIGGER_KWARGS, "match": {{"broker": [{broker!r}, f"w{{i}}"]}}}}


assets = [
    Asset(f"asset_{{i}}", watchers=[AssetWatcher(name=f"w_{{i}}", trigger={cls}(**watcher_kwargs(i)))])
    for i in range({n})
]

with DAG("{dag_id}", schedule=AssetAny(*assets), max_active_runs=1, catchup=False):

    @task
    def consume() -> None:
        pass

    consume()
'''


def write_dag(folder: Path, trigger_path: str, kwargs: dict[str, Any], n: int, *, distinct: bool, broker: str) -> Path:
    """``distinct``: one trigger row (one subscriber) per watcher; else all N share one row."""
    module, cls = trigger_path.rsplit(".", 1)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench_watchers.py"
    path.write_text(
        DAG_TEMPLATE.format(
            n=n, module=module, cls=cls, kwargs=repr(kwargs), dag_id=DAG_ID, distinct=distinct, broker=broker
        )
    )
    return path


# ==================================================================================================
# Observing: asset events in the metadata DB, the triggerer's process tree
# ==================================================================================================
@dataclass(frozen=True)
class Delivery:
    """One message as delivered to one watcher (asset): one element of an asset event."""

    asset: str
    seq: int
    phase: str
    persisted: float  # asset_event.timestamp, epoch seconds
    published_at: float | None


def _epoch(value: Any) -> float:
    """``asset_event.timestamp`` as epoch seconds: psycopg2 gives an aware datetime, SQLite text (timezone.utc)."""
    stamp = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _bodies(extra: Any) -> list[dict[str, Any]]:
    """
    The message bodies an asset event carries: ``extra = {"from_trigger": True, "payload": P}``
    with P an envelope (ours, per message), ``{"messages": [envelope, ...]}`` (ours, batch mode),
    the message text (upstream Kafka) or a flush marker (no message).
    """
    if isinstance(extra, str):
        extra = json.loads(extra)
    payload = extra.get("payload", extra) if isinstance(extra, dict) else extra
    if isinstance(payload, dict) and isinstance(payload.get("messages"), list):
        envelopes = payload["messages"]
    elif isinstance(payload, dict) and "body" in payload:
        envelopes = [payload]
    elif isinstance(payload, str):
        envelopes = [{"body": payload}]
    else:
        return []  # a marker, or something this benchmark did not publish
    out: list[dict[str, Any]] = []
    for envelope in envelopes:
        body = envelope.get("body") if isinstance(envelope, dict) else None
        if isinstance(body, str):
            with contextlib.suppress(ValueError):
                body = json.loads(body)
        if isinstance(body, dict) and "seq" in body:
            out.append(body)
    return out


@dataclass
class EventLog:
    """Every asset event of one Airflow, read incrementally (``id > last``), as deliveries."""

    env: AirflowEnv
    last_id: int = 0
    rows: int = 0
    events: list[tuple[str, float, int, str]] = field(default_factory=list)  # asset, persisted, messages, phase
    deliveries: list[Delivery] = field(default_factory=list)
    seen: dict[tuple[str, str], set[int]] = field(default_factory=dict)  # (phase, asset) -> seqs
    read_s: float = 0.0

    def poll(self, limit: int = 20_000, upto: int | None = None) -> int:
        """
        Read new rows (up to ``limit`` per query, repeated until none are left; only ids up to
        ``upto`` if given); return how many.
        """
        total = 0
        while True:
            started = time.perf_counter()
            rows = self.env.query_db(
                "SELECT e.id, a.name, e.extra, e.timestamp FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                f"WHERE e.id > ? AND e.id <= ? ORDER BY e.id LIMIT {int(limit)}",
                (self.last_id, upto if upto is not None else 2**62),
            )
            self.read_s += time.perf_counter() - started
            for event_id, asset, extra, stamp in rows:
                self._add(str(asset), extra, _epoch(stamp))
                self.last_id = max(self.last_id, int(event_id))
            total += len(rows)
            if len(rows) < limit:
                return total

    def _add(self, asset: str, extra: Any, persisted: float) -> None:
        self.rows += 1
        bodies = _bodies(extra)
        phase = str(bodies[0].get("phase")) if bodies else "?"
        self.events.append((asset, persisted, len(bodies), phase))
        for body in bodies:
            published = body.get("published_at")
            delivery = Delivery(
                asset=asset,
                seq=int(body["seq"]),
                phase=str(body.get("phase")),
                persisted=persisted,
                published_at=float(published) if isinstance(published, int | float) else None,
            )
            self.deliveries.append(delivery)
            self.seen.setdefault((delivery.phase, asset), set()).add(delivery.seq)

    def verify_complete_read(self) -> bool:
        """
        The rows with ids up to the last one read are exactly the rows read; if not (an id
        committed after a larger one was read: not expected, the supervisor persists events one at
        a time), re-read them all. Rows persisted after the last poll stay out either way: the
        phases were measured up to it.
        """
        upto = self.last_id
        count = int(self.env.query_db("SELECT count(*) FROM asset_event WHERE id <= ?", (upto,))[0][0])
        if count == self.rows:
            return True
        self.last_id, self.rows, self.read_s = 0, 0, 0.0
        self.events, self.deliveries, self.seen = [], [], {}
        self.poll(upto=upto)
        return False

    def complete(self, phase: str, assets: int, expected: int) -> bool:
        covered = [len(seqs) for (p, _), seqs in self.seen.items() if p == phase]
        return len(covered) >= assets and all(c >= expected for c in covered)

    def delivered(self, phase: str) -> int:
        return sum(len(seqs) for (p, _), seqs in self.seen.items() if p == phase)


class TreeSampler:
    """Samples RSS (summed) and CPU seconds of a process and all its descendants, in a thread."""

    def __init__(self, pid: int, interval: float) -> None:
        self.pid = pid
        self.interval = interval
        # (perf_counter, tree RSS MB, root RSS MB, tree CPU s, processes): the root of the
        # triggerer's tree is the supervisor (DB writes), its child the trigger runner (asyncio).
        self.samples: list[tuple[float, float, float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> tuple[float, float, float, float, int] | None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        rss: list[float] = []
        cpu = 0.0
        root_rss = 0.0
        for process in processes:
            try:
                value = process.memory_info().rss / (1024 * 1024)
                times = process.cpu_times()
            except psutil.Error:
                continue
            rss.append(value)
            cpu += times.user + times.system
            if process.pid == self.pid:
                root_rss = value
        if not rss:
            return None
        return time.perf_counter(), sum(rss), root_rss, cpu, len(rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self.sample()
            if sample is not None:
                self.samples.append(sample)
            self._stop.wait(self.interval)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """RSS at the start / peak / end of ``[start, end]`` (perf_counter), and CPU seconds spent in it."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {}
        return {
            "rss_start_mb": round(inside[0][1], 1),
            "rss_peak_mb": round(max(s[1] for s in inside), 1),
            "rss_end_mb": round(inside[-1][1], 1),
            "supervisor_peak_mb": round(max(s[2] for s in inside), 1),
            "runner_peak_mb": round(max(s[1] - s[2] for s in inside), 1),
            "processes": max(s[4] for s in inside),
            "cpu_s": round(inside[-1][3] - inside[0][3], 2),
            "samples": len(inside),
        }


# ==================================================================================================
# One case
# ==================================================================================================
PATCHES = Path(__file__).resolve().parent / "patches"


@dataclass(frozen=True)
class CaseSpec:
    broker: str
    db: str
    impl: str
    mode: str
    n: int
    messages: int
    cases: tuple[str, ...]
    rate: float
    seconds: float
    batch_size: int
    batch_timeout: float | None
    timeout: float
    poll: float
    settle: float
    ack_timeout: float
    pg_fast: bool
    scheduler: bool
    sample_interval: float
    keep_home: bool
    extra_kwargs: tuple[tuple[str, Any], ...] = ()
    # A local Airflow patch of bench/patches/sitecustomize.py (upstream proposals).
    patch: str | None = None

    @property
    def label(self) -> str:
        return f"{self.broker}/{self.db}/{self.impl}/{self.mode}/N={self.n}"


def phase_metrics(log: EventLog, phase: str, n: int, expected: int) -> dict[str, Any]:
    """Rates, completeness and (when stamped) latency of one phase, from its deliveries."""
    deliveries = [d for d in log.deliveries if d.phase == phase]
    events = [e for e in log.events if e[3] == phase]
    out: dict[str, Any] = {"expected_per_watcher": expected, "asset_events": len(events), "deliveries": len(deliveries)}
    if not deliveries:
        out.update({"lost": n * expected, "duplicates": 0, "msgs_s": None, "events_s": None})
        return out
    first = min(d.persisted for d in deliveries)
    last = max(d.persisted for d in deliveries)
    window = last - first
    # The first event starts the clock: what it carries is not counted (see the module doc).
    # msgs/s counts each (watcher, message) once, at its first delivery: redeliveries are work
    # the triggerer did (deliveries/s, events/s), not progress.
    first_delivery: dict[tuple[str, int], float] = {}
    for d in deliveries:
        key = (d.asset, d.seq)
        if key not in first_delivery or d.persisted < first_delivery[key]:
            first_delivery[key] = d.persisted
    after = sum(1 for stamp in first_delivery.values() if stamp > first)
    deliveries_after = sum(1 for d in deliveries if d.persisted > first)
    events_after = sum(1 for e in events if e[1] > first)
    distinct = {asset: len(seqs) for (p, asset), seqs in log.seen.items() if p == phase}
    per_watcher = Counter(d.asset for d in deliveries)
    lost = sum(max(0, expected - distinct.get(f"asset_{i}", 0)) for i in range(n))
    out.update(
        {
            "first_persisted": first,
            "last_persisted": last,
            "window_s": round(window, 3),
            "msgs_s": after / window / n if window > 0 else None,
            "deliveries_s": deliveries_after / window / n if window > 0 else None,
            "events_s": events_after / window if window > 0 else None,
            "messages_per_event": round(len(deliveries) / len(events), 2) if events else None,
            "lost": lost,
            "duplicates": sum(per_watcher.values()) - sum(distinct.values()),
            "watchers_complete": sum(1 for i in range(n) if distinct.get(f"asset_{i}", 0) >= expected),
        }
    )
    # Asset events persisted per second of the window: shows the supervisor's rhythm (bursts
    # per runner sync, stalls) that a single rate hides.
    buckets = Counter(int(e[1] - first) for e in events)
    out["events_per_second"] = [buckets.get(i, 0) for i in range(min(int(window) + 1, 900))]
    latencies = [d.persisted - d.published_at for d in deliveries if d.published_at is not None]
    if latencies:
        out.update(
            {
                "latency_p50_s": percentile(latencies, 0.50),
                "latency_p95_s": percentile(latencies, 0.95),
                "latency_p99_s": percentile(latencies, 0.99),
                "latency_max_s": max(latencies),
                "latency_mean_s": statistics.fmean(latencies),
            }
        )
    return out


def _trigger_for(spec: CaseSpec, stream: BenchStream) -> tuple[str, dict[str, Any]]:
    path, kwargs = stream.trigger(spec.impl)
    if spec.impl == "ours":
        kwargs = {**kwargs, **dict(spec.extra_kwargs)}
    if spec.mode == "batch":
        kwargs = {**kwargs, "batch_size": spec.batch_size}
        if spec.batch_timeout is not None:
            kwargs["batch_timeout"] = spec.batch_timeout
    return path, kwargs


def wait_for(predicate: Callable[[], bool], *, timeout: float, interval: float, env: AirflowEnv) -> bool:
    """Poll ``predicate`` until true (True) or ``timeout`` (False); raise if a component died."""
    deadline = time.monotonic() + timeout
    while True:
        env.check_alive()
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def assigned_watchers(env: AirflowEnv) -> int:
    rows = env.query_db(
        "SELECT count(*) FROM asset_watcher w JOIN trigger t ON t.id = w.trigger_id WHERE t.triggerer_id IS NOT NULL"
    )
    return int(rows[0][0])


def run_phase(
    spec: CaseSpec,
    log: EventLog,
    env: AirflowEnv,
    phase: str,
    expected: int,
    timeout: float,
) -> tuple[bool, float]:
    """Poll until every watcher holds ``expected`` distinct messages of ``phase``; then settle."""

    def done() -> bool:
        log.poll()
        return log.complete(phase, spec.n, expected)

    complete = wait_for(done, timeout=timeout, interval=spec.poll, env=env)
    ended = time.perf_counter()
    # Late duplicates (redeliveries) would land within a sync or two.
    time.sleep(spec.settle)
    log.poll()
    return complete, ended


def run_case(spec: CaseSpec, broker: BenchBroker, case_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {
        "patch": spec.patch,
        "broker": spec.broker,
        "db": spec.db,
        "impl": spec.impl,
        "mode": spec.mode,
        "n": spec.n,
        "messages": spec.messages,
        "batch_size": spec.batch_size if spec.mode == "batch" else 1,
        "batch_timeout": spec.batch_timeout if spec.mode == "batch" else None,
        "status": "ok",
        # The machine is shared: a busy minute shows here (1, 5, 15 min load averages).
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    stream = broker.stream(case_id)
    path, kwargs = _trigger_for(spec, stream)
    result["trigger"] = {"class": path, "kwargs": kwargs}
    work = Path(tempfile.mkdtemp(prefix="triggerer-bench-"))
    pg: PostgresServer | None = None
    env: BenchAirflowEnv | None = None
    sampler: TreeSampler | None = None
    try:
        if "backlog" in spec.cases:
            started = time.perf_counter()
            stream.publish(spec.messages, lambda i: message_body(i, "backlog", stamp=False))
            result["publish_backlog_s"] = round(time.perf_counter() - started, 2)
        if spec.db == "postgres":
            pg = PostgresServer(settings=FAST_SETTINGS if spec.pg_fast else {})
            pg.start()
            result["postgres"] = {"settings": dict(pg.settings) or "PostgreSQL defaults (fsync on)"}
        distinct = spec.impl == "ours"  # the upstream trigger has no per-watcher filter argument
        result["distinct_trigger_rows"] = distinct
        write_dag(work / "dags", path, kwargs, spec.n, distinct=distinct, broker=spec.broker)
        env = BenchAirflowEnv(
            work / "dags",
            connections=stream.connections(spec.impl),
            env={**stream.env(), **({"AIRFLOW_BENCH_PATCH": spec.patch} if spec.patch else {})},
            python_path=(work / "dags", PATCHES) if spec.patch else None,
            triggerer={
                "max_trigger_to_select_per_loop": max(50, spec.n + 10),
                "shared_stream_cohort_grace_period": 5.0,
                "shared_stream_ack_timeout": spec.ack_timeout,
            },
            config={"core": {"dags_are_paused_at_creation": False}},
            home=work / "airflow-home",
            api_server=spec.scheduler,
            run=("dag-processor", "triggerer", *(("scheduler", "api-server") if spec.scheduler else ())),
            sql_alchemy_conn=pg.url if pg is not None else None,
            startup_timeout=300,
        )
        case_started = time.perf_counter()
        env.start()
        result["migrate_s"] = round(env.migrate_s, 1)
        triggerer = env.components["triggerer"]
        assert triggerer.pid is not None
        import psutil

        triggerer_started = psutil.Process(triggerer.pid).create_time()  # epoch seconds
        sampler = TreeSampler(triggerer.pid, spec.sample_interval)
        sampler.start()
        log = EventLog(env)
        if not wait_for(lambda: assigned_watchers(env) >= spec.n, timeout=300, interval=0.5, env=env):
            raise AirflowEnvError(f"only {assigned_watchers(env)} of {spec.n} watchers were assigned in 300 s")
        watchers_at = time.perf_counter()
        result["watchers_assigned_s"] = round(watchers_at - case_started, 1)
        wall_offset = time.time() - time.perf_counter()  # perf_counter -> epoch, for the sampler windows

        if "backlog" in spec.cases:
            complete, ended = run_phase(spec, log, env, "backlog", spec.messages, spec.timeout)
            metrics = phase_metrics(log, "backlog", spec.n, spec.messages)
            metrics["complete"] = complete
            if metrics.get("first_persisted") is not None:
                # Startup: from the triggerer process's start to its first persisted event (its
                # imports, the Dag parse and watcher registration, the broker connection / group join).
                metrics["first_event_after_start_s"] = round(metrics["first_persisted"] - triggerer_started, 1)
            phase_start = watchers_at
            phase_end = metrics["last_persisted"] - wall_offset if metrics.get("last_persisted") is not None else ended
            metrics["triggerer"] = sampler.window(phase_start - spec.sample_interval, phase_end + spec.sample_interval)
            result["backlog"] = metrics
            print(f"  backlog: {_phase_line(metrics, spec.n)}", flush=True)

        if "steady" in spec.cases:
            count = round(spec.rate * spec.seconds)
            stop = threading.Event()
            sent: list[int] = []

            def publish() -> None:
                sent.append(
                    stream.publish(count, lambda i: message_body(i, "steady", stamp=True), rate=spec.rate, stop=stop)
                )

            publisher = threading.Thread(target=publish, name="steady-publisher", daemon=True)
            steady_start = time.perf_counter()
            publisher.start()
            try:
                complete, ended = run_phase(spec, log, env, "steady", count, spec.seconds + spec.timeout)
            finally:
                stop.set()
                publisher.join(timeout=30)
            metrics = phase_metrics(log, "steady", spec.n, count)
            metrics.update({"complete": complete, "rate": spec.rate, "seconds": spec.seconds, "published": sum(sent)})
            metrics["triggerer"] = sampler.window(steady_start - spec.sample_interval, ended + spec.sample_interval)
            result["steady"] = metrics
            print(f"  steady:  {_phase_line(metrics, spec.n)}", flush=True)

        if not log.verify_complete_read():
            result["reread"] = True
            for phase in ("backlog", "steady"):
                if phase in result:
                    expected = result[phase]["expected_per_watcher"]
                    kept = {
                        k: result[phase][k]
                        for k in ("complete", "triggerer", "rate", "seconds", "published", "first_event_after_start_s")
                        if k in result[phase]
                    }
                    result[phase] = {**phase_metrics(log, phase, spec.n, expected), **kept}
        result["db_read_s"] = round(log.read_s, 2)
        result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        result["triggerer_run"] = sampler.window(0.0, time.perf_counter() + 1)
    except Exception as exc:
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        if env is not None:
            result["log_tails"] = env.log_tails(40)[-6000:]
        print(f"  ERROR {result['error'][:600]}", flush=True)
    finally:
        if sampler is not None:
            sampler.stop()
        if env is not None:
            env.keep_home = spec.keep_home
            env.stop()
        if pg is not None:
            pg.stop()
        if not spec.keep_home:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        else:
            result["work_dir"] = str(work)
    return result


def _phase_line(metrics: dict[str, Any], n: int) -> str:
    parts = [
        f"msgs/s {fmt_rate(metrics.get('msgs_s'))}",
        f"events/s {fmt_rate(metrics.get('events_s'))}",
        f"window {fmt_num(metrics.get('window_s'), 1)} s",
        f"lost {metrics.get('lost')}",
        f"dup {metrics.get('duplicates')}",
    ]
    if metrics.get("latency_p50_s") is not None:
        parts.append(f"p50 {fmt_num(metrics['latency_p50_s'])} s p95 {fmt_num(metrics['latency_p95_s'])} s")
    triggerer = metrics.get("triggerer") or {}
    if triggerer:
        parts.append(
            f"RSS {triggerer['rss_start_mb']:.0f}/{triggerer['rss_peak_mb']:.0f}/{triggerer['rss_end_mb']:.0f} MB"
        )
    if not metrics.get("complete", True):
        parts.append("INCOMPLETE (timeout)")
    return ", ".join(parts)


# ==================================================================================================
# Tables
# ==================================================================================================
def _rss_cell(metrics: dict[str, Any]) -> str:
    t = metrics.get("triggerer") or {}
    if not t:
        return "-"
    return f"{t['rss_start_mb']:.0f} / {t['rss_peak_mb']:.0f} / {t['rss_end_mb']:.0f}"


def _mode_cell(run: dict[str, Any]) -> str:
    if run["mode"] == "batch":
        timeout = run.get("batch_timeout")
        return f"batch {run['batch_size']}" + (f" / {timeout:g} s" if timeout is not None else "")
    return "per-message"


def render_tables(runs: Sequence[dict[str, Any]]) -> str:
    lines: list[str] = []
    backlog_rows: list[list[str]] = []
    steady_rows: list[list[str]] = []
    for run in runs:
        head = [run["broker"], run["db"], run["impl"], _mode_cell(run), str(run["n"])]
        if run["status"] != "ok":
            backlog_rows.append([*head, str(run["messages"]), "error", "-", "-", "-", "-", "-", "-", "-"])
            continue
        b = run.get("backlog")
        if b:
            backlog_rows.append(
                [
                    *head,
                    str(run["messages"]),
                    fmt_rate(b.get("msgs_s")) + ("" if b.get("complete") else " (incomplete)"),
                    fmt_rate(b.get("events_s")),
                    fmt_num(b.get("messages_per_event"), 1),
                    fmt_num(b.get("window_s"), 1),
                    f"{b.get('lost')} / {b.get('duplicates')}",
                    _rss_cell(b),
                    fmt_num((b.get("triggerer") or {}).get("cpu_s"), 1),
                    fmt_num(b.get("first_event_after_start_s"), 1),
                ]
            )
        s = run.get("steady")
        if s:
            steady_rows.append(
                [
                    *head,
                    f"{s['rate']:g} x {s['seconds']:g} s",
                    fmt_rate(s.get("events_s")),
                    fmt_num(s.get("latency_p50_s")),
                    fmt_num(s.get("latency_p95_s")),
                    fmt_num(s.get("latency_max_s")),
                    f"{s.get('lost')} / {s.get('duplicates')}" + ("" if s.get("complete") else " (incomplete)"),
                    _rss_cell(s),
                    fmt_num((s.get("triggerer") or {}).get("cpu_s"), 1),
                ]
            )
    if backlog_rows:
        lines.append(
            "Backlog (published before the triggerer starts; clock from the first to the last persisted event)\n"
        )
        lines.append(
            markdown_table(
                [
                    "broker",
                    "db",
                    "impl",
                    "mode",
                    "N",
                    "M",
                    "msgs/s",
                    "asset events/s",
                    "msgs/event",
                    "window s",
                    "lost / dup",
                    "triggerer RSS MB start / peak / end",
                    "triggerer CPU s",
                    "first event after start s",
                ],
                backlog_rows,
            )
        )
    if steady_rows:
        lines.append("\nSteady (fixed publish rate; latency = persisted timestamp - publish time)\n")
        lines.append(
            markdown_table(
                [
                    "broker",
                    "db",
                    "impl",
                    "mode",
                    "N",
                    "rate",
                    "asset events/s",
                    "p50 s",
                    "p95 s",
                    "max s",
                    "lost / dup",
                    "triggerer RSS MB start / peak / end",
                    "triggerer CPU s",
                ],
                steady_rows,
            )
        )
    return "\n".join(lines)


# ==================================================================================================
# Driver
# ==================================================================================================


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--brokers", type=comma_words(BROKERS), default=["kafka"], help=",".join(BROKERS))
    parser.add_argument("--dbs", type=comma_words(DBS), default=list(DBS), help="sqlite,postgres")
    parser.add_argument(
        "--impls", type=comma_words(IMPLS), default=["ours"], help="ours,upstream (upstream: kafka only)"
    )
    parser.add_argument("--modes", type=comma_words(MODES), default=["per-message"], help="per-message,batch")
    parser.add_argument("--ns", type=comma_ints, default=[1, 10], help="watchers, e.g. 1,10,100")
    parser.add_argument("--cases", type=comma_words(CASES), default=list(CASES), help="backlog,steady")
    parser.add_argument("--messages", type=int, default=2000, help="backlog size M (default 2000)")
    parser.add_argument(
        "--batch-messages",
        type=int,
        default=None,
        help="backlog size in batch mode (default: --messages; a batch-mode backlog drains ~50x faster)",
    )
    parser.add_argument("--rate", type=float, default=100.0, help="steady publish rate, msgs/s (default 100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="steady publish duration (default 20 s)")
    parser.add_argument("--batch-size", type=int, default=500, help="batch mode's batch_size (default 500)")
    parser.add_argument(
        "--batch-timeout", type=float, default=None, help="batch mode's batch_timeout (default: the trigger's)"
    )
    parser.add_argument(
        "--trigger-kwargs",
        type=json.loads,
        default={},
        help="more kwargs for our triggers, JSON, e.g. '{\"max_payload_bytes\": 262144}'",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="cap per phase after publishing (default 600 s)")
    parser.add_argument("--poll", type=float, default=1.0, help="DB poll interval (default 1 s)")
    parser.add_argument("--settle", type=float, default=3.0, help="wait for late duplicates after a phase (3 s)")
    parser.add_argument("--ack-timeout", type=float, default=3600.0, help="[triggerer] shared_stream_ack_timeout")
    parser.add_argument("--pg-fast", action="store_true", help="PostgreSQL with fsync/synchronous_commit off")
    parser.add_argument("--scheduler", action="store_true", help="also run the scheduler (and the api-server)")
    parser.add_argument(
        "--patch",
        choices=["one-session", "housekeeping-once-a-second"],
        default=None,
        help="run the triggerer with a local Airflow patch (bench/patches/sitecustomize.py): one DB session "
        "per sync instead of one per event, or the supervisor's trigger assignment and cleanup at most once a "
        "second instead of after every socket read (docs/upstream-proposals.md); never shipped",
    )
    parser.add_argument("--sample-interval", type=float, default=0.5, help="triggerer RSS sampling (default 0.5 s)")
    parser.add_argument("--keep-home", action="store_true", help="keep each case's AIRFLOW_HOME (logs) for debugging")
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default bench/results/triggerer-<date>.json)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--render", type=Path, default=None, help="print the tables of a result file again")
    return parser.parse_args(argv)


def batch_supported(broker: str) -> bool:
    """Whether this checkout's triggers take ``batch_size`` (batch mode landed): a field of the broker's settings."""
    import dataclasses

    settings = load(broker_spec(broker).settings)
    return "batch_size" in {f.name for f in dataclasses.fields(settings)}


def _versions() -> dict[str, str]:
    import importlib.metadata

    out: dict[str, str] = {}
    for dist in ("psycopg2-binary", "asyncpg", "boto3", "moto", "google-cloud-pubsub", "azure-servicebus"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    with contextlib.suppress(Exception):
        from devkit.postgres import pg_bin_dir

        out["postgresql"] = subprocess.run(
            [str(pg_bin_dir() / "postgres"), "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        data = json.loads(args.render.read_text())
        print(render_tables(data["runs"]))
        return 0
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, exit_on_signal)
    import logging

    # The publishers' SDKs log every connection state change at INFO (Airflow's logging config is
    # active in this process through bench.common's imports): keep the driver's output to results.
    for name in sorted({prefix.partition(".")[0] for prefix in sdk_module_prefixes()}):
        logging.getLogger(name).setLevel(logging.WARNING)
    started_at = datetime.now().isoformat(timespec="seconds")
    specs: list[CaseSpec] = []
    skipped: list[str] = []
    for broker in args.brokers:
        for db in args.dbs:
            for n in args.ns:
                for impl in args.impls:
                    for mode in args.modes:
                        if impl == "upstream" and (broker != "kafka" or mode != "per-message"):
                            skipped.append(f"{broker}/{db}/{impl}/{mode}/N={n}: upstream = Kafka, per message only")
                            continue
                        specs.append(
                            CaseSpec(
                                broker=broker,
                                db=db,
                                impl=impl,
                                mode=mode,
                                n=n,
                                messages=args.batch_messages
                                if mode == "batch" and args.batch_messages
                                else args.messages,
                                cases=tuple(args.cases),
                                rate=args.rate,
                                seconds=args.seconds,
                                batch_size=args.batch_size,
                                batch_timeout=args.batch_timeout,
                                timeout=args.timeout,
                                poll=args.poll,
                                settle=args.settle,
                                ack_timeout=args.ack_timeout,
                                pg_fast=args.pg_fast,
                                scheduler=args.scheduler,
                                sample_interval=args.sample_interval,
                                keep_home=args.keep_home,
                                extra_kwargs=tuple(sorted(args.trigger_kwargs.items())),
                                patch=args.patch,
                            )
                        )
    if "batch" in args.modes:
        for broker in args.brokers:
            if not batch_supported(broker):
                print(f"bench: {broker}'s trigger takes no batch_size yet: batch mode not run", file=sys.stderr)
                specs = [s for s in specs if not (s.broker == broker and s.mode == "batch")]
                skipped.append(f"{broker}/batch: the trigger takes no batch_size in this checkout")
    if "upstream" in args.impls:
        import importlib.util

        if importlib.util.find_spec("airflow.providers.apache.kafka") is None:
            print(
                "bench: the upstream Kafka provider is not installed; install the bench group first:\n"
                '  .venv/bin/uv pip install --python .venv/bin/python -e ".[all]" --group dev --group bench',
                file=sys.stderr,
            )
            return 2

    runs: list[dict[str, Any]] = []
    brokers_info: dict[str, str] = {}
    run_started = time.perf_counter()
    run_tag = uuid.uuid4().hex[:6]
    try:
        for broker_name in args.brokers:
            broker_specs = [s for s in specs if s.broker == broker_name]
            if not broker_specs:
                continue
            broker = BROKER_CLASSES[broker_name]()
            try:
                brokers_info[broker_name] = broker.start()
                print(f"== {brokers_info[broker_name]}", flush=True)
                for index, spec in enumerate(broker_specs):
                    print(f"-- {spec.label} M={spec.messages}", flush=True)
                    result = run_case(spec, broker, f"{run_tag}-{index}")
                    runs.append(result)
            finally:
                broker.stop()
    finally:
        machine = machine_info()
        machine["versions"].update(_versions())
        report = {
            "started_at": started_at,
            "wall_s": round(time.perf_counter() - run_started, 1),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "machine": machine,
            "source": source_state("airflow_shared_stream_provider", "devkit", "bench"),
            "brokers": brokers_info,
            "skipped": skipped,
            "runs": runs,
        }
        if runs:
            print()
            print(render_tables(runs))
        if not args.no_write and runs:
            out = args.out or RESULTS_DIR / f"triggerer-{datetime.now():%Y-%m-%d-%H%M}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(as_json(report), indent=1, default=str) + "\n")
            print(f"\nwrote {out}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
