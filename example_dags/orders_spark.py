"""
The orders data pipeline on Spark (PySpark), fed by a shared-stream asset.

:func:`build_orders_spark_pipeline` builds an asset-scheduled Dag:

1. ``extract`` (plain ``@task``) reads the run's ``triggering_asset_events`` **and every event of
   the source stored since the previous successful run** (``inlet_events``; see
   :func:`events_to_process` for why the triggering events alone lose the tail of a burst),
   deduplicated on ``message_id`` in message order, and turns the envelopes into order rows, one
   per ``order_id`` (pure Python, small: the XCom is the batch);
2. ``aggregate`` (``@task.pyspark``) makes a DataFrame of the rows, drops every ``order_id``
   already stored by an earlier run, appends the new rows to the ``order_lines`` Parquet dataset,
   their keys to ``order_keys`` and their revenue per region and minute to
   ``revenue_by_region_minute``;
3. ``record_progress`` stores the run's start in the Airflow Variable
   :func:`progress_key` once the batch is written (or there was nothing to write): where the next
   run's ``extract`` starts reading the source's events. Airflow's ``prev_start_date_success`` is
   always None for an asset-triggered run (it looks runs up by logical date, which such runs do
   not have), so without this every run re-read the source's whole history: 0.07 s for the first
   run of a chaos run, 5 s at 3,500 stored events, past the Execution API timeout
   (``[workers] execution_api_timeout``, 5 s by default) when four pipelines read at once, and
   from then on every run failed. With the mark it stores the ids of the events the run read
   within :data:`CATCH_UP_MARGIN` before its start: the next run reads those again (the margin
   covers events committed after they were stamped) and skips them, so its rows are the new
   orders only, not the last 10 minutes again (at 100 orders/s, 57,000 rows a run).

``extract`` reads the source's events in pages of about :data:`READ_PAGE_BYTES` (one request for
10 minutes of events at 100 orders/s is ~25 MB and passes that 5 s timeout).

Idempotency (a re-run, a retry, a redelivered message or an order published twice never
double-counts). The idempotency key is the business key ``order_id``, not the ``message_id``: a
message redelivered by the broker (triggerer crash before the offset commit) keeps its message id,
but a publisher that retries a send publishes the same order (same ``order_id``, body and
``created_at``) as a second message with a new id. Both copies carry the same ``order_id``.

* inside a batch, the first envelope of an order (in message order) is kept, the others dropped;
* every dataset is partitioned by ``batch_id`` (the Dag run id) and written with **dynamic
  partition overwrite**: a retry of a run rewrites its own partitions instead of appending again;
* the ``order_id``\\ s stored by *other* batches are anti-joined away before writing, so an order
  delivered or published twice is counted in the first batch only;
* ``max_active_runs=1``: batches are written one at a time.

``order_lines`` keeps the ``message_id`` of the envelope each row came from. The dedup reads only
``order_keys`` (``order_id`` alone), and only the hours this batch's orders belong to
(``key_hour`` partitions, from the order's minute): a redelivered message and a second publish of
an order carry the same ``created_at``, so their key is in the same hour as the first copy's. One
run's cost therefore follows the orders of an hour, not the table's whole history (measured by
``bench/pipeline_history_bench.py``, docs/spark.md). An order without ``created_at`` has its
publish time as minute: a redelivery has the same, a second publish a later one, so such a
duplicate is caught only when both publishes fall in the same hour.

``order_keys`` written before the key was ``order_id`` hold ``message_id``\\ s: a run that meets
such an hour raises :class:`LegacyOrderKeysError` rather than miss duplicates; rewrite the keys
once with :func:`rebuild_order_keys`.

Spark: ``local[*]`` by default. When the ``ORDERS_SPARK_CONN_ID`` environment variable (read where
the Dag file is parsed) names an Airflow connection, its host says where the job runs (``local[2]``,
``spark://master:7077`` for a standalone cluster, or a ``spark_connect`` connection for
``sc://host:15002``) and its extras are Spark settings. See ``docs/spark.md``.

The functions below take plain data (and a SparkSession) so they are unit-testable without Airflow.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from order_events import output_dir, unique_envelopes
from order_filters import order_problem

if TYPE_CHECKING:
    from airflow.sdk import DAG, Asset
    from pyspark.sql import DataFrame, SparkSession

# None: local[*]. Set ORDERS_SPARK_CONN_ID (where the Dag file is parsed) to run on what a connection says.
SPARK_CONN_ID = os.environ.get("ORDERS_SPARK_CONN_ID") or None
ORDER_COLUMNS = ("message_id", "order_id", "region", "amount", "minute")

# Task-level settings that are right for any master (the connection carries the rest, e.g.
# spark.sql.shuffle.partitions). The UI is useless for a short batch and costs startup time.
SPARK_TASK_CONFIG = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}


def order_minute(envelope: Mapping[str, Any]) -> str:
    """The order's minute, ``YYYY-MM-DDTHH:MM`` UTC: the order's ``created_at``, else the publish time."""
    body = envelope.get("body")
    raw = body.get("created_at") if isinstance(body, Mapping) else None
    raw = raw or envelope.get("published_at")
    if not raw:
        return "unknown"
    moment = datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M")


def order_rows(envelopes: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """
    Well-formed orders as flat rows, one per ``order_id`` (malformed ones are skipped: the watcher
    already dead-lettered them).

    The first envelope of an order in ``envelopes``' order wins (``extract`` passes them in
    message order, see ``order_events.unique_envelopes``, so a retry of a run keeps the same one);
    a later one with the same ``order_id`` is the same message redelivered or the same order
    published again, and is dropped.
    """
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for envelope in envelopes:
        if order_problem(envelope) is not None:
            continue
        body = envelope["body"]
        order_id = str(body["order_id"])
        if order_id in seen:
            continue
        seen.add(order_id)
        rows.append(
            {
                "message_id": str(envelope.get("message_id")),
                "order_id": order_id,
                "region": str(body["region"]),
                "amount": float(body["amount"]),
                "minute": order_minute(envelope),
            }
        )
    return rows


# How far before the previous successful run's start a run reads its source's events again: an
# event is stored with its triggerer's clock and committed later (two triggerers, a busy DB), so
# one stamped just before that start may have been invisible to that run. Re-reading is free of
# double counting: the events that run read are skipped by id (Progress.seen) and the order_id
# keys drop anything else stored twice. It bounds how much a run reads to what is new plus this.
CATCH_UP_MARGIN = timedelta(minutes=10)
# The catch-up read goes in pages. One request for everything since the mark grows with the rate
# (at 100 orders/s in batch mode, 10 minutes of events are ~25 MB) and passed the task's Execution
# API client timeout ([workers] execution_api_timeout, 5 s by default). The first page asks for
# READ_PAGE_SIZE events, each next one for as many as make about READ_PAGE_BYTES of event JSON at
# the sizes seen so far: a batch event holds up to max_payload_bytes (64 KiB by default; at a
# 256 KiB cap 200 events were 30 MB, which the API server took 7-36 s to send on a loaded machine).
READ_PAGE_SIZE = 10
READ_PAGE_BYTES = 1024 * 1024
MIN_READ_PAGE_SIZE = 5
MAX_READ_PAGE_SIZE = 1000


def progress_key(dag_id: str) -> str:
    """
    The Airflow Variable holding the start of ``dag_id``'s last run that wrote its batch (ISO
    8601): the next run reads the source's events stored since then (minus the margin).
    """
    return f"orders_pipeline.{dag_id}.processed_through"


def _progress_fields(value: Any) -> tuple[Any, Any]:
    """``(through, seen)`` of the Variable's value: JSON ``{"through", "seen"}``, or an older bare ISO time."""
    if not isinstance(value, str) or not value:
        return None, None
    if not value.startswith("{"):
        return value, None
    try:
        fields = json.loads(value)
    except ValueError:
        return None, None
    return (fields.get("through"), fields.get("seen")) if isinstance(fields, dict) else (None, None)


