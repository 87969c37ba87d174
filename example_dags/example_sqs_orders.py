"""
SQS: four AssetWatchers share ONE poller of the ``orders`` queue.

Same shape as ``example_kafka_orders.py``: the watchers pass identical producer settings (queue URL,
connection, DLQ queue, ...), so the triggerer runs one receive loop and broadcasts each message to
the four filters. A message is deleted from the queue only after every watcher's asset event for
it is stored (or it was moved to the DLQ queue); until then its visibility timeout is extended, up
to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Amazon provider's shape, e.g. ``AIRFLOW_CONN_AWS_DEFAULT='{"conn_type": "aws",
"extra": {"region_name": "eu-west-1"}}'`` (add ``"endpoint_url"`` for a local endpoint).

Environment knobs (read when the Dag file is parsed): ``ORDERS_SQS_QUEUE_URL``,
``ORDERS_SQS_DLQ_URL``, ``ORDERS_AWS_CONN_ID`` (default ``aws_default``).
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher
from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

QUEUE_URL = os.environ.get("ORDERS_SQS_QUEUE_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
DLQ_URL = os.environ.get("ORDERS_SQS_DLQ_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq")
AWS_CONN_ID = os.environ.get("ORDERS_AWS_CONN_ID", "aws_default")


def orders_asset(name: str, **watcher_filter: Any) -> Asset:
    """An asset fired by its own watcher on the shared SQS stream: same producer settings, its own filter."""
    trigger = SqsSharedStreamTrigger(
        queue_url=QUEUE_URL, aws_conn_id=AWS_CONN_ID, dlq_queue_url=DLQ_URL, **stream_options(), **watcher_filter
    )
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


orders_eu = orders_asset("sqs_orders_eu", match={"body.region": "eu"})
orders_us_apac = orders_asset("sqs_orders_us_apac", match={"body.region": ["us", "apac"]})
orders_big = orders_asset("sqs_orders_big", filter_function="order_filters.is_big_order")
orders_valid = orders_asset(
    "sqs_orders_valid",
    filter_function="order_filters.require_valid_order",
    flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
)

# A Dag per asset, run on the asset's events (order_events.consumer_dag: dedup, one receipt per order).
consumer_dag("sqs_orders_eu_consumer", schedule=[orders_eu], sink="sqs_eu", broker="sqs")
consumer_dag("sqs_orders_us_apac_consumer", schedule=[orders_us_apac], sink="sqs_us_apac", broker="sqs")
consumer_dag("sqs_orders_big_consumer", schedule=[orders_big], sink="sqs_big", broker="sqs")
build_orders_spark_pipeline(dag_id="sqs_orders_spark_pipeline", source=orders_valid, dataset="sqs")
