"""
The orders pipeline's cost as its history grows: one run of ``write_order_batch`` (the Spark task
of example_dags/orders_spark.py) on top of a generated history of N stored orders.

Usage::

    .venv/bin/python -m bench.pipeline_history_bench [--history 10000,1000000] [--batch 200]
        [--days 30] [--per-batch 100] [--master local[2]]

For each N the bench writes a history of N orders straight into the pipeline's datasets
(``order_lines`` partitioned by ``batch_id``, ``order_keys`` by ``key_hour`` / ``batch_id``), in
batches of ``--per-batch`` orders spread over the last ``--days`` days, as the Dag would have left
them, then times:

* **run**: one ``write_order_batch`` of ``--batch`` messages of the current hour: half of them
  orders stored earlier in that hour, sent again (every other one a redelivery with the same
  ``message_id``, the others a second publish with a new one), and a tenth second publishes of
  the batch's own new orders; every duplicate must be dropped (the result is checked);
* **whole-history dedup**: the anti-join the pipeline did before ``order_keys`` (every stored
  ``order_id`` of ``order_lines``), on the same history, for comparison.

Each time is the best of ``--repeat`` runs (a retry of the same batch id, which the pipeline
makes idempotent), after one warm-up run, on a fresh SparkSession per history size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "example_dags"))

from orders_spark import write_order_batch  # noqa: E402  # example_dags on sys.path


def generate_history(base: Path, orders: int, days: int, per_batch: int, now: datetime) -> int:
    """
    ``orders`` stored orders in batches of ``per_batch`` (one Dag run each), spread evenly over the
    ``days`` days before ``now``'s hour, written as the pipeline lays them out (one Parquet file per
    ``order_lines`` batch partition and per ``order_keys`` hour x batch partition). Written with
    pyarrow directly: Spark takes minutes for ten thousand tiny partitions. Returns the batch count.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    batches = max(1, orders // per_batch)
    start = now.replace(minute=0, second=0, microsecond=0) - timedelta(days=days)
    span = days * 24 * 3600
    regions = ("eu", "us", "apac")
    for b in range(batches):
        moment = start + timedelta(seconds=span * b // batches)
        minute = moment.strftime("%Y-%m-%dT%H:%M")
        first = b * per_batch
        ids = [f"hist-{i}" for i in range(first, first + per_batch)]
        lines = pa.table(
            {
                "message_id": ids,
                "order_id": [f"o-{i}" for i in ids],
                "region": [regions[i % 3] for i in range(first, first + per_batch)],
                "amount": [float(i % 10_000) / 100 for i in range(first, first + per_batch)],
                "minute": [minute] * per_batch,
            }
        )
        batch_id = f"hist_{b}"
        lines_dir = base / "order_lines" / f"batch_id={batch_id}"
        keys_dir = base / "order_keys" / f"key_hour={minute[:13]}" / f"batch_id={batch_id}"
        lines_dir.mkdir(parents=True)
        keys_dir.mkdir(parents=True)
        pq.write_table(lines, lines_dir / "part-0.parquet")
        pq.write_table(lines.select(["order_id"]), keys_dir / "part-0.parquet")
    return batches


def new_batch(size: int, now: datetime, base: Path, spark: Any) -> tuple[list[dict[str, Any]], int]:
    """
    ``size`` rows of ``now``'s hour. The orders of the first half are stored first by an earlier
    batch of the same hour; in the measured run every other one is a redelivery (same message id),
    the others a second publish (new message id, same order). The last tenth are second publishes
    of the batch's first new orders. Returns the rows and how many are new.
    """
    minute = now.strftime("%Y-%m-%dT%H:%M")

    def row(message_id: str, order: int) -> dict[str, Any]:
        return {
            "message_id": message_id,
            "order_id": f"o-new-{order}",
            "region": "eu",
            "amount": 1.25,
            "minute": minute,
        }

    stored, repeats = size // 2, size // 10
    write_order_batch(spark, [row(f"new-{i}", i) for i in range(stored)], str(base), "earlier_this_hour")
    rows = [row(f"new-{i}" if i % 2 == 0 else f"new-{i}-again", i) for i in range(stored)]
    rows += [row(f"new-{i}", i) for i in range(stored, size - repeats)]
    rows += [row(f"new-{i}-again", i) for i in range(stored, stored + repeats)]
    return rows, size - stored - repeats


def whole_history_dedup(spark: Any, base: Path, rows: list[dict[str, Any]]) -> int:
    """The anti-join against every stored ``order_id`` (what the pipeline did before order_keys)."""
    from pyspark.sql import functions as F  # noqa: N812

    batch = spark.createDataFrame([(r["order_id"],) for r in rows], "order_id string")
    stored = spark.read.parquet(str(base / "order_lines"))
    earlier = stored.where(F.col("batch_id") != F.lit("measured")).select("order_id")
    return int(batch.join(earlier, on="order_id", how="left_anti").count())


def measure(history: int, args: argparse.Namespace) -> dict[str, Any]:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(args.master)
        .appName("pipeline-history-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    base = Path(tempfile.mkdtemp(prefix="orders-history-"))
    try:
        now = datetime.now(timezone.utc)
        started = time.monotonic()
        batches = generate_history(base, history, args.days, args.per_batch, now)
        generated = time.monotonic() - started
        rows, expected_new = new_batch(args.batch, now, base, spark)
        runs: list[float] = []
        result: dict[str, Any] = {}
        for _ in range(args.repeat + 1):  # the first is the warm-up
            started = time.monotonic()
            result = write_order_batch(spark, rows, str(base), "measured")
            runs.append(time.monotonic() - started)
        if (result["new"], result["duplicates"]) != (expected_new, len(rows) - expected_new):
            raise AssertionError(f"expected {expected_new} new orders of {len(rows)}, the run stored: {result}")
        full: list[float] = []
        for _ in range(args.repeat + 1):
            started = time.monotonic()
            whole_history_dedup(spark, base, rows)
            full.append(time.monotonic() - started)
        return {
            "history_orders": history,
            "history_batches": batches,
            "batch": args.batch,
            "new": result["new"],
            "duplicates": result["duplicates"],
            "generate_s": round(generated, 1),
            "run_s": round(min(runs[1:]), 2),
            "whole_history_dedup_s": round(min(full[1:]), 2),
        }
    finally:
        spark.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", default="10000,1000000", help="comma-separated stored-order counts")
    parser.add_argument("--batch", type=int, default=200, help="orders in the measured run")
    parser.add_argument("--days", type=int, default=30, help="days the history spans")
    parser.add_argument("--per-batch", type=int, default=100, help="orders per stored batch (Dag run)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best is kept)")
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    rows = [measure(int(n), args) for n in args.history.split(",")]
    print("| stored orders | batches | run (write_order_batch) | whole-history dedup (before) | new / dropped |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['history_orders']:,} | {r['history_batches']} | {r['run_s']:.2f} s "
            f"| {r['whole_history_dedup_s']:.2f} s | {r['new']} / {r['duplicates']} |"
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
