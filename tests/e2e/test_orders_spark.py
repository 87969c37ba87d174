"""
The PySpark pipeline's batch logic on a real local SparkSession (no Airflow): idempotent re-runs,
duplicates (a redelivered message, an order published twice) inside and across batches, and the
aggregates.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    pyspark_sql = pytest.importorskip("pyspark.sql")
    session = (
        pyspark_sql.SparkSession.builder.master("local[2]")
        .appName("orders-spark-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    yield session
    session.stop()


def envelope(message_id: str, region: Any, amount: Any, minute: int = 0, **extra: Any) -> dict[str, Any]:
    body = {"order_id": f"o-{message_id}", "region": region, "amount": amount}
    body["created_at"] = f"2026-01-01T12:{minute:02d}:30Z"
    body.update(extra)
    return {"message_id": message_id, "body": body, "body_encoding": "json", "published_at": None}


def totals(spark: Any, base: Path) -> dict[tuple[str, str], tuple[int, float]]:
    from orders_spark import revenue_totals

    return {
        (r["region"], r["minute"]): (int(r["orders"]), float(r["revenue"])) for r in revenue_totals(spark, str(base))
    }


def test_order_rows_skip_malformed_and_duplicate_envelopes() -> None:
    from orders_spark import order_rows

    rows = order_rows(
        [
            envelope("t/0/1", "eu", 10),
            envelope("t/0/1", "eu", 10),  # redelivered: same message id
            envelope("t/0/2", "mars", 10),  # unknown region
            envelope("t/0/3", "us", "ten"),  # amount not a number
            {"message_id": "t/0/4", "body": "text", "body_encoding": "text"},
        ]
    )
    assert rows == [
        {"message_id": "t/0/1", "order_id": "o-t/0/1", "region": "eu", "amount": 10.0, "minute": "2026-01-01T12:00"}
    ]


class Event:
    """An asset event as a task sees one (``.extra``: the watcher's ``{"from_trigger", "payload"}``)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.extra = {"from_trigger": True, "payload": payload}


def test_a_run_processes_the_tail_its_triggering_events_miss() -> None:
    """
    Airflow 3.3 gives a run only the events up to its queue row's creation; the rest of a burst
    waits for a later event (apache/airflow#56050). The run also takes every event stored since
    the previous success (``inlet_events``), so the tail is in this run's rows.
    """
    from order_events import unique_envelopes
    from orders_spark import events_to_process, order_rows

    source = "orders_valid"
    triggering = {source: [Event(envelope("t/0/1", "eu", 10))]}
    stored_since = [Event(envelope("t/0/1", "eu", 10)), Event(envelope("t/0/2", "us", 20))]  # the first again
    rows = order_rows(unique_envelopes(events_to_process(source, triggering, stored_since)))
    assert [row["message_id"] for row in rows] == ["t/0/1", "t/0/2"]
    # Without the events stored since the previous success the tail is not in the run:
    assert [row["message_id"] for row in order_rows(unique_envelopes(triggering))] == ["t/0/1"]


class StoredEvent:
    """An asset event as the Execution API returns one: an id and the triggerer's timestamp."""

    def __init__(self, event_id: int, timestamp: datetime, extra: dict[str, Any] | None = None) -> None:
        self.id = event_id
        self.timestamp = timestamp
        self.extra = extra or {}

    def __repr__(self) -> str:
        return f"StoredEvent({self.id})"


class Accessor:
    """
    ``inlet_events[source]`` over stored events, filtered as Airflow 3.3.2's Execution API does
    (``after`` inclusive, ordered by timestamp alone, ``limit``); records every request.
    """

    def __init__(self, events: list[StoredEvent]) -> None:
        self.events = events
        self.after_value: str | None = None
        self.limit_value: int | None = None
        self.requests: list[tuple[str | None, int | None]] = []

    def after(self, value: str) -> Accessor:
        self.after_value = value
        return self

    def limit(self, value: int) -> Accessor:
        self.limit_value = value
        return self

    def ascending(self) -> list[StoredEvent]:
        self.requests.append((self.after_value, self.limit_value))
        after = datetime.fromisoformat(self.after_value) if self.after_value else None
        found = sorted((e for e in self.events if after is None or e.timestamp >= after), key=lambda e: e.timestamp)
        return found[: self.limit_value] if self.limit_value else found


def test_triggering_events_the_catch_up_covered_are_not_processed_twice() -> None:
    """
    A run's triggering events were stored before its catch-up read: those stamped since the
    read's start are in it already (or were written by the last successful run and skipped), so
    only older ones (none in practice) are taken from the triggering events.
    """
    from order_events import unique_envelopes
    from orders_spark import CATCH_UP_MARGIN, covered_since, events_to_process, order_rows

    source = "orders_valid"
    mark = datetime(2026, 11, 27, 1, 0, tzinfo=timezone.utc)
    covered = covered_since(mark)
    assert covered == mark - CATCH_UP_MARGIN
    written = StoredEvent(
        1, mark - timedelta(seconds=5), {"from_trigger": True, "payload": envelope("t/0/1", "eu", 10)}
    )
    new = StoredEvent(2, mark + timedelta(seconds=5), {"from_trigger": True, "payload": envelope("t/0/2", "us", 20)})
    older = StoredEvent(
        3, covered - timedelta(seconds=1), {"from_trigger": True, "payload": envelope("t/0/3", "eu", 5)}
    )
    # The catch-up left out event 1 (the last run wrote it); the triggering events hold 1, 2 and 3.
    events = events_to_process(source, {source: [written, new, older]}, [new], covered)
    assert sorted(row["message_id"] for row in order_rows(unique_envelopes(events))) == ["t/0/2", "t/0/3"]
    # Before any mark the catch-up read the whole history: no triggering event is needed.
    assert covered_since(None) < older.timestamp
    assert events_to_process(source, {source: [written, new]}, [new], covered_since(None)) == {source: [new]}
    # Without an inlet accessor (covered None) every triggering event is processed.
    assert events_to_process(source, {source: [written]}, [], None) == {source: [written]}


def test_the_triggering_events_are_matched_to_the_source_by_name_and_uri() -> None:
    """
    Airflow's ``triggering_asset_events`` yields a new ``Asset(name, uri)`` per key, not equal to
    the Dag's source (which has an extra, watchers): matched by name and URI all the same.
    """
    from airflow.sdk import Asset
    from orders_spark import covered_since, events_to_process

    source = Asset("orders_valid", extra={"stream": "kafka"})
    key = Asset(name=source.name, uri=source.uri)
    other = Asset("orders_eu")
    assert key != source
    mark = datetime(2026, 11, 27, 1, 0, tzinfo=timezone.utc)
    covered = StoredEvent(1, mark)
    events = events_to_process(source, {key: [covered], other: [covered]}, [], covered_since(mark))
    assert events[key] == []  # covered by the catch-up read
    assert events[other] == [covered]  # another asset's events are left as they are


def test_the_catch_up_reads_from_the_previous_success_minus_the_margin() -> None:
    from orders_spark import CATCH_UP_MARGIN, events_since

    previous = datetime(2026, 11, 26, 10, 0, tzinfo=timezone.utc)
    stored = [StoredEvent(1, previous - CATCH_UP_MARGIN), StoredEvent(2, previous)]
    accessor = Accessor(stored)
    assert events_since(accessor, previous) == stored
    assert accessor.requests[0][0] == (previous - CATCH_UP_MARGIN).isoformat()
    first_run = Accessor(stored)
    assert events_since(first_run, None) == stored
    assert first_run.requests[0][0] is None  # before the first success: every stored event
    # What a task really gets: the context's lazy proxy, also when it stands for None.
    import lazy_object_proxy

    proxied_none = Accessor(stored)
    assert events_since(proxied_none, lazy_object_proxy.Proxy(lambda: None)) == stored
    assert proxied_none.requests[0][0] is None
    proxied = Accessor(stored)
    events_since(proxied, lazy_object_proxy.Proxy(lambda: previous))
    assert proxied.requests[0][0] == (previous - CATCH_UP_MARGIN).isoformat()


def test_the_catch_up_reads_in_pages_and_gets_every_event_once() -> None:
    """
    At 100 orders/s one request for everything since the mark took ~5 s (the Execution API
    client's timeout) after 4 minutes: the read goes in pages, each from the last page's newest
    timestamp (the API's ``after`` is inclusive, its order is by timestamp alone).
    """
    from orders_spark import events_since

    start = datetime(2026, 11, 27, 5, 0, tzinfo=timezone.utc)
    stamps = [start + timedelta(milliseconds=i // 3) for i in range(450)]  # three events per timestamp
    stamps += [start + timedelta(seconds=10)] * 250  # more events on one timestamp than a page holds
    stamps += [start + timedelta(seconds=11 + i) for i in range(5)]
    stored = [StoredEvent(i, stamp) for i, stamp in enumerate(stamps)]
    for event in stored:  # ~20 KB each: pages sized in bytes stay near 100 events
        event.extra = {"payload": "x" * 20_000}
    accessor = Accessor(stored)
    read = events_since(accessor, None, page_size=100)
    assert sorted(event.id for event in read) == list(range(len(stored)))  # every event, none twice
    limits = [limit or 0 for _, limit in accessor.requests]
    assert all(0 < limit <= 500 for limit in limits)  # ~2 MB, doubled twice at most
    assert max(limits) > 200  # the block of 250 on one timestamp doubled a page
    assert len(accessor.requests) < 20
    assert events_since(Accessor(stored[:99]), None, page_size=100) == stored[:99]  # one short page: done


def test_catch_up_pages_are_sized_in_bytes() -> None:
    """After the first page, a page asks for about READ_PAGE_BYTES of events at the sizes seen."""
    from orders_spark import MIN_READ_PAGE_SIZE, READ_PAGE_BYTES, next_page_size

    def event_of(size: int) -> StoredEvent:
        return StoredEvent(1, datetime(2026, 11, 27, tzinfo=timezone.utc), {"payload": "x" * size})

    big = next_page_size([event_of(150_000)] * 3, 200)  # batch events at a 256 KiB cap
    assert MIN_READ_PAGE_SIZE <= big <= READ_PAGE_BYTES // 150_000 + 1
    assert next_page_size([event_of(400)] * 3, 200) >= 200  # per-message events: bigger pages
    assert next_page_size([event_of(10_000_000)], 200) == MIN_READ_PAGE_SIZE
    assert next_page_size([], 123) == 123


def test_the_progress_mark_and_the_events_already_written() -> None:
    """
    The Variable holds the mark and the ids of the events the run read within the margin before
    it: the next run reads them again (the margin) and skips them, so a run's rows are what is
    new, not the last 10 minutes again.
    """
    from orders_spark import CATCH_UP_MARGIN, parse_progress, parse_seen, progress_value, seen_within_margin

    mark = datetime(2026, 11, 27, 1, 0, tzinfo=timezone.utc)
    events = [
        StoredEvent(7, mark - CATCH_UP_MARGIN - timedelta(microseconds=1)),  # not read again: not kept
        StoredEvent(8, mark - CATCH_UP_MARGIN),
        StoredEvent(9, (mark + timedelta(seconds=1)).replace(tzinfo=None)),  # naive: UTC
    ]
    seen = seen_within_margin(events, mark)
    assert seen == [8, 9]
    value = progress_value(mark, seen)
    assert parse_progress(value) == mark
    assert parse_seen(value) == {8, 9}
    assert parse_seen(mark.isoformat()) == frozenset()  # the older bare mark: nothing skipped
    for unreadable in (None, "", "{", "[1, 2]", '{"through": 3, "seen": "8"}', 42):
        assert parse_seen(unreadable) == frozenset()
        assert parse_progress(unreadable) is None
    assert parse_seen('{"through": "x", "seen": [1, "2", true, 3]}') == {1, 3}


def test_the_progress_mark_is_where_the_next_run_reads_from() -> None:
    """
    Airflow's ``prev_start_date_success`` is None for every asset-triggered run (it is looked up
    by logical date), so the pipeline keeps its own mark: an Airflow Variable written by
    ``record_progress`` after the batch is written, read by ``extract``.
    """

    from orders_spark import parse_progress, progress_key

    assert progress_key("kafka_pipeline") == "orders_pipeline.kafka_pipeline.processed_through"
    mark = datetime(2026, 11, 27, 1, 0, tzinfo=timezone.utc)
    assert parse_progress(mark.isoformat()) == mark
    assert parse_progress("2026-11-27T01:00:00") == mark  # naive: UTC, as Airflow stores times
    for unset in (None, "", "not a time", 42):
        assert parse_progress(unset) is None  # read everything: never skip events on a bad mark


def test_the_mark_moves_only_after_the_batch_is_written_or_empty() -> None:
    """record_progress follows aggregate, and runs when has_orders skipped it, not when it failed."""
    from airflow.sdk import Asset
    from orders_spark import build_orders_spark_pipeline

    dag = build_orders_spark_pipeline(dag_id="orders_progress_test", source=Asset("orders_progress"), dataset="t")
    if dag is None:
        pytest.skip("the Spark provider is not installed")
    record = dag.get_task("record_progress")
    assert record.upstream_task_ids == {"aggregate"}
    assert record.trigger_rule == "none_failed"
    has_orders = dag.get_task("has_orders")
    assert has_orders.downstream_task_ids == {"aggregate"}
    assert has_orders.upstream_task_ids == {"extract"}  # it reads extract's count, not its rows
    # skips aggregate only, not record_progress
    assert getattr(has_orders, "ignore_downstream_trigger_rules", None) is False


def test_batches_are_idempotent_and_never_double_count(spark: Any, tmp_path: Path) -> None:
    from orders_spark import order_rows, write_order_batch

    first = order_rows([envelope("t/0/1", "eu", 10.5), envelope("t/0/2", "eu", 4.5), envelope("t/1/1", "us", 100, 1)])
    result = write_order_batch(spark, first, str(tmp_path), "run_1")
    assert result == {"batch_id": "run_1", "received": 3, "new": 3, "duplicates": 0, "groups": 2}
    expected = {("eu", "2026-01-01T12:00"): (2, 15.0), ("us", "2026-01-01T12:01"): (1, 100.0)}
    assert totals(spark, tmp_path) == expected

    # A retry of the same run rewrites its own partition: nothing is added.
    again = write_order_batch(spark, first, str(tmp_path), "run_1")
    assert again["new"] == 3
    assert totals(spark, tmp_path) == expected

    # The next run carries a redelivered message (t/0/2) and a new one: only the new one counts.
    second = order_rows([envelope("t/0/2", "eu", 4.5), envelope("t/2/1", "apac", 7.25, 1)])
    result = write_order_batch(spark, second, str(tmp_path), "run_2")
    assert (result["new"], result["duplicates"]) == (1, 1)
    expected[("apac", "2026-01-01T12:01")] = (1, 7.25)
    assert totals(spark, tmp_path) == expected

    # A batch made only of already-counted messages writes nothing.
    result = write_order_batch(spark, second[:1], str(tmp_path), "run_3")
    assert (result["new"], result["duplicates"]) == (0, 1)
    assert totals(spark, tmp_path) == expected
    stored = spark.read.parquet(str(tmp_path / "order_lines")).select("message_id").collect()
    assert sorted(r["message_id"] for r in stored) == ["t/0/1", "t/0/2", "t/1/1", "t/2/1"]


def test_the_dedup_reads_only_the_hours_of_its_own_orders(spark: Any, tmp_path: Path) -> None:
    """
    Redeliveries are found in every hour a batch spans, and only there: a key stored under an
    hour the batch does not touch is not read (the run's cost follows its hours, not the history).
    """
    from orders_spark import order_rows, write_order_batch

    def at(message_id: str, hour: int) -> dict[str, Any]:
        event = envelope(message_id, "eu", 1.0)
        event["body"]["created_at"] = f"2026-01-01T{hour:02d}:10:00Z"
        return event

    write_order_batch(spark, order_rows([at("a", 9), at("b", 10), at("c", 11)]), str(tmp_path), "run_1")
    keys = tmp_path / "order_keys"
    assert sorted(p.name for p in keys.iterdir() if p.is_dir()) == [
        "key_hour=2026-01-01T09",
        "key_hour=2026-01-01T10",
        "key_hour=2026-01-01T11",
    ]
    # Hours 9 and 10: both redeliveries are dropped; the new order of hour 10 counts.
    result = write_order_batch(spark, order_rows([at("a", 9), at("b", 10), at("d", 10)]), str(tmp_path), "run_2")
    assert (result["new"], result["duplicates"]) == (1, 2)
    # Hour 11's keys are not read by a batch of hour 12: corrupt them, and the run does not notice.
    for part in (keys / "key_hour=2026-01-01T11").rglob("*.parquet"):
        part.write_bytes(b"not parquet: reading this hour would fail the run")
    result = write_order_batch(spark, order_rows([at("e", 12)]), str(tmp_path), "run_3")
    assert (result["new"], result["duplicates"]) == (1, 0)


def published_again(first: dict[str, Any], message_id: str) -> dict[str, Any]:
    """The same order sent again by a retrying publisher: same body (order_id, created_at), new message id."""
    return {**first, "message_id": message_id, "body": dict(first["body"])}


def lines(spark: Any, base: Path) -> list[tuple[str, str, str]]:
    stored = spark.read.parquet(str(base / "order_lines")).collect()
    return sorted((r["order_id"], r["message_id"], r["batch_id"]) for r in stored)


def test_order_rows_keep_the_first_envelope_of_an_order_in_message_order() -> None:
    from order_events import unique_envelopes
    from orders_spark import order_rows

    first = {**envelope("orders/0/5", "eu", 10), "source": "orders", "metadata": {"partition": 0, "offset": 5}}
    again = {**published_again(first, "orders/0/9"), "metadata": {"partition": 0, "offset": 9}}
    # The second publish arrives first in the events; message order (the offsets) decides.
    events = {"asset": [{"extra": {"from_trigger": True, "payload": e}} for e in (again, first, first)]}
    rows = order_rows(unique_envelopes(events))
    assert [(r["order_id"], r["message_id"]) for r in rows] == [("o-orders/0/5", "orders/0/5")]


def test_an_order_published_twice_is_stored_once(spark: Any, tmp_path: Path) -> None:
    """
    A retrying publisher's second copy of an order (new message id, same order) is dropped in the
    batch of the first copy and in a later batch alike; a redelivery still is; a retried run still
    rewrites its own partition. Revenue counts each order once.
    """
    from orders_spark import order_rows, write_order_batch

    a, b = envelope("t/0/1", "eu", 10.5), envelope("t/0/2", "us", 4.0)
    first = order_rows([a, published_again(a, "t/0/3"), b])
    assert [r["message_id"] for r in first] == ["t/0/1", "t/0/2"]
    # Rows handed over as they are (e.g. by another extract) are deduplicated on order_id too.
    result = write_order_batch(spark, [*first, {**first[0], "message_id": "t/0/3"}], str(tmp_path), "run_1")
    assert result == {"batch_id": "run_1", "received": 3, "new": 2, "duplicates": 1, "groups": 2}
    expected = {("eu", "2026-01-01T12:00"): (1, 10.5), ("us", "2026-01-01T12:00"): (1, 4.0)}
    assert totals(spark, tmp_path) == expected
    assert lines(spark, tmp_path) == [("o-t/0/1", "t/0/1", "run_1"), ("o-t/0/2", "t/0/2", "run_1")]

    # The next batch: a in a third message, b redelivered (same message id), and a new order c.
    c = envelope("t/1/1", "apac", 7.25, 1)
    second = order_rows([published_again(a, "t/1/7"), b, c])
    result = write_order_batch(spark, second, str(tmp_path), "run_2")
    assert (result["new"], result["duplicates"]) == (1, 2)
    expected[("apac", "2026-01-01T12:01")] = (1, 7.25)
    assert totals(spark, tmp_path) == expected
    # A retry of run_2 rewrites its partition: still one row per order.
    again = write_order_batch(spark, second, str(tmp_path), "run_2")
    assert (again["new"], again["duplicates"]) == (1, 2)
    assert totals(spark, tmp_path) == expected
    assert lines(spark, tmp_path) == [
        ("o-t/0/1", "t/0/1", "run_1"),
        ("o-t/0/2", "t/0/2", "run_1"),
        ("o-t/1/1", "t/1/1", "run_2"),
    ]


def test_message_id_keys_stop_the_run_until_rebuilt(spark: Any, tmp_path: Path) -> None:
    """
    An ``order_keys`` hour written when the key was the message id cannot catch a second publish:
    the run refuses it (writing nothing), and once rebuilt from order_lines the duplicate is dropped.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from orders_spark import LegacyOrderKeysError, order_rows, rebuild_order_keys, write_order_batch

    a = envelope("t/0/1", "eu", 10.5)
    write_order_batch(spark, order_rows([a]), str(tmp_path), "run_1")
    # What the pipeline wrote before this change: the partition's keys are message ids.
    [part] = (tmp_path / "order_keys").rglob("*.parquet")
    for old in part.parent.iterdir():
        old.unlink()
    pq.write_table(pa.table({"message_id": ["t/0/1"]}), part.parent / "part-legacy.parquet")

    second = order_rows([published_again(a, "t/0/9")])
    with pytest.raises(LegacyOrderKeysError, match="key_hour=2026-01-01T12"):
        write_order_batch(spark, second, str(tmp_path), "run_2")
    assert lines(spark, tmp_path) == [("o-t/0/1", "t/0/1", "run_1")]

    assert rebuild_order_keys(spark, str(tmp_path)) == 1
    assert pq.read_table(part.parent).column_names == ["order_id"]
    result = write_order_batch(spark, second, str(tmp_path), "run_2")
    assert (result["new"], result["duplicates"]) == (0, 1)
    assert totals(spark, tmp_path) == {("eu", "2026-01-01T12:00"): (1, 10.5)}
