"""
The chaos run: the production topology of ``devkit.production`` under steady orders while a
schedule breaks it, then the checks a user makes on the output tables. Not a test (the short
variant runs in CI: tests/e2e/test_production.py). From the repository root::

    .venv/bin/python -m bench.production --brokers kafka,sqs,pubsub,redis --minutes 30 --rate 2
    .venv/bin/python -m bench.production --brokers kafka --minutes 3 --rate 2 --chaos once   # CI's shape
    .venv/bin/python -m bench.production --brokers kafka --minutes 10 --rate 10 --stress 2   # starved

What happens:

* **orders**: one publisher thread per broker sends ``--rate`` messages per second for ``--minutes``
  (one ``publish`` call per second). Every 20th message is malformed (broken JSON, a JSON array, an
  order without ``amount``); every 25th valid order is published **twice** (the same bytes: a
  retrying publisher), which the broker gives two message ids. Each order's ``created_at`` is its
  send time (so "revenue per region and minute" is per real minute) and ``sent_at`` the same as
  epoch seconds, for latency.
* **chaos** (``--chaos``): ``once`` runs each action once, evenly spaced over the first 80 % of the
  window; ``loop`` cycles through them every ``--chaos-every`` seconds; ``none``. The actions:
  ``kill-triggerer`` (``kill -9`` of the first triggerer's process group, started again 3 s later,
  as a supervisor would), ``kill-scheduler`` (the same), ``kill-spark-worker`` (waits until a
  pipeline's ``aggregate`` task runs and its application is on the master, ``kill -9`` of worker 1
  with its executors, started again 10 s later), ``pause-dag`` (pauses every broker's
  ``..._orders_eu_consumer`` Dag at once for ``--pause-seconds``), ``restart-dag-processor`` and
  ``restart-broker``: every broker whose local server can restart **with its data** (Redis: its
  append-only file and RDB kept) is stopped gracefully and started again on the same port 3 s
  later, while its publisher waits; the others (Kafka on Tansu's memory engine, moto's SQS, the
  Pub/Sub emulator, the Service Bus wire broker: state in memory) are recorded as skipped with the
  reason. The watchers reconnect by themselves; the event records each restart's stop and down
  time and how soon after it the broker's ``..._orders_valid`` watcher stored the event of an order
  sent after the restart.
* **the end** (after ``--drain-timeout`` at most): for each broker,

  * every watcher has an asset event for every message it must fire on (lost 0 per watcher), except,
    on the queue brokers, what its Dag's pause explains (:func:`pause_reason`; Kafka replays
    everything to a watcher that comes back): counted apart as ``missed_while_paused``,
    with each reason's count in ``missed_while_paused_why`` (the triggerers' logs show which
    messages the paused watcher fired and Airflow stored for no asset, :mod:`bench.triggerer_log`);
    a miss that stays unexplained is in ``lost_ids`` with the time the watcher fired it, if it did;
  * the output table ``order_lines`` holds every valid order **exactly once** (0 missing, 0 twice,
    keyed on ``order_id``), and the revenue per region and minute equals what was published, to
    the cent;
  * every malformed message is in the dead-letter destination (``dead_lettered >= malformed``);
  * the broker is settled (nothing unacked, in flight or uncommitted);
  * how many events each pipeline run took (the scheduler merges events that arrive while a run is
    queued or running: Airflow 3.3's ``triggering_asset_events`` of one run hold all of them).

* **latency**, per broker, of the pipeline's path: publish -> asset event stored -> Dag run queued
  -> ``extract`` task started -> ``aggregate`` finished (its last act is the Parquet write: "row
  written"); p50 / p95 / max over all orders and the p95 per 5-minute window of publish time.
  ``publish -> asset event`` is also given for every watcher.

Results: printed, and written as JSON to ``--out`` (default ``bench/results/production-<UTC
date-time>-<brokers>.json``). Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from bench.triggerer_log import TriggererLogs
from devkit.demo import (
    REGIONS,
    OrderMessage,
    expected_watchers,
    make_order,
    spark_revenue,
)
from devkit.demo_streams import DemoStream
from devkit.latency import Hops, envelopes, summary, to_epoch
from devkit.production import (
    LATENCY_PAIR,
    MessageFacts,
    ProductionTopology,
    WatcherRole,
    add_topology_arguments,
    interrupt_on_sigterm,
    pair_dag,
)

ROOT: Final = Path(__file__).resolve().parent.parent
RESULTS: Final = ROOT / "bench" / "results"
MALFORMED_EVERY: Final = 20
DUPLICATE_EVERY: Final = 25
# In this order with --chaos once: the Spark worker first (the first pipeline run comes early),
# the scheduler late (its kill stalls the pipeline's tasks for the task heartbeat timeout).
ACTIONS: Final = (
    "kill-spark-worker",
    "kill-triggerer",
    "restart-broker",
    "pause-dag",
    "kill-scheduler",
    "restart-dag-processor",
)
BROKER_DOWN_SECONDS: Final = 3.0  # restart-broker: how long a stopped broker stays down
RECONNECT_TIMEOUT: Final = 120.0  # restart-broker: how long to wait for the first event after it
CHECK_COLUMNS: Final = (
    "broker",
    "published",
    "valid orders",
    "duplicates",
    "malformed",
    "lost (per watcher)",
    "missed while paused",
    "redelivered",
    "output missing",
    "output twice",
    "revenue groups wrong",
    "dead-lettered",
    "settled",
    "runs (max events/run)",
    "ok",
)
WINDOW_SECONDS: Final = 300.0  # latency p95 is also given per window of publish time


# -- the orders -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sent:
    """One message a publisher handed to its broker (``order_id`` None: broken JSON, no identity)."""

    order_id: str | None
    message: OrderMessage
    sent_at: float
    duplicate: bool = False


def orders_for_tick(broker: str, start_seq: int, count: int, now: float, rng: random.Random) -> list[OrderMessage]:
    """``count`` messages numbered from ``start_seq``: valid orders, every 20th malformed, every 25th valid twice."""
    created = datetime.fromtimestamp(now, tz=timezone.utc)
    out: list[OrderMessage] = []
    for seq in range(start_seq, start_seq + count):
        order_id = f"{broker}-{seq:07d}"
        if seq % MALFORMED_EVERY == MALFORMED_EVERY - 1:
            variant = (seq // MALFORMED_EVERY) % 3
            if variant == 0:
                value = b'{"order_id": "' + order_id.encode() + b'", "region":'
                out.append(OrderMessage(order_id.encode(), value, "malformed-json"))
            elif variant == 1:
                out.append(OrderMessage(order_id.encode(), json.dumps([order_id, "eu", 12]).encode(), "not-an-order"))
            else:
                body = {"order_id": order_id, "region": "eu", "created_at": created.isoformat(), "sent_at": now}
                out.append(OrderMessage(order_id.encode(), json.dumps(body).encode(), "not-an-order"))
            continue
        region = REGIONS[rng.randrange(len(REGIONS))]
        amount = rng.choice([rng.uniform(5, 499), rng.uniform(500, 2000)])
        message = make_order(order_id, region, amount, created, sent_at=now)
        out.append(message)
        if seq % DUPLICATE_EVERY == 0:
            out.append(message)  # the same bytes again: a publisher's retry
    return out


def identity(message: OrderMessage) -> str | None:
    body = message.body()
    return str(body["order_id"]) if isinstance(body, dict) and isinstance(body.get("order_id"), str) else None


class Publisher(threading.Thread):
    """Publishes one broker's orders at ``rate`` per second, one ``publish`` call per second."""

    def __init__(self, broker: str, stream: DemoStream[Any], rate: float, seconds: float, seed: int) -> None:
        super().__init__(name=f"publisher-{broker}", daemon=True)
        self.broker, self.stream, self.rate, self.seconds = broker, stream, rate, seconds
        self.rng = random.Random(seed)
        self.sent: list[Sent] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        seq = 0
        tick = 0
        while not self.stop_event.is_set() and time.monotonic() - started < self.seconds:
            due = int(self.rate * (tick + 1)) - int(self.rate * tick)  # fractional rates average out
            now = time.time()
            batch = orders_for_tick(self.broker, seq, due, now, self.rng)
            seq += due
            try:
                self.stream.publish(batch)
            except Exception as exc:  # a failed send: recorded, the run's checks say what it cost
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                seen: set[str] = set()
                for message in batch:
                    order_id = identity(message)
                    self.sent.append(Sent(order_id, message, now, duplicate=order_id in seen))
                    if order_id:
                        seen.add(order_id)
            tick += 1
            delay = started + tick - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)


