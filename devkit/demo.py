"""
The one-command demo: ``python -m devkit.demo``.

On embedded defaults (no Docker, no network) it starts a Kafka-compatible broker (Tansu), creates
the ``orders`` topic (3 partitions) and its dead-letter topic, starts a throwaway Airflow (SQLite,
``db migrate``, dag-processor, triggerer, scheduler, api-server), unpauses the example Dags of
``example_dags/example_kafka_orders.py``, publishes a stream of sample orders (some malformed) and
shows live progress: messages published, messages delivered per watcher, Dag runs by state, rows written
by the PySpark pipeline, the consumer group's committed offsets and the DLQ count. It ends with a
summary and stops every process it started (``--keep`` leaves them running until Ctrl-C).

Works without a TTY (plain progress lines instead of the live table). Options: ``--messages N``,
``--rate R`` (messages per second), ``--spark local|standalone|connect`` (where the PySpark task
runs; see :mod:`devkit.spark_cluster`), ``--broker kafka|sqs|pubsub|redis|servicebus`` (a moto
server, Google's Pub/Sub emulator, redis-server or the Service Bus test broker, and that broker's
example Dags; see :mod:`devkit.demo_streams`), ``--batch-size N``
(the triggers' ``batch_size``: up to N messages per asset event), ``--keep``, ``--timeout S``.

No "flush" message is published at the end: the watcher that feeds the PySpark pipeline has
``flush_after``, whose marker event brings the tail of the burst into a run (Airflow 3.3).

The scenario helpers (:func:`sample_orders`, :func:`expected_watchers`, :class:`KafkaOrders`) are
reused by ``tests/e2e``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from airflow_shared_stream_provider.brokers import harness_names
from devkit.airflow_env import AirflowEnv, AirflowEnvError

# The "X as X" names are re-exported: tests/e2e import them from here, where they were defined
# before demo_streams and demo_types took them over (to break an import circle).
# ruff: noqa: PLC0414
from devkit.demo_streams import KafkaOrders as KafkaOrders
from devkit.demo_streams import Published as Published
from devkit.demo_streams import kafka_connection as kafka_connection
from devkit.demo_types import GROUP_ID as GROUP_ID
from devkit.demo_types import KAFKA_DAG_FILES, Settlement
from devkit.demo_types import TOPIC as TOPIC
from devkit.demo_types import WATCHERS as WATCHERS
from devkit.demo_types import OrderMessage as OrderMessage
from devkit.latency import measure as measure_latency
from devkit.latency import render_lines as latency_lines
from devkit.spark_cluster import SparkCluster

if TYPE_CHECKING:
    from types import FrameType

    from devkit.demo_streams import DemoStream

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
EXAMPLE_DAGS: Final = REPO_ROOT / "example_dags"

# The Dags scheduled on the example watchers (WATCHERS: asset name == watcher name).
CONSUMER_DAGS: Final = (
    "kafka_orders_eu_consumer",
    "kafka_orders_us_apac_consumer",
    "kafka_orders_big_consumer",
    "kafka_orders_spark_pipeline",
)
SPARK_DAG: Final = "kafka_orders_spark_pipeline"
REGIONS: Final = ("eu", "us", "apac", "latam")
BIG_ORDER_AMOUNT: Final = 500.0
DEFAULT_MAX_PAYLOAD_BYTES: Final = 65536

# The connection the PySpark task uses in the demo and the tests: local, cheap on 2 cores.
SPARK_LOCAL_CONNECTION: Final = {
    "conn_type": "spark",
    "host": "local[2]",
    "extra": {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
}


# -- the scenario ---------------------------------------------------------------------------------
def make_order(order_id: str, region: str, amount: float, created_at: datetime, **extra: Any) -> OrderMessage:
    body = {
        "order_id": order_id,
        "region": region,
        "amount": round(amount, 2),
        "created_at": created_at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
        **extra,
    }
    kind = "poison" if extra.get("poison") else "order"
    return OrderMessage(order_id.encode(), json.dumps(body).encode(), kind)


def sample_orders(count: int, *, seed: int = 7, malformed_every: int = 20, prefix: str = "o") -> list[OrderMessage]:
    """
    ``count`` messages: well-formed orders over four regions and a few minutes, and every
    ``malformed_every``-th one malformed (invalid JSON, a JSON array, or an order without amount).
    """
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    messages: list[OrderMessage] = []
    for index in range(count):
        order_id = f"{prefix}{index:06d}"
        created = start + timedelta(seconds=rng.randrange(0, 300))
        if malformed_every and index % malformed_every == malformed_every - 1:
            variant = (index // malformed_every) % 3
            if variant == 0:
                messages.append(
                    OrderMessage(
                        order_id.encode(), b'{"order_id": "' + order_id.encode() + b'", "region":', "malformed-json"
                    )
                )
            elif variant == 1:
                messages.append(
                    OrderMessage(order_id.encode(), json.dumps([order_id, "eu", 12]).encode(), "not-an-order")
                )
            else:
                body = {"order_id": order_id, "region": "eu", "created_at": created.isoformat()}
                messages.append(OrderMessage(order_id.encode(), json.dumps(body).encode(), "not-an-order"))
            continue
        region = REGIONS[rng.randrange(len(REGIONS))]
        amount = rng.choice([rng.uniform(5, 499), rng.uniform(500, 2000)])
        messages.append(make_order(order_id, region, amount, created))
    return messages


def order_problem(body: Any) -> str | None:
    """Independent restatement of ``order_filters.order_problem`` on a parsed body (None = valid)."""
    if not isinstance(body, dict):
        return "not an object"
    if not isinstance(body.get("order_id"), str) or not body["order_id"]:
        return "order_id"
    if body.get("region") not in REGIONS:
        return "region"
    amount = body.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
        return "amount"
    return None


def expected_watchers(
    message: OrderMessage, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[set[str], bool]:
    """
    Which example watchers must fire on ``message`` and whether it must be dead-lettered.

    Written from the documented semantics (not from the provider's code): an oversize message fires
    nothing and is dead-lettered; otherwise ``match`` watchers fire on the region, the
    ``is_big_order`` watcher on valid orders >= 500, the ``require_valid_order`` watcher on valid
    orders, and it rejects (dead-letters) everything else.
    """
    if len(message.value) + 1024 > max_payload_bytes:
        return set(), True
    body = message.body()
    fired: set[str] = set()
    region = body.get("region") if isinstance(body, dict) else None
    if region == "eu":
        fired.add("kafka_orders_eu")
    if region in ("us", "apac"):
        fired.add("kafka_orders_us_apac")
    valid = order_problem(body) is None
    if valid:
        fired.add("kafka_orders_valid")
        if float(body["amount"]) >= BIG_ORDER_AMOUNT:
            fired.add("kafka_orders_big")
    return fired, not valid


def expected_revenue(messages: Iterable[OrderMessage]) -> dict[tuple[str, str], tuple[int, float]]:
    """``(region, minute) -> (orders, revenue)`` over the valid, non-oversize orders (unique keys)."""
    totals: dict[tuple[str, str], tuple[int, float]] = {}
    for message in messages:
        fired, _ = expected_watchers(message)
        if "kafka_orders_valid" not in fired:
            continue
        body = message.body()
        moment = datetime.fromisoformat(str(body["created_at"]).replace("Z", "+00:00")).astimezone(timezone.utc)
        key = (str(body["region"]), moment.strftime("%Y-%m-%dT%H:%M"))
        orders, revenue = totals.get(key, (0, 0.0))
        totals[key] = (orders + 1, revenue + float(body["amount"]))
    return {key: (orders, round(revenue, 2)) for key, (orders, revenue) in totals.items()}


def delivered_messages(env: AirflowEnv, watchers: Iterable[str]) -> dict[str, int]:
    """
    ``watcher -> messages its asset events carried``: one per event in the default mode, the length
    of ``messages`` in batch mode; ``flush_after`` markers carry none.
    """
    wanted = set(watchers)
    counts = dict.fromkeys(wanted, 0)
    for event in env.asset_events():
        name = str(event["name"])
        extra = event.get("extra")
        payload = extra.get("payload") if isinstance(extra, dict) else None
        if name not in wanted or not isinstance(payload, dict) or payload.get("marker"):
            continue
        messages = payload.get("messages")
        counts[name] += len(messages) if isinstance(messages, list) else 1
    return counts


# -- Spark output ---------------------------------------------------------------------------------
def spark_output_rows(dataset_dir: Path) -> dict[str, int]:
    """Rows in the pipeline's Parquet datasets (read with pyarrow: no JVM needed)."""
    counts = {"order_lines": 0, "revenue_by_region_minute": 0, "batches": 0}
    try:
        import pyarrow.dataset as ds
    except ImportError:  # pragma: no cover - pyarrow comes with the spark extra's pandas
        return counts
    for name in ("order_lines", "revenue_by_region_minute"):
        path = dataset_dir / name
        if path.exists() and any(path.glob("batch_id=*/*.parquet")):
            counts[name] = ds.dataset(str(path), format="parquet", partitioning="hive").count_rows()
    lines = dataset_dir / "order_lines"
    if lines.exists():
        counts["batches"] = sum(1 for p in lines.glob("batch_id=*") if any(p.glob("*.parquet")))
    return counts


def spark_revenue(dataset_dir: Path) -> dict[tuple[str, str], tuple[int, float]]:
    """``(region, minute) -> (orders, revenue)`` summed over every batch of the revenue dataset."""
    import pyarrow.dataset as ds

    path = dataset_dir / "revenue_by_region_minute"
    if not path.exists() or not any(path.glob("batch_id=*/*.parquet")):
        return {}
    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table(
        columns=["region", "minute", "orders", "revenue"]
    )
    totals: dict[tuple[str, str], tuple[int, float]] = {}
    for row in table.to_pylist():
        key = (str(row["region"]), str(row["minute"]))
        orders, revenue = totals.get(key, (0, 0.0))
        totals[key] = (orders + int(row["orders"]), revenue + float(row["revenue"]))
    return {key: (orders, round(revenue, 2)) for key, (orders, revenue) in totals.items()}


def spark_message_ids(dataset_dir: Path) -> list[str]:
    import pyarrow.dataset as ds

    path = dataset_dir / "order_lines"
    if not path.exists() or not any(path.glob("batch_id=*/*.parquet")):
        return []
    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table(columns=["message_id"])
    return [str(v) for v in table.column("message_id").to_pylist()]


# -- the Airflow side -----------------------------------------------------------------------------
def build_dags_folder(target: Path, files: Iterable[str] = KAFKA_DAG_FILES, extra: Iterable[Path] = ()) -> Path:
    """Copy the example Dag files (and any ``extra`` files) into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copy2(EXAMPLE_DAGS / name, target / name)
    for path in extra:
        shutil.copy2(path, target / path.name)
    return target


# -- the demo -------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    elapsed: float
    published: int
    events: dict[str, int]
    expected: dict[str, int]
    runs: dict[str, dict[str, int]]
    spark_rows: dict[str, int]
    settlement: Settlement
    dlq: int
    expected_dlq: int


def render_table(snapshot: Snapshot, stream: DemoStream[Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"airflow-shared-stream demo  ({snapshot.elapsed:5.0f}s)", expand=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("detail")
    table.add_row("messages published", str(snapshot.published), f"{stream.broker} {stream.source_label}")
    for name in stream.watchers:
        table.add_row(
            f"messages delivered {name}",
            str(snapshot.events.get(name, 0)),
            f"expected {snapshot.expected.get(name, 0)}",
        )
    for dag_id in stream.consumer_dags:
        states = snapshot.runs.get(dag_id, {})
        table.add_row(
            f"runs {dag_id}", str(sum(states.values())), ", ".join(f"{k}={v}" for k, v in sorted(states.items()))
        )
    table.add_row(
        "PySpark output rows",
        str(snapshot.spark_rows.get("order_lines", 0)),
        f"revenue rows {snapshot.spark_rows.get('revenue_by_region_minute', 0)}, "
        f"batches {snapshot.spark_rows.get('batches', 0)}",
    )
    settlement = snapshot.settlement
    table.add_row("settled", f"{settlement.settled}/{settlement.total}", settlement.detail)
    table.add_row("dead-lettered", str(snapshot.dlq), f"{stream.dlq_label}, expected {snapshot.expected_dlq}")
    return table


def render_line(snapshot: Snapshot, stream: DemoStream[Any]) -> str:
    prefix = f"{stream.broker}_orders_"
    events = " ".join(
        f"{name.removeprefix(prefix)}={snapshot.events.get(name, 0)}/{snapshot.expected.get(name, 0)}"
        for name in stream.watchers
    )
    spark_states = snapshot.runs.get(stream.spark_dag, {})
    return (
        f"[{snapshot.elapsed:5.0f}s] published={snapshot.published} events: {events} | "
        f"spark runs {dict(sorted(spark_states.items()))} rows={snapshot.spark_rows.get('order_lines', 0)} | "
        f"settled={snapshot.settlement.settled}/{snapshot.settlement.total} "
        f"dlq={snapshot.dlq}/{snapshot.expected_dlq}"
    )


class _InterruptedError(Exception):
    pass


def run_demo(args: argparse.Namespace) -> int:
    from devkit.demo_streams import STREAMS

    started = time.monotonic()
    interactive = sys.stdout.isatty() and not args.plain
    say = print

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise _InterruptedError(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="shared-stream-demo-"))
    output_dir = workdir / "output"
    stream = STREAMS[args.broker]()
    watchers, consumer_dags = stream.watchers, stream.consumer_dags
    valid_watcher = stream.watcher_name("kafka_orders_valid")
    env: AirflowEnv | None = None
    spark_cluster: SparkCluster | None = None
    publisher: threading.Thread | None = None
    stop_publishing = threading.Event()
    exit_code = 0
    try:
        say(f"work dir: {workdir}")
        say(f"starting the local {args.broker} broker ...")
        say(f"  {stream.start()}")

        spark_connection: dict[str, Any] = SPARK_LOCAL_CONNECTION
        if args.spark != "local":
            # --spark standalone|connect: the pipeline's connection points at a local cluster.
            connect = args.spark == "connect"
            say(f"starting a Spark cluster: master + 2 workers{' + Spark Connect server' if connect else ''} ...")
            spark_cluster = SparkCluster(connect=connect)
            spark_cluster.start()
            if connect:
                spark_connection = spark_cluster.connect_connection()
                say(f"  {spark_cluster.connect_url} (master {spark_cluster.master_url})")
            else:
                spark_connection = spark_cluster.standalone_connection()
                say(f"  {spark_cluster.master_url} (UI {spark_cluster.master_ui_url})")

        dags = build_dags_folder(workdir / "dags", files=stream.dag_files)
        env = AirflowEnv(
            dags,
            connections={**stream.connections(), "spark_orders": spark_connection},
            env={
                "ORDERS_OUTPUT_DIR": str(output_dir),
                "ORDERS_SPARK_CONN_ID": "spark_orders",
                "ORDERS_BATCH_SIZE": str(args.batch_size),
                **stream.dag_env(),
            },
            triggerer={"shared_stream_ack_timeout": 120.0},
            home=workdir / "airflow-home",
            startup_timeout=args.timeout,
        )
        say("starting Airflow: db migrate, dag-processor, triggerer, scheduler, api-server ...")
        env.start()
        say(f"  Airflow UI / REST API: {env.login_hint()}")
        env.wait_for_dags(consumer_dags, timeout=args.timeout)
        env.unpause(consumer_dags)
        env.wait_for_watchers(watchers, timeout=args.timeout)
        say(
            f"  {len(consumer_dags)} Dags unpaused; {len(watchers)} watchers share one consumer of "
            f"{stream.source_label}"
        )

        messages = sample_orders(args.messages)
        expected: dict[str, int] = dict.fromkeys(watchers, 0)
        expected_dlq = 0
        for message in messages:
            fired, dead = expected_watchers(message)
            for name in fired:
                expected[stream.watcher_name(name)] += 1
            expected_dlq += int(dead)
        say(f"publishing {len(messages)} orders at {args.rate}/s ({expected_dlq} malformed) ...")
        publisher = threading.Thread(
            target=stream.publish, args=(messages,), kwargs={"rate": args.rate, "stop": stop_publishing}, daemon=True
        )
        publisher.start()

        deadline = time.monotonic() + args.timeout + len(messages) / max(args.rate, 0.1)
        snapshot: Snapshot | None = None

        def take() -> Snapshot:
            env_ = env
            assert env_ is not None
            return Snapshot(
                elapsed=time.monotonic() - started,
                published=stream.published,
                events=delivered_messages(env_, watchers),
                expected=expected,
                runs={dag_id: env_.dag_run_states(dag_id) for dag_id in consumer_dags},
                spark_rows=spark_output_rows(output_dir / args.broker),
                settlement=stream.settlement(),
                dlq=stream.dead_lettered(),
                expected_dlq=expected_dlq,
            )

        def done(s: Snapshot) -> bool:
            runs_idle = all(not st.get("running") and not st.get("queued") for st in s.runs.values())
            return (
                s.published >= len(messages)
                and all(s.events.get(n, 0) >= expected[n] for n in watchers)
                and s.settlement.complete
                and s.dlq >= expected_dlq
                and runs_idle
                and s.spark_rows.get("order_lines", 0) >= expected[valid_watcher]
            )

        def step() -> Snapshot:
            # No flush message: Airflow 3.3 strands the events of a burst that arrive while a run
            # waits to be created; the pipeline's watcher has flush_after, so its marker event
            # queues the run that takes them (example_dags/order_events.pipeline_flush_after).
            env_ = env
            assert env_ is not None
            env_.check_alive()
            return take()

        if interactive:
            from rich.live import Live

            with Live(render_table(take(), stream), refresh_per_second=1, transient=False) as live:
                while True:
                    snapshot = step()
                    live.update(render_table(snapshot, stream))
                    if done(snapshot) or time.monotonic() > deadline:
                        break
                    time.sleep(args.interval)
        else:
            while True:
                snapshot = step()
                say(render_line(snapshot, stream), flush=True)
                if done(snapshot) or time.monotonic() > deadline:
                    break
                time.sleep(args.interval)

        assert snapshot is not None
        ok = done(snapshot)
        revenue = spark_revenue(output_dir / args.broker)
        settlement = snapshot.settlement
        say("")
        say("summary")
        say(f"  messages published : {snapshot.published} to {stream.source_label}")
        for name in watchers:
            say(f"  messages delivered {name:<25}: {snapshot.events.get(name, 0)} (expected >= {expected[name]})")
        for dag_id in consumer_dags:
            say(f"  Dag runs {dag_id:<30}: {dict(sorted(snapshot.runs.get(dag_id, {}).items()))}")
        total_revenue = round(sum(r for _, r in revenue.values()), 2)
        say(
            f"  PySpark output     : {snapshot.spark_rows} {len(revenue)} region/minute groups, revenue={total_revenue}"
        )
        say(f"  settled            : {settlement.settled} of {settlement.total}: {settlement.detail}")
        say(f"  dead-lettered      : {snapshot.dlq} (expected {expected_dlq}) in {stream.dlq_label}")
        # This run's own latency, from the broker's publish stamp (envelope published_at) to the
        # metadata DB's asset event, Dag run, task start and the Parquet write (aggregate's end).
        latency = measure_latency(env, asset=valid_watcher, dag_id=stream.spark_dag, watchers=watchers)
        for line in latency_lines(latency):
            say(f"  {line}")
        say(f"  result             : {'OK' if ok else 'INCOMPLETE (timed out)'}")
        exit_code = 0 if ok else 1
        if args.keep:
            say(f"--keep: everything keeps running. UI: {env.login_hint()}. Ctrl-C to stop.")
            while True:
                env.check_alive()
                time.sleep(5)
    except (KeyboardInterrupt, _InterruptedError):
        say("\ninterrupted: cleaning up")
        exit_code = 130
    except AirflowEnvError as exc:
        say(f"\nAirflow failed: {exc}")
        exit_code = 1
    finally:
        stop_publishing.set()
        if publisher is not None:
            publisher.join(timeout=30)
        if env is not None:
            env.stop()
        stream.stop()
        if spark_cluster is not None:
            spark_cluster.stop()
        if not args.keep_files:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"files kept in {workdir}")
        say(f"total run time: {time.monotonic() - started:.1f}s")
    return exit_code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.demo", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--messages", type=int, default=200, help="orders to publish (default 200)")
    parser.add_argument("--rate", type=float, default=20.0, help="messages per second (default 20)")
    parser.add_argument(
        "--broker",
        # Every registry broker with a demo stream (harness.demo), named without importing any.
        choices=list(harness_names("demo")),
        default="kafka",
        help="kafka (Tansu, default), sqs (moto server), pubsub (Google's emulator), redis (redis-server) or "
        "servicebus (the wire-level Service Bus test broker), or any broker with a demo stream: same scenario, "
        "that broker's example Dags",
    )
    parser.add_argument(
        "--spark",
        choices=["local", "standalone", "connect"],
        default="local",
        help="where the PySpark pipeline runs: local[2] in the task (default), a local standalone cluster "
        "(master + 2 workers) or a Spark Connect server on it (devkit.spark_cluster)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="messages per asset event (the triggers' batch_size; default 1, one envelope per event)",
    )
    parser.add_argument("--keep", action="store_true", help="keep everything running after the summary (Ctrl-C stops)")
    parser.add_argument("--keep-files", action="store_true", help="keep the work dir (logs, DB, Parquet output)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each phase (default 600)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between progress updates")
    parser.add_argument("--plain", action="store_true", help="plain progress lines even on a TTY")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_demo(parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
