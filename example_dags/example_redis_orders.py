"""
Redis Streams: four AssetWatchers share ONE consumer-group reader of the ``orders`` stream.

Same shape as ``example_kafka_orders.py``: the watchers pass identical producer settings (stream,
connection, group, dead-letter stream, ...), so the triggerer runs one ``XREADGROUP`` loop and
broadcasts each entry to the four filters. An entry is acknowledged (``XACK``) only after every
watcher's asset event for it is stored (or it was copied to the dead-letter stream); until then
its idle time is kept below ``claim_idle``, so no other consumer of the group claims it.

Connection: the Redis provider's shape, e.g. ``AIRFLOW_CONN_REDIS_DEFAULT='{"conn_type": "redis",
"host": "localhost", "port": 6379, "extra": {"db": 0}}'``.

Environment knobs (read when the Dag file is parsed): ``ORDERS_REDIS_STREAM`` (default
``orders``), ``ORDERS_REDIS_DEAD_LETTER_STREAM`` (default ``orders:dead-letter``),
``ORDERS_REDIS_CONN_ID`` (default ``redis_default``).
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher
from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger

STREAM = os.environ.get("ORDERS_REDIS_STREAM", "orders")
DEAD_LETTER_STREAM = os.environ.get("ORDERS_REDIS_DEAD_LETTER_STREAM", f"{STREAM}:dead-letter")
REDIS_CONN_ID = os.environ.get("ORDERS_REDIS_CONN_ID", "redis_default")


def orders_asset(name: str, **watcher_filter: Any) -> Asset:
    """An asset fired by its own watcher on the shared Redis stream: same producer settings, its own filter."""
    trigger = RedisSharedStreamTrigger(
        stream=STREAM,
        redis_conn_id=REDIS_CONN_ID,
        dead_letter_stream=DEAD_LETTER_STREAM,
        **stream_options(),
        **watcher_filter,
    )
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


orders_eu = orders_asset("redis_orders_eu", match={"body.region": "eu"})
orders_us_apac = orders_asset("redis_orders_us_apac", match={"body.region": ["us", "apac"]})
orders_big = orders_asset("redis_orders_big", filter_function="order_filters.is_big_order")
orders_valid = orders_asset(
    "redis_orders_valid",
    filter_function="order_filters.require_valid_order",
    flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
)

# A Dag per asset, run on the asset's events (order_events.consumer_dag: dedup, one receipt per order).
consumer_dag("redis_orders_eu_consumer", schedule=[orders_eu], sink="redis_eu", broker="redis")
consumer_dag("redis_orders_us_apac_consumer", schedule=[orders_us_apac], sink="redis_us_apac", broker="redis")
consumer_dag("redis_orders_big_consumer", schedule=[orders_big], sink="redis_big", broker="redis")
build_orders_spark_pipeline(dag_id="redis_orders_spark_pipeline", source=orders_valid, dataset="redis")