# -- chaos ----------------------------------------------------------------------------------------
@dataclass
class ChaosLog:
    events: list[dict[str, Any]] = field(default_factory=list)
    # broker -> (paused at, watcher running again at), epoch seconds
    pauses: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, action: str, started: float, **detail: Any) -> None:
        self.events.append(
            {"action": action, "at": round(started, 3), "took_s": round(time.time() - started, 1), **detail}
        )


class Chaos(threading.Thread):
    """Runs the schedule of actions against the topology (see the module docstring)."""

    def __init__(
        self,
        topology: ProductionTopology,
        schedule: Sequence[tuple[float, str]],
        pause_seconds: float,
        say: Callable[[str], None],
        publishers: Mapping[str, Publisher],
    ) -> None:
        super().__init__(name="chaos", daemon=True)
        self.topology, self.schedule, self.pause_seconds, self.say = topology, schedule, pause_seconds, say
        self.publishers = publishers
        self.log = ChaosLog()
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        for at, action in self.schedule:
            delay = started + at - time.monotonic()
            if delay > 0 and self.stop_event.wait(delay):
                return
            self.say(f"chaos: {action}")
            try:
                getattr(self, "do_" + action.replace("-", "_"))()
            except Exception as exc:  # an action that could not run is a finding, not a crash
                self.errors.append(f"{action}: {type(exc).__name__}: {exc}")
                self.say(f"chaos: {action} failed: {exc}")

    def _kill_and_restart(self, name: str, down_seconds: float) -> dict[str, Any]:
        env = self.topology.env
        component = env.components[name]
        pid = component.pid
        env.kill(name)
        time.sleep(down_seconds)
        component.start()
        return {"component": name, "killed_pid": pid}

    def do_kill_triggerer(self) -> None:
        started = time.time()
        self.log.add("kill-triggerer", started, **self._kill_and_restart("triggerer", 3.0))

    def do_kill_scheduler(self) -> None:
        started = time.time()
        self.log.add("kill-scheduler", started, **self._kill_and_restart("scheduler", 3.0))

    def do_restart_dag_processor(self) -> None:
        started = time.time()
        self.topology.env.restart("dag-processor")
        self.log.add("restart-dag-processor", started)

    def do_kill_spark_worker(self) -> None:
        cluster = self.topology.spark_cluster
        started = time.time()
        if cluster is None:
            self.log.add("kill-spark-worker", started, skipped="Spark runs local[2] in the task")
            return
        # During a job: wait (up to 5 min) until some pipeline's ``aggregate`` task runs and its
        # application is on the master (then its executors are on the workers).
        deadline = time.monotonic() + 300
        apps: list[dict[str, Any]] = []
        running: list[tuple[Any, ...]] = []
        while time.monotonic() < deadline and not self.stop_event.is_set():
            running = self.topology.env.query_db(
                "SELECT dag_id, run_id FROM task_instance WHERE task_id = 'aggregate' AND state = 'running'"
            )
            apps = cluster.applications(completed=False) if running else []
            if running and apps:
                break
            time.sleep(0.5)
        worker = cluster.processes["worker-1"]
        process = worker.process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        time.sleep(10)
        worker.start()
        self.log.add(
            "kill-spark-worker",
            started,
            during_task=[f"{dag_id} {run_id}" for dag_id, run_id in running] or None,
            during_application=[str(app.get("name")) for app in apps] or None,
        )

    def do_restart_broker(self) -> None:
        started = time.time()
        done = restart_brokers(self.topology.streams, BROKER_DOWN_SECONDS)
        # Evidence that the watchers reconnected by themselves: how long after the broker was up
        # again its "valid" watcher (it fires on every valid order) stored the event of an order
        # **sent after** the restart (read over a new connection, not a batch read before it).
        # None within the timeout is recorded, not raised: the end's checks decide.
        for broker, entry in done.items():
            if "skipped" not in entry:
                watcher = self.topology.streams[broker].watcher_name("kafka_orders_valid")
                up_at = entry.pop("up_at")
                after = self._new_order_event_after(watcher, up_at, self.publishers[broker])
                entry["new_order_event_after_s"] = after
                if after is None and not self._sent_since(self.publishers[broker], up_at):
                    entry["reconnect_unchecked"] = "publishing ended before the broker was up: no order to wait for"
        self.log.add("restart-broker", started, brokers=done)

    @staticmethod
    def _sent_since(publisher: Publisher, since: float) -> bool:
        return bool(publisher.sent) and publisher.sent[-1].sent_at >= since

    def _new_order_event_after(self, watcher: str, since: float, publisher: Publisher) -> float | None:
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        last_id = 0
        while not self.stop_event.is_set():
            # An action before this one may have run past the publish window (a long Spark job):
            # with publishing over and no order sent after the restart, none can come, and waiting
            # out the timeout would only push the remaining actions into the drain. Read before
            # the scan, so an order sent in the last moment is still waited for.
            nothing_to_wait_for = not publisher.is_alive() and not self._sent_since(publisher, since)
            for event in self.topology.env.asset_events(watcher, after_id=last_id):
                last_id = max(last_id, event["id"])
                stored = to_epoch(event["timestamp"])
                for envelope in envelopes(event["extra"], upstream_text=True):
                    body = envelope.get("body")
                    sent_at = body.get("sent_at") if isinstance(body, dict) else None
                    if isinstance(sent_at, (int, float)) and sent_at >= since and stored is not None:
                        return round(stored - since, 1)
            if time.monotonic() > deadline or nothing_to_wait_for:
                return None
            time.sleep(0.5)
        return None

    def do_pause_dag(self) -> None:
        # Every broker's eu consumer at once: what a pause costs differs per broker (Kafka's
        # watcher positions replay for a watcher that comes back; a queue's messages are gone).
        env = self.topology.env
        streams = self.topology.streams
        dag_ids = [stream.consumer_dags[0] for stream in streams.values()]
        watchers = [stream.watchers[0] for stream in streams.values()]
        started = time.time()
        env.pause(dag_ids)
        self.stop_event.wait(self.pause_seconds)
        env.unpause(dag_ids)
        env.wait_for_watchers(watchers, timeout=300)
        ended = time.time()
        for broker in streams:
            self.log.pauses[broker].append((started, ended))
        self.log.add("pause-dag", started, dag_ids=dag_ids, paused_s=round(ended - started, 1))


