"""
The PySpark pipeline's batch logic on a real local SparkSession (no Airflow): idempotent re-runs,
duplicates across batches, and the aggregates.
"""

from __future__ import annotations

from collections.abc import Iterator
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