def parse_progress(value: Any) -> datetime | None:
    """The mark in the Variable's value as an aware datetime; None when unset or unreadable (read everything)."""
    through, _ = _progress_fields(value)
    if not isinstance(through, str) or not through:
        return None
    try:
        parsed = datetime.fromisoformat(through)
    except ValueError:
        return None
    return _aware(parsed)


def parse_seen(value: Any) -> frozenset[int]:
    """
    The ids of the events the last run that wrote its batch read within the margin before its
    mark (the next run reads them again and skips them). Empty when unset or unreadable: the
    next run then turns them into rows again and the order_id keys drop them (slower, never wrong).
    """
    _, seen = _progress_fields(value)
    if not isinstance(seen, list):
        return frozenset()
    return frozenset(item for item in seen if isinstance(item, int) and not isinstance(item, bool))


def progress_value(through: datetime, seen: Iterable[int]) -> str:
    """The Variable's value: the mark and the ids of the events read since ``through - CATCH_UP_MARGIN``."""
    return json.dumps({"through": through.astimezone(timezone.utc).isoformat(), "seen": sorted(set(seen))})


def seen_within_margin(events: Iterable[Any], through: datetime) -> list[int]:
    """The ids of ``events`` the next run reads again: stamped at or after ``through - CATCH_UP_MARGIN``."""
    start = through - CATCH_UP_MARGIN
    return sorted({event.id for event in events if _aware(event.timestamp) >= start})


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def event_bytes(event: Any) -> int:
    """About how many bytes an event weighs in the Execution API's answer: its ``extra`` as JSON."""
    try:
        return len(json.dumps(getattr(event, "extra", None), separators=(",", ":"), default=str)) + 200
    except (TypeError, ValueError):
        return 1024