def restart_brokers(streams: Mapping[str, DemoStream[Any]], down_seconds: float) -> dict[str, dict[str, Any]]:
    """
    restart-broker: every broker whose local server can restart **with its data** is stopped
    gracefully and started again on the same address after ``down_seconds``; every other one is
    recorded as skipped with its reason (never silently: a memory-only broker would come back
    empty, which is a different fault). One at a time, in the run's broker order.
    """
    out: dict[str, dict[str, Any]] = {}
    for broker, stream in streams.items():
        reason = stream.restart_unsupported()
        if reason is not None:
            out[broker] = {"skipped": reason}
            continue
        restart = stream.restart_keeping_data(down_seconds)
        out[broker] = {
            "restarted": restart.address,
            "stop_s": restart.stop_s,
            "down_s": restart.down_s,
            "up_at": time.time(),
        }
    return out


def chaos_schedule(mode: str, seconds: float, every: float, actions: Sequence[str]) -> list[tuple[float, str]]:
    """``(seconds after the start, action)``: nothing in the last 20 % of the window (the tail drains)."""
    if mode == "none" or not actions:
        return []
    usable = seconds * 0.8
    if mode == "once":
        step = usable / (len(actions) + 1)
        return [(step * (index + 1), action) for index, action in enumerate(actions)]
    schedule: list[tuple[float, str]] = []
    at, index = every, 0
    while at < usable:
        schedule.append((at, actions[index % len(actions)]))
        at += every
        index += 1
    return schedule


# -- what the metadata DB and the output hold -----------------------------------------------------
def body_order_id(envelope: Mapping[str, Any]) -> str | None:
    body = envelope.get("body")
    return str(body["order_id"]) if isinstance(body, dict) and isinstance(body.get("order_id"), str) else None


@dataclass
class Deliveries:
    """One watcher's asset events: each order's first event time (epoch), and every copy counted."""

    first: dict[str, float] = field(default_factory=dict)
    copies: int = 0
    # order id -> the broker message ids its events carried (a redelivery keeps its id; a second
    # publish of the order has another)
    message_ids: dict[str, set[str]] = field(default_factory=dict)


def delivered_per_watcher(topology: ProductionTopology, broker: str) -> dict[str, Deliveries]:
    out: dict[str, Deliveries] = {}
    for watcher in topology.watcher_roles(broker):
        seen = Deliveries()
        for event in topology.env.asset_events(watcher):
            stamp = to_epoch(event.get("timestamp"))
            for envelope in envelopes(event.get("extra"), upstream_text=True):
                order_id = body_order_id(envelope)
                if order_id and stamp is not None:
                    seen.copies += 1
                    seen.first.setdefault(order_id, stamp)
                    message_id = envelope.get("message_id")
                    if isinstance(message_id, str):
                        seen.message_ids.setdefault(order_id, set()).add(message_id)
        out[watcher] = seen
    return out


def run_times(topology: ProductionTopology, dag_id: str, first_task: str, last_task: str) -> dict[str, Hops]:
    """``run_id -> Hops(queued, started, written)`` of every run of ``dag_id`` (epoch seconds)."""
    rows = topology.env.query_db(
        "SELECT dr.run_id, dr.queued_at, tf.start_date, tl.end_date FROM dag_run dr "
        "LEFT JOIN task_instance tf ON tf.dag_id = dr.dag_id AND tf.run_id = dr.run_id AND tf.task_id = ? "
        "LEFT JOIN task_instance tl ON tl.dag_id = dr.dag_id AND tl.run_id = dr.run_id AND tl.task_id = ? "
        "WHERE dr.dag_id = ?",
        (first_task, last_task, dag_id),
    )
    return {
        str(run_id): Hops(queued=to_epoch(queued), started=to_epoch(started), written=to_epoch(written))
        for run_id, queued, started, written in rows
    }


def pipeline_task_times(topology: ProductionTopology, dag_id: str) -> dict[str, dict[str, Any]]:
    """
    Where a pipeline run's time goes, per task: ``wait`` (queued -> started: an executor slot
    and the scheduler) and ``ran`` (started -> ended), each as :func:`summary` over every run.
    """
    rows = topology.env.query_db(
        "SELECT task_id, queued_dttm, start_date, end_date FROM task_instance WHERE dag_id = ?", (dag_id,)
    )
    waits: dict[str, list[float]] = defaultdict(list)
    runs: dict[str, list[float]] = defaultdict(list)
    for task_id, queued, started, ended in rows:
        queued_at, started_at, ended_at = to_epoch(queued), to_epoch(started), to_epoch(ended)
        if queued_at is not None and started_at is not None:
            waits[str(task_id)].append(started_at - queued_at)
        if started_at is not None and ended_at is not None:
            runs[str(task_id)].append(ended_at - started_at)
    return {
        task_id: {"wait": summary(waits.get(task_id, [])), "ran": summary(runs.get(task_id, []))}
        for task_id in sorted(set(waits) | set(runs))
    }