def next_page_size(page: list[Any], asked: int, page_bytes: int = READ_PAGE_BYTES) -> int:
    """How many events the next page asks for: about ``page_bytes`` at the sizes of ``page``."""
    if not page:
        return asked
    average = max(1, sum(event_bytes(event) for event in page) // len(page))
    return max(MIN_READ_PAGE_SIZE, min(MAX_READ_PAGE_SIZE, page_bytes // average))


def events_since(accessor: Any, previous_success_start: datetime | None, page_size: int = READ_PAGE_SIZE) -> list[Any]:
    """
    The source's asset events since ``previous_success_start`` minus :data:`CATCH_UP_MARGIN`
    (all of them before the first successful run), oldest first, through the task's
    ``inlet_events[source]`` accessor (Airflow's Execution API), read in pages: the first of
    ``page_size`` events, the next ones sized to :data:`READ_PAGE_BYTES` (:func:`next_page_size`).

    The API's ``after`` is inclusive and orders by timestamp alone, so each page starts at the
    last page's newest timestamp: the events on that boundary come again and are dropped by id.
    A full page that all shares one timestamp is read again with twice the page size, so the read
    always moves on.
    """
    # Truthiness, not "is not None": Airflow hands the context value over as a lazy proxy, which
    # is an object even when what it stands for is None.
    after = (previous_success_start - CATCH_UP_MARGIN).isoformat() if previous_success_start else None
    events: list[Any] = []
    ids: set[Any] = set()
    while True:
        query = accessor.after(after) if after else accessor
        page = list(query.limit(page_size).ascending())
        fresh = [event for event in page if event.id not in ids]
        events += fresh
        ids.update(event.id for event in fresh)
        if len(page) < page_size:
            return events
        newest = _aware(page[-1].timestamp).isoformat()
        if newest == after:
            page_size *= 2
        else:
            page_size = next_page_size(page, page_size)
        after = newest


def events_to_process(
    source: Any, triggering_asset_events: Any, caught_up: Iterable[Any], covered_since: datetime | None = None
) -> dict[Any, list[Any]]:
    """
    What one run processes: its ``triggering_asset_events`` **and** every event of the source
    stored since the previous successful run (``caught_up``), in the mapping shape
    :func:`order_events.unique_envelopes` reads.

    ``covered_since``: the catch-up read every event of the source stamped since then (it ran
    after the events that triggered this run were stored), so a triggering event of the source
    stamped since then is in ``caught_up`` already, or was left out of it because the last
    successful run wrote it (``parse_seen``): it is not processed again here. Triggering events
    carry no id to skip them by, and without this a run turned the previous run's tail into rows
    a second time (measured at 100 orders/s: about half of each run's rows, all dropped by the
    ``order_id`` keys after Spark had read them).

    Why not the triggering events alone: Airflow 3.3 gives a run only the events up to its
    queue row's creation (the first event after the previous run was created). The events that
    arrive while a run is queued or running are left for a later run, and if nothing arrives
    after them, no later run comes (apache/airflow#56050; ../shared/notes/airflow-3.3-facts.md).
    ``flush_after`` makes a marker event after a quiet period, but a marker that lands while a
    long Spark run is going is absorbed by the same queue row. Reading the source's events since
    the previous success makes any run catch every stored event up: the tail of a burst is
    processed by the next run whatever created it.
    """
    events: dict[Any, list[Any]] = {key: list(value) for key, value in (triggering_asset_events or {}).items()}
    if covered_since is not None:
        for key, triggering in events.items():
            if _same_asset(key, source):
                events[key] = [event for event in triggering if _aware(event.timestamp) < covered_since]
    events.setdefault(source, []).extend(caught_up)
    return events


def _same_asset(key: Any, source: Any) -> bool:
    """
    Whether a ``triggering_asset_events`` key is ``source``: Airflow's accessor hands out a new
    ``Asset(name, uri)`` per key, which is not equal to the Dag's own (its extra, its watchers).
    """
    if key == source:
        return True
    name = getattr(source, "name", None)
    return name is not None and (getattr(key, "name", None), getattr(key, "uri", None)) == (name, source.uri)


def covered_since(previous_success_start: datetime | None) -> datetime:
    """Since when :func:`events_since` reads every event of the source (its ``after``; all of them before a mark)."""
    if previous_success_start is None:
        return datetime.min.replace(tzinfo=timezone.utc)
    return previous_success_start - CATCH_UP_MARGIN


def batch_id_for(run_id: str) -> str:
    """A Parquet-partition-safe batch id for a Dag run."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


def _stored(spark: SparkSession, path: str) -> DataFrame | None:
    from pyspark.errors import AnalysisException

    try:
        stored = spark.read.parquet(path)
        # Classic Spark analyzes the read eagerly; Spark Connect only when the plan is first used.
        # Asking for the schema analyzes it here, so a missing path raises inside this try on both
        # (otherwise, over Connect, the first batch fails later in the anti-join's collect()).
        _ = stored.schema
    except AnalysisException:
        return None  # first batch: the dataset does not exist yet
    return stored


def first_per_order(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each ``order_id``, in the rows' order (``order_rows`` already gives one per order)."""
    unique: dict[str, dict[str, Any]] = {}
    for row in rows:
        unique.setdefault(str(row["order_id"]), dict(row))
    return list(unique.values())


class LegacyOrderKeysError(RuntimeError):
    """
    An ``order_keys`` hour holds no ``order_id`` column: it was written when the key was the
    ``message_id``. Deduplicating against it would let every second publish of its orders through,
    so the run stops before writing anything; :func:`rebuild_order_keys` rewrites the keys once.
    """


def key_hour(minute: str) -> str:
    """The ``order_keys`` partition of an order: the hour of its minute (``YYYY-MM-DDTHH``)."""
    return minute[:13]


def _keys_of_other_batches(spark: SparkSession, keys_path: str, hours: list[str], batch_id: str) -> DataFrame | None:
    """
    The ``order_id``\\ s other batches stored in ``hours`` (None when there are none yet).

    Each hour's directory is read as its own dataset: reading ``order_keys`` whole and filtering on
    ``key_hour`` would prune the files Spark reads but still list every partition of the history.
    """
    from pyspark.sql import functions as F  # noqa: N812

    earlier: DataFrame | None = None
    for hour in hours:
        path = f"{keys_path}/key_hour={hour}"
        stored = _stored(spark, path)
        if stored is None:
            continue
        if "order_id" not in stored.columns:
            raise LegacyOrderKeysError(
                f"{path} holds message_id keys (written before the key was order_id): "
                "run orders_spark.rebuild_order_keys(spark, <output>) once"
            )
        ids = stored.where(F.col("batch_id") != F.lit(batch_id)).select("order_id")
        earlier = ids if earlier is None else earlier.unionByName(ids)
    return earlier


def write_order_batch(spark: SparkSession, rows: list[dict[str, Any]], base_path: str, batch_id: str) -> dict[str, Any]:
    """
    Append one batch of order rows to ``<base>/order_lines`` (one per ``order_id`` not stored by
    another batch) and its aggregates to ``<base>/revenue_by_region_minute``, idempotently (see the
    module docstring).
    """
    from pyspark.sql import functions as F  # noqa: N812 - the PySpark convention
    from pyspark.sql.types import DoubleType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("message_id", StringType(), False),
            StructField("order_id", StringType(), False),
            StructField("region", StringType(), False),
            StructField("amount", DoubleType(), False),
            StructField("minute", StringType(), False),
        ]
    )
    lines_path = f"{base_path.rstrip('/')}/order_lines"
    keys_path = f"{base_path.rstrip('/')}/order_keys"
    revenue_path = f"{base_path.rstrip('/')}/revenue_by_region_minute"
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")

    # One row per order, the first in the batch's (message) order: deterministic, so a retry of
    # the run keeps the same message_id (Spark's dropDuplicates would keep an arbitrary one).
    unique = first_per_order(rows)
    batch = spark.createDataFrame([tuple(row[c] for c in ORDER_COLUMNS) for row in unique], schema)
    earlier = _keys_of_other_batches(spark, keys_path, sorted({key_hour(row["minute"]) for row in unique}), batch_id)
    if earlier is not None:
        # Every order other batches already counted; this batch's own keys are excluded so a
        # retry of the same run recomputes the same rows and overwrites them. The join puts its
        # key first: back to the schema's column order, as the rows are re-read by position.
        batch = batch.join(earlier, on="order_id", how="left_anti").select(*ORDER_COLUMNS)
    # Materialize the (small) batch: the write below replaces files of the dataset it was read
    # from, and Spark refuses to overwrite a path the same plan reads.
    new_rows = batch.collect()
    received = len(rows)
    if not new_rows:
        return {"batch_id": batch_id, "received": received, "new": 0, "duplicates": received, "groups": 0}
    fresh = spark.createDataFrame(new_rows, schema).withColumn("batch_id", F.lit(batch_id))
    fresh.coalesce(1).write.mode("overwrite").partitionBy("batch_id").parquet(lines_path)
    revenue = (
        fresh.groupBy("batch_id", "region", "minute")
        .agg(F.count("*").alias("orders"), F.round(F.sum("amount"), 2).alias("revenue"))
        .coalesce(1)
    )
    revenue.write.mode("overwrite").partitionBy("batch_id").parquet(revenue_path)
    # The keys last: a run that fails before this line left no key behind, so its retry (same
    # batch_id) and any later batch still count its orders exactly once (with the keys written
    # before the revenue, a run failing in between would leave orders keyed but never counted).
    _keys_of(fresh).coalesce(1).write.mode("overwrite").partitionBy("key_hour", "batch_id").parquet(keys_path)
    return {
        "batch_id": batch_id,
        "received": received,
        "new": len(new_rows),
        "duplicates": received - len(new_rows),
        "groups": revenue.count(),
    }


def _keys_of(lines: DataFrame) -> DataFrame:
    """The ``order_keys`` rows of ``order_lines`` rows: ``order_id`` by ``key_hour`` and ``batch_id``."""
    from pyspark.sql import functions as F  # noqa: N812

    return lines.select("order_id", F.substring("minute", 1, 13).alias("key_hour"), "batch_id")


def rebuild_order_keys(spark: SparkSession, base_path: str) -> int:
    """
    Rewrite ``<base>/order_keys`` from ``<base>/order_lines`` (every stored order's ``order_id``,
    same layout as the pipeline writes), e.g. once for an output whose keys are ``message_id``\\ s
    (:class:`LegacyOrderKeysError`). Reads the whole history, so run it between pipeline runs, not
    in one. Each ``key_hour`` x ``batch_id`` partition is overwritten; returns the number of keys.
    """
    lines_path = f"{base_path.rstrip('/')}/order_lines"
    keys_path = f"{base_path.rstrip('/')}/order_keys"
    stored = _stored(spark, lines_path)
    if stored is None:
        return 0
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    # Dynamic overwrite replaces exactly the partitions written here, and every keys partition has
    # its lines (a run writes its keys after its lines), so no old key file survives. One file per
    # partition, as a run leaves it.
    keys = _keys_of(stored).repartition("key_hour", "batch_id")
    keys.write.mode("overwrite").partitionBy("key_hour", "batch_id").parquet(keys_path)
    return int(spark.read.parquet(keys_path).count())


def revenue_totals(spark: SparkSession, base_path: str) -> list[dict[str, Any]]:
    """Revenue per region and minute over every batch (what a dashboard would read)."""
    from pyspark.sql import functions as F  # noqa: N812

    stored = _stored(spark, f"{base_path.rstrip('/')}/revenue_by_region_minute")
    if stored is None:
        return []
    totals = (
        stored.groupBy("region", "minute")
        .agg(F.sum("orders").alias("orders"), F.round(F.sum("revenue"), 2).alias("revenue"))
        .orderBy("region", "minute")
    )
    return [row.asDict() for row in totals.collect()]


def build_orders_spark_pipeline(
    *, dag_id: str, source: Asset, dataset: str, conn_id: str | None = SPARK_CONN_ID
) -> DAG | None:
    """
    The asset-scheduled PySpark Dag for ``source``; writes under ``<ORDERS_OUTPUT_DIR>/<dataset>``.

    ``conn_id``: the Spark connection of the ``aggregate`` task (default ``$ORDERS_SPARK_CONN_ID``;
    None is ``local[*]``): a ``spark`` connection whose host is ``local[N]`` or ``spark://master``,
    or a ``spark_connect`` connection. The code is the same on each (DataFrame API only, no RDD or
    SparkContext call, which Spark Connect does not offer).

    Returns None (no Dag) when the Spark provider is not installed:
    ``pip install apache-airflow-providers-apache-spark pyspark`` (a checkout's ``spark`` dependency group).
    """
    try:
        import airflow.providers.apache.spark.decorators.pyspark  # noqa: F401
    except ImportError:
        return None
    from airflow.sdk import dag, task

    @dag(
        dag_id=dag_id,
        schedule=[source],
        max_active_runs=1,
        catchup=False,
        tags=["shared-stream", "spark"],
        doc_md=__doc__,
    )
    def orders_spark_pipeline() -> None:
        # The source is an inlet so that the task may read its events (inlet_events), not only
        # the run's triggering ones: see events_to_process.
        @task(inlets=[source])
        def extract(
            triggering_asset_events: Any = None, inlet_events: Any = None, dag_run: Any = None, ti: Any = None
        ) -> list[dict[str, Any]]:
            from airflow.sdk import Variable

            progress = Variable.get(progress_key(dag_id), default=None)
            mark = parse_progress(progress)
            caught_up = events_since(inlet_events[source], mark) if inlet_events else []
            # What the next run will read again, for record_progress to store once this batch is written.
            ti.xcom_push(key="seen", value=seen_within_margin(caught_up, dag_run.start_date))
            # Events the last successful run already turned into written rows: not again.
            done = parse_seen(progress)
            new = [event for event in caught_up if event.id not in done]
            covered = covered_since(mark) if inlet_events else None
            rows = order_rows(unique_envelopes(events_to_process(source, triggering_asset_events, new, covered)))
            # has_orders reads this, not the rows: pulling the whole batch back to test it for
            # emptiness cost 30 s a run at 40,000 rows.
            ti.xcom_push(key="orders", value=len(rows))
            return rows

        # conn_id None -> local[*]; else the connection says where Spark runs (see docs/spark.md).
        @task.pyspark(conn_id=conn_id, config_kwargs=SPARK_TASK_CONFIG)
        def aggregate(rows: list[dict[str, Any]], spark: Any = None, run_id: str | None = None) -> dict[str, Any]:
            # On a cluster, point ORDERS_SPARK_PATH at storage every executor sees (s3a://, hdfs://).
            root = os.environ.get("ORDERS_SPARK_PATH")
            base = f"{root.rstrip('/')}/{dataset}" if root else str(output_dir() / dataset)
            if not rows:
                return {"batch_id": None, "received": 0, "new": 0, "duplicates": 0, "groups": 0}
            return write_order_batch(spark, rows, base, batch_id_for(str(run_id)))

        # Skips only aggregate (its direct downstream): record_progress still runs after an empty batch.
        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def has_orders(ti: Any = None) -> bool:
            """A run created only by flush_after markers (or by malformed orders) starts no Spark."""
            return bool(ti.xcom_pull(task_ids="extract", key="orders"))

        # Only after the batch is written (none_failed: or skipped as empty). A run that fails
        # after writing leaves the mark where it was: the next run reads those events again and
        # the order_id keys drop what is already stored.
        @task(trigger_rule="none_failed")
        def record_progress(dag_run: Any = None, ti: Any = None) -> str:
            from airflow.sdk import Variable

            seen = ti.xcom_pull(task_ids="extract", key="seen") or []
            value = progress_value(dag_run.start_date, seen)
            Variable.set(
                progress_key(dag_id),
                value,
                description="orders pipeline: the start of its last run that wrote its batch, and the ids of "
                "the events it read that the next run reads again (orders_spark.py)",
            )
            return value[:200]

        rows = extract()
        # TaskFlow resolves the XComArg at run time.
        rows >> has_orders() >> aggregate(rows) >> record_progress()  # type: ignore[arg-type]

    return orders_spark_pipeline()