def batch_id_for(run_id: str) -> str:
    """The pipeline's partition name of a run (example_dags/orders_spark.batch_id_for)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


def pipeline_hops(
    topology: ProductionTopology, broker: str, delivered: Mapping[str, Deliveries] | None = None
) -> dict[str, Hops]:
    """
    Per order in the output table: its first asset event (the pipeline's watcher), and the run
    that **wrote** it (its ``batch_id``): queued, ``extract`` started, ``aggregate`` ended.

    Read from the table rather than from the runs' triggering events: a run also processes the
    events stored since the previous success (example_dags/orders_spark.events_to_process), so
    the run that wrote an order is not always one its event triggered.
    """
    import pyarrow.dataset as ds

    stream = topology.streams[broker]
    runs = {
        batch_id_for(run_id): hop
        for run_id, hop in run_times(topology, stream.spark_dag, "extract", "aggregate").items()
    }
    # ``delivered``: delivered_per_watcher's answer when the caller has it (one read of every watcher's events).
    delivered = delivered if delivered is not None else delivered_per_watcher(topology, broker)
    events = delivered[stream.watcher_name("kafka_orders_valid")].first
    path = topology.output_dir / broker / "order_lines"
    if not path.exists() or not any(path.glob("batch_id=*/*.parquet")):
        return {}
    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table(columns=["order_id", "batch_id"])
    hops: dict[str, Hops] = {}
    for row in table.to_pylist():
        run = runs.get(str(row["batch_id"]), Hops())
        order_id = str(row["order_id"])
        hops[order_id] = Hops(event=events.get(order_id), queued=run.queued, started=run.started, written=run.written)
    return hops


ACCESS_LINE: Final = re.compile(
    r"^(?P<at>\S+)Z .*duration_us=(?P<us>\d+) .*path=/execution/asset-events/by-asset query='(?P<query>[^']*)'"
)


def pipeline_event_reads(topology: ProductionTopology, brokers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """
    Per broker, its pipeline's reads of its source's events (``inlet_events``, from one pass over
    the api-server's access log): how many read the whole history (no ``after``) and how many since
    the progress mark, their slowest, and the whole-history reads that finished after the first
    successful run ended, when the mark was set (example_dags/orders_spark.py
    ``record_progress``): 0, or every run re-reads a history that only grows.
    """
    asset_broker = {topology.streams[b].watcher_name("kafka_orders_valid"): b for b in brokers}
    first_success_end: dict[str, float | None] = {}
    for broker in brokers:
        rows = topology.env.query_db(
            "SELECT min(end_date) FROM dag_run WHERE dag_id = ? AND state = 'success'",
            (topology.streams[broker].spark_dag,),
        )
        first_success_end[broker] = to_epoch(rows[0][0]) if rows else None
    reads = {b: {"whole_history": 0, "since_mark": 0, "whole_after_mark": 0, "slowest_s": 0.0} for b in brokers}
    log = topology.env.airflow_home / "process-logs" / "api-server.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else ():
        match = ACCESS_LINE.match(line)
        name = re.match(r"name=([^&]*)", match["query"]) if match else None
        owner = asset_broker.get(name[1]) if name else None
        if match is None or owner is None:
            continue
        counts = reads[owner]
        counts["slowest_s"] = max(counts["slowest_s"], int(match["us"]) / 1e6)
        if "after=" in match["query"]:
            counts["since_mark"] += 1
            continue
        counts["whole_history"] += 1
        finished = datetime.fromisoformat(match["at"]).replace(tzinfo=timezone.utc).timestamp()
        end = first_success_end[owner]
        if end is not None and finished > end:
            counts["whole_after_mark"] += 1
    return reads


def pipeline_run_stats(topology: ProductionTopology, broker: str) -> tuple[int, int]:
    """(runs of the pipeline, most asset events one run was created for): the scheduler's merging."""
    stream = topology.streams[broker]
    rows = topology.env.query_db(
        "SELECT dr.id, count(d.event_id) FROM dag_run dr LEFT JOIN dagrun_asset_event d ON d.dag_run_id = dr.id "
        "WHERE dr.dag_id = ? GROUP BY dr.id",
        (stream.spark_dag,),
    )
    return len(rows), max((int(count) for _, count in rows), default=0)


def pair_hops(topology: ProductionTopology, asset: str) -> dict[str, Hops]:
    """
    Per order, a latency-pair watcher's first event and the run that event fed (the pair's Dags
    have one task: "started" is comparable with the pipeline's, "written" is that task's end).
    """
    rows = topology.env.query_db(
        "SELECT e.timestamp, e.extra, dr.queued_at, ti.start_date, ti.end_date "
        "FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "LEFT JOIN dagrun_asset_event d ON d.event_id = e.id "
        "LEFT JOIN dag_run dr ON dr.id = d.dag_run_id AND dr.dag_id = ? "
        "LEFT JOIN task_instance ti ON ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id AND ti.task_id = ? "
        "WHERE a.name = ? ORDER BY e.id",
        (pair_dag(asset), "handle_orders", asset),
    )
    hops: dict[str, Hops] = {}
    for stamp, extra, queued, started, ended in rows:
        for envelope in envelopes(extra, upstream_text=True):
            order_id = body_order_id(envelope)
            if order_id:
                candidate = Hops(
                    event=to_epoch(stamp), queued=to_epoch(queued), started=to_epoch(started), written=to_epoch(ended)
                )
                hops.setdefault(order_id, Hops()).merge(candidate)
    return hops


def pair_check(hops: Mapping[str, Mapping[str, Hops]], sent_at: Mapping[str, float]) -> dict[str, dict[str, int]]:
    """Per latency-pair watcher (its :func:`pair_hops`): orders published, with an event, with a finished task; lost."""
    wanted = set(sent_at)
    return {
        asset: {
            "orders": len(wanted),
            "with_event": len(wanted & seen.keys()),
            "task_ended": sum(1 for order_id in wanted if order_id in seen and seen[order_id].written is not None),
            "lost": len(wanted - seen.keys()),
        }
        for asset, seen in hops.items()
    }


def pair_hops_all(topology: ProductionTopology) -> dict[str, dict[str, Hops]]:
    return {asset: pair_hops(topology, asset) for asset in LATENCY_PAIR}


def pair_done(topology: ProductionTopology, publisher: Publisher) -> bool:
    """
    Every order has both watchers' events and neither Dag has a run to go. Not "every order's
    task ended": neither twin has ``flush_after``, so the tail of the publishing that arrived
    while the last run ran waits for an event that never comes (Airflow 3.3, apache/airflow#56050),
    the same on both sides; ``task_ended`` counts what the runs took.
    """
    checked = pair_check(pair_hops_all(topology), first_sent(publisher))
    complete = all(c["with_event"] == c["orders"] for c in checked.values())
    return complete and all(topology.env.dag_idle(pair_dag(asset)) for asset in LATENCY_PAIR)


def output_order_ids(dataset_dir: Path) -> Counter[str]:
    """``order_id -> rows`` in the pipeline's ``order_lines`` Parquet dataset (pyarrow: no JVM)."""
    import pyarrow.dataset as ds

    path = dataset_dir / "order_lines"
    if not path.exists() or not any(path.glob("batch_id=*/*.parquet")):
        return Counter()
    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table(columns=["order_id"])
    return Counter(str(v) for v in table.column("order_id").to_pylist())


def published_revenue(sent: Sequence[Sent]) -> dict[tuple[str, str], tuple[int, float]]:
    """``(region, minute) -> (orders, revenue)`` of the valid orders, each order once."""
    totals: dict[tuple[str, str], tuple[int, float]] = {}
    seen: set[str] = set()
    for item in sent:
        fired, _ = expected_watchers(item.message)
        if "kafka_orders_valid" not in fired or item.order_id in seen or item.order_id is None:
            continue
        seen.add(item.order_id)
        body = item.message.body()
        minute = datetime.fromisoformat(str(body["created_at"]).replace("Z", "+00:00"))
        key = (str(body["region"]), minute.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M"))
        orders, revenue = totals.get(key, (0, 0.0))
        totals[key] = (orders + 1, revenue + float(body["amount"]))
    return {key: (orders, round(revenue, 2)) for key, (orders, revenue) in totals.items()}


# -- checks ---------------------------------------------------------------------------------------
@dataclass
class BrokerCheck:
    broker: str
    published: int
    malformed: int
    duplicates: int
    valid_orders: int
    lost: dict[str, int]
    missed_while_paused: dict[str, int]
    redelivered: dict[str, int]
    output_missing: int
    output_twice: int
    revenue_groups_wrong: int
    dead_lettered: int
    settled: str
    settled_ok: bool
    runs: int
    events_per_run_max: int
    publish_errors: int
    event_reads: dict[str, Any] = field(default_factory=dict)
    # Per watcher, the first missing order ids (not explained by a pause) with their publish time:
    # what to look for in the logs when ``lost`` is not 0.
    # Each entry: (order id, publish time, when the watcher fired an event for it per the
    # triggerers' logs, or None: never, or only in a batch).
    lost_ids: dict[str, list[tuple[str, float, float | None]]] = field(default_factory=dict)
    # Per paused watcher, how many of its misses each reason of pause_reason explains.
    missed_while_paused_why: dict[str, dict[str, int]] = field(default_factory=dict)
    # Per watcher, the broker's message ids (Kafka: topic/partition/offset) of each order it misses,
    # lost or explained, as its siblings received them: where to look in the triggerers' logs.
    missing_message_ids: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not any(self.lost.values())
            and self.output_missing == 0
            and self.output_twice == 0
            and self.revenue_groups_wrong == 0
            and self.dead_lettered >= self.malformed
            and self.settled_ok
            and self.publish_errors == 0
            and not self.event_reads.get("whole_after_mark")
        )


def expected_per_watcher(
    roles: Mapping[str, WatcherRole], sent: Sequence[Sent]
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """
    Per watcher of ``roles`` (``ProductionTopology.watcher_roles``): ``order_id -> sent_at`` of
    every order it must fire on, and how many published messages it must fire on (a duplicated
    order is published twice: what it receives beyond that is redelivered).
    """
    wanted: dict[str, dict[str, float]] = {name: {} for name in roles}
    copies: dict[str, int] = dict.fromkeys(roles, 0)
    for item in sent:
        if item.order_id is None:
            continue
        facts = MessageFacts.of(item.message)
        for watcher, role in roles.items():
            if role.fires(facts):
                wanted[watcher].setdefault(item.order_id, item.sent_at)
                copies[watcher] += 1
    return wanted, copies


LOST_IDS_SHOWN: Final = 50


def in_pause(moment: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(start <= moment <= end for start, end in windows)


PUBLISHED_WHILE_PAUSED: Final = "published while paused"
FIRED_FOR_NO_ASSET: Final = "fired after the pause began, stored for no asset"
SIBLINGS_AFTER_PAUSE: Final = "its siblings' events came after the pause began"


def pause_reason(
    published_at: float,
    siblings_first_event: float | None,
    windows: Sequence[tuple[float, float]],
    *,
    replays: bool,
    fired_at: float | None = None,
) -> str | None:
    """
    Why the paused watcher's miss of one message is its Dag's pause (not a loss), or None.

    * the message was published during a pause (the watcher was away);
    * a broker that cannot replay what it settled (``replays`` False): the watcher fired an event
      for it after a pause began under a trigger id it no longer runs as (``fired_at``, from the
      triggerers' logs) and Airflow stored it for no asset: Airflow 3.3 drops the watcher's
      trigger at the next parse after the pause and cancels it a loop later, and an event fired
      in between is "persisted" nowhere (docs/production.md, finding 11), while the broker settled
      the message for its siblings;
    * likewise, its siblings' first event for it came after a pause began (the proxy for a message
      still queued for the watcher when it was cancelled; it misjudges a watcher that lags).

    Kafka (``replays``) replays all of those for a watcher that comes back re-created, the
    messages published while it was away included, so there nothing explains a miss: it is a
    loss. (Until 2026-11-28 the publish window excused one there; the misses it excused were the
    loss of finding 12 in docs/production.md.)
    """
    if replays:
        return None
    if in_pause(published_at, windows):
        return PUBLISHED_WHILE_PAUSED
    if not windows:
        return None
    if fired_at is not None and any(fired_at >= start for start, _ in windows):
        return FIRED_FOR_NO_ASSET
    if siblings_first_event is not None and any(siblings_first_event >= start for start, _ in windows):
        return SIBLINGS_AFTER_PAUSE
    return None


def first_fired(message_ids: Iterable[str], fired: Mapping[str, float]) -> float | None:
    """When an event for any of an order's ``message_ids`` was first fired, per ``fired`` (None: never)."""
    return min((fired[m] for m in message_ids if m in fired), default=None)


def check_broker(
    topology: ProductionTopology,
    broker: str,
    publisher: Publisher,
    pauses: Sequence[tuple[float, float]],
    logs: TriggererLogs | None = None,
) -> BrokerCheck:
    """The end's checks of the module docstring for ``broker``; ``logs``: the triggerers' (read again here)."""
    stream = topology.streams[broker]
    sent = publisher.sent
    roles = topology.watcher_roles(broker)
    expected, copies = expected_per_watcher(roles, sent)
    delivered = delivered_per_watcher(topology, broker)
    paused_watcher = stream.watchers[0]
    lost: dict[str, int] = {}
    lost_ids: dict[str, list[tuple[str, float, float | None]]] = {}
    missed_paused: dict[str, int] = {}
    missed_why: dict[str, dict[str, int]] = {}
    missing_ids: dict[str, dict[str, list[str]]] = {}
    siblings_first: dict[str, float] = {}
    message_ids: dict[str, set[str]] = defaultdict(set)
    for watcher, seen in delivered.items():
        for order_id, ids in seen.message_ids.items():
            message_ids[order_id] |= ids
        if watcher != paused_watcher:
            for order_id, stamp in seen.first.items():
                siblings_first[order_id] = min(stamp, siblings_first.get(order_id, stamp))
    if logs is not None:
        logs.refresh()
    for watcher, wanted in expected.items():
        got = delivered[watcher].first
        missing = [order_id for order_id in wanted if order_id not in got]
        if missing:
            missing_ids[watcher] = {
                order_id: sorted(message_ids.get(order_id, ())) for order_id in missing[:LOST_IDS_SHOWN]
            }
        fired: dict[str, float] = {}
        # Only a trigger the watcher no longer runs as can have fired an event Airflow stored for
        # no asset: the newest one is still referenced, and what it fires is stored.
        fired_replaced: dict[str, float] = {}
        if logs is not None and missing:
            fired = logs.fired(watcher)
            fired_replaced = logs.fired(watcher, replaced_triggers_only=True)
        windows = pauses if watcher == paused_watcher else ()
        reasons = {
            order_id: pause_reason(
                wanted[order_id],
                siblings_first.get(order_id),
                windows,
                replays=broker == "kafka",
                fired_at=first_fired(message_ids.get(order_id, ()), fired_replaced),
            )
            for order_id in missing
        }
        why = Counter(reason for reason in reasons.values() if reason is not None)
        missed_paused[watcher] = sum(why.values())
        if why:
            missed_why[watcher] = dict(why)
        unexplained = [order_id for order_id, reason in reasons.items() if reason is None]
        lost[watcher] = len(unexplained)
        if unexplained:
            lost_ids[watcher] = [
                (order_id, wanted[order_id], first_fired(message_ids.get(order_id, ()), fired))
                for order_id in unexplained[:LOST_IDS_SHOWN]
            ]
    valid_ids = set(expected[stream.watcher_name("kafka_orders_valid")])
    rows = output_order_ids(topology.output_dir / broker)
    revenue_published = published_revenue(sent)
    revenue_output = spark_revenue(topology.output_dir / broker)
    wrong_groups = sum(
        1
        for key in set(revenue_published) | set(revenue_output)
        if revenue_published.get(key) != revenue_output.get(key)
    )
    settlement = stream.settlement()
    runs, most_events = pipeline_run_stats(topology, broker)
    return BrokerCheck(
        broker=broker,
        published=len(sent),
        malformed=sum(1 for item in sent if expected_watchers(item.message)[1]),
        duplicates=sum(1 for item in sent if item.duplicate),
        valid_orders=len(valid_ids),
        lost=lost,
        missed_while_paused=missed_paused,
        # Copies beyond what was published (a duplicated order is two messages: not a redelivery).
        redelivered={watcher: max(0, seen.copies - copies[watcher]) for watcher, seen in delivered.items()},
        output_missing=len(valid_ids - set(rows)),
        output_twice=sum(1 for count in rows.values() if count > 1),
        revenue_groups_wrong=wrong_groups,
        dead_lettered=stream.dead_lettered(),
        settled=f"{settlement.settled} of {settlement.total}: {settlement.detail}",
        settled_ok=settlement.complete,
        runs=runs,
        events_per_run_max=most_events,
        publish_errors=len(publisher.errors),
        lost_ids=lost_ids,
        missed_while_paused_why=missed_why,
        missing_message_ids=missing_ids,
    )


def drained(
    topology: ProductionTopology,
    broker: str,
    publisher: Publisher,
    pauses: Sequence[tuple[float, float]],
    logs: TriggererLogs | None = None,
) -> bool:
    check = check_broker(topology, broker, publisher, pauses, logs)
    runs_idle = all(topology.env.dag_idle(dag_id) for dag_id in topology.streams[broker].consumer_dags)
    return check.ok and runs_idle


# -- latency --------------------------------------------------------------------------------------
def first_sent(publisher: Publisher) -> dict[str, float]:
    sent_at: dict[str, float] = {}
    for item in publisher.sent:
        if item.order_id is not None:
            sent_at.setdefault(item.order_id, item.sent_at)
    return sent_at


def hop_latency(hops: Mapping[str, Hops], sent_at: Mapping[str, float], started: float) -> dict[str, Any]:
    """p50 / p95 / max of publish -> each stage, and publish -> written's p95 per window of publish time."""
    stages: dict[str, list[float]] = defaultdict(list)
    windows: dict[int, list[float]] = defaultdict(list)
    for order_id, hop in hops.items():
        published = sent_at.get(order_id)
        if published is None:
            continue
        for name, value in (
            ("event", hop.event),
            ("queued", hop.queued),
            ("started", hop.started),
            ("written", hop.written),
        ):
            if value is not None:
                stages[f"publish_to_{name}"].append(value - published)
        if hop.written is not None:
            windows[int((published - started) // WINDOW_SECONDS)].append(hop.written - published)
    return {
        "pipeline": {name: summary(values) for name, values in stages.items()},
        "written_p95_ms_per_window": {
            f"{int(index * WINDOW_SECONDS // 60)}-{int((index + 1) * WINDOW_SECONDS // 60)} min": summary(values)[
                "p95_ms"
            ]
            for index, values in sorted(windows.items())
        },
    }


def latency(topology: ProductionTopology, broker: str, publisher: Publisher, started: float) -> dict[str, Any]:
    sent_at = first_sent(publisher)
    delivered = delivered_per_watcher(topology, broker)
    hops = pipeline_hops(topology, broker, delivered)
    per_watcher = {
        watcher: summary([stamp - sent_at[o] for o, stamp in seen.first.items() if o in sent_at])
        for watcher, seen in delivered.items()
    }
    return {
        **hop_latency(hops, sent_at, started),
        "pipeline_tasks": pipeline_task_times(topology, topology.streams[broker].spark_dag),
        "publish_to_event_per_watcher": per_watcher,
        "watchers": list(topology.watcher_roles(broker)),
    }


# -- the run --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.production", description=__doc__.split("\n\n")[0])
    add_topology_arguments(parser)  # --brokers, --spark, --batch-size, ..., --ha
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=2.0, help="messages per second per broker")
    parser.add_argument("--chaos", choices=("once", "loop", "none"), default="loop")
    parser.add_argument("--chaos-every", type=float, default=180.0, help="seconds between actions (--chaos loop)")
    parser.add_argument("--actions", default=",".join(ACTIONS))
    parser.add_argument("--pause-seconds", type=float, default=60.0)
    parser.add_argument("--drain-timeout", type=float, default=900.0)
    parser.add_argument("--stress", type=int, default=0, help="CPU-burning processes beside the topology")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-files", action="store_true")
    return parser.parse_args(argv)


@contextlib.contextmanager
def stressed(workers: int) -> Iterator[None]:
    if workers <= 0:
        yield
        return
    from devkit.stress import cpu_stress

    with cpu_stress(workers):
        yield


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    # The checks read the dead-letter topic with aiokafka every few seconds: its INFO lines are noise.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    brokers = [name.strip() for name in args.brokers.split(",") if name.strip()]
    actions = [name.strip() for name in args.actions.split(",") if name.strip()]
    unknown = sorted(set(actions) - set(ACTIONS))
    if unknown:
        raise SystemExit(f"unknown chaos actions {unknown}; choose from {', '.join(ACTIONS)}")
    if not args.pipeline and (args.chaos != "none" or not args.upstream_kafka or "kafka" not in brokers):
        raise SystemExit("--no-pipeline runs the latency pair alone: give --upstream-kafka, kafka and --chaos none")
    workdir = Path(tempfile.mkdtemp(prefix="bench-production-"))
    seconds = args.minutes * 60.0
    topology = ProductionTopology.from_args(args, brokers, workdir)
    result: dict[str, Any] = {
        "args": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count()},
    }
    publishers: dict[str, Publisher] = {}
    chaos: Chaos | None = None
    try:
        with stressed(args.stress):
            boot = time.monotonic()
            say(f"starting the topology in {workdir} ...")
            topology.start(say=lambda line: say(str(line)))
            result["startup_s"] = round(time.monotonic() - boot, 1)
            result["ha_mode"] = topology.ha_mode
            say(topology.describe())
            started = time.time()
            for index, broker in enumerate(brokers):
                publishers[broker] = Publisher(broker, topology.streams[broker], args.rate, seconds, args.seed + index)
                publishers[broker].start()
            schedule = chaos_schedule(args.chaos, seconds, args.chaos_every, actions)
            chaos = Chaos(topology, schedule, args.pause_seconds, say, publishers)
            chaos.start()
            while any(p.is_alive() for p in publishers.values()):
                time.sleep(min(30.0, max(1.0, seconds / 10)))
                topology.env.check_alive()
                say(
                    f"  t={time.time() - started:6.0f}s published "
                    + ", ".join(f"{b}={len(p.sent)}" for b, p in publishers.items())
                )
            # The schedule lies inside the publish window, but an action may wait (a Spark job, a
            # pause): let the last one finish before the drain starts.
            chaos.join(timeout=900)
            publish_end = time.time()
            say("publishing done; draining ...")
            logs = TriggererLogs(topology.env.airflow_home / "process-logs")
            deadline = time.monotonic() + args.drain_timeout
            pending = set(brokers) if args.pipeline else set()
            pair_pending = args.upstream_kafka
            while (pending or pair_pending) and time.monotonic() < deadline:
                topology.env.check_alive()
                pending = {b for b in pending if not drained(topology, b, publishers[b], chaos.log.pauses[b], logs)}
                pair_pending = pair_pending and not pair_done(topology, publishers["kafka"])
                if pending or pair_pending:
                    time.sleep(10)
            result["drain_s"] = round(time.time() - publish_end, 1)
            result["drained"] = not (pending or pair_pending)
            checks = (
                {b: check_broker(topology, b, publishers[b], chaos.log.pauses[b], logs) for b in brokers}
                if args.pipeline
                else {}
            )
            # Once, at the end (not in drained): it reads the api-server's whole log.
            for broker, reads in pipeline_event_reads(topology, list(checks)).items():
                checks[broker].event_reads = reads
            result["checks"] = {b: {**vars(c), "ok": c.ok} for b, c in checks.items()}
            result["latency"] = (
                {b: latency(topology, b, publishers[b], started) for b in brokers} if args.pipeline else {}
            )
            pair_ok = True
            if args.upstream_kafka:
                pair = pair_hops_all(topology)
                sent_at = first_sent(publishers["kafka"])
                result["latency_pair"] = pair_check(pair, sent_at)
                pair_ok = all(c["lost"] == 0 for c in result["latency_pair"].values())
                for asset, hops in pair.items():
                    result["latency"][asset] = {**hop_latency(hops, sent_at, started), "delivered_orders": len(hops)}
            result["chaos"] = {"events": chaos.log.events, "errors": chaos.errors}
            xcom_root = topology.xcom_root
            # XComs the object-storage backend wrote as files (None: every XCom is in the DB).
            result["xcom_files"] = None if xcom_root is None else sum(1 for f in xcom_root.rglob("*") if f.is_file())
            result["publish_errors"] = {b: p.errors[:5] for b, p in publishers.items() if p.errors}
            result["ok"] = all(c.ok for c in checks.values()) and pair_ok and not chaos.errors
            if not result["ok"]:
                # The evidence of a failure seen once: the triggerers' lines about the streams.
                result["triggerer_story"] = logs.story()
    finally:
        for publisher in publishers.values():
            publisher.stop_event.set()
        if chaos is not None:
            chaos.stop_event.set()
        topology.stop()
        if args.keep_files:
            say(f"files kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return result


def render(result: Mapping[str, Any]) -> str:
    lines = [
        f"production chaos run: {result['args']['brokers']} for {result['args']['minutes']} min at "
        f"{result['args']['rate']}/s per broker, batch_size {result['args']['batch_size']}, "
        f"HA mode {result.get('ha_mode')}, startup {result.get('startup_s')} s, drain {result.get('drain_s')} s"
    ]
    lines.append("")
    if result.get("checks"):  # none with --no-pipeline
        lines.append("| " + " | ".join(CHECK_COLUMNS) + " |")
        lines.append("|" + "---|" * len(CHECK_COLUMNS))
    for broker, c in result.get("checks", {}).items():
        lines.append(
            f"| {broker} | {c['published']} | {c['valid_orders']} | {c['duplicates']} | {c['malformed']} | "
            f"{sum(c['lost'].values())} | {sum(c['missed_while_paused'].values())} | "
            f"{sum(c['redelivered'].values())} | {c['output_missing']} | "
            f"{c['output_twice']} | {c['revenue_groups_wrong']} | {c['dead_lettered']} | {c['settled_ok']} | "
            f"{c['runs']} ({c['events_per_run_max']}) | {c['ok']} |"
        )
    for broker, c in result.get("checks", {}).items():
        lines.append(f"pipeline event reads {broker}: {c.get('event_reads')}")
    lines.append("")
    lines.append("| broker | hop | n | p50 ms | p95 ms | max ms |")
    lines.append("|---|---|---|---|---|---|")
    for broker, lat in result.get("latency", {}).items():
        for hop, s in lat["pipeline"].items():
            lines.append(f"| {broker} | {hop} | {s['n']} | {s['p50_ms']} | {s['p95_ms']} | {s['max_ms']} |")
        windows = ", ".join(f"{w}: {p}" for w, p in lat["written_p95_ms_per_window"].items())
        lines.append(f"| {broker} | publish_to_written p95 per window | | {windows} | | |")
        for task_id, times in lat.get("pipeline_tasks", {}).items():
            for part, t in times.items():
                cells = f"{t['n']} | {t['p50_ms']} | {t['p95_ms']} | {t['max_ms']}"
                lines.append(f"| {broker} | task {task_id} {part} | {cells} |")
    for asset, c in result.get("latency_pair", {}).items():
        lines.append(f"latency pair {asset}: {c}")
    lines.append("")
    for event in result.get("chaos", {}).get("events", []):
        lines.append(f"chaos {event}")
    for error in result.get("chaos", {}).get("errors", []):
        lines.append(f"chaos ERROR {error}")
    lines.append(f"result: {'OK' if result.get('ok') else 'FAILED'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # run()'s finally stops the topology; without this a `kill` of the bench left it running.
    interrupt_on_sigterm()
    started = datetime.now(timezone.utc)
    result = run(args, say=lambda line: print(line, flush=True))
    out = args.out or RESULTS / f"production-{started:%Y-%m-%d-%H%M}-{args.brokers.replace(',', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(render(result))
    print(f"results: {out}")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
