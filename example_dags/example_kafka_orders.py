"""
Kafka: four AssetWatchers share ONE consumer of the ``orders`` topic.

Every watcher below passes the same producer settings (topic, connection, DLQ topic, ...), so the
triggerer runs one aiokafka consumer (group ``airflow-shared-stream.kafka_default.orders``) and
broadcasts each message to the four watchers; each applies its own filter:

=====================  =============================================  ================================
asset                  filter                                         what it shows
=====================  =============================================  ================================
``kafka_orders_eu``    ``match={"body.region": "eu"}``                equality on an envelope path
``kafka_orders_us_apac`` ``match={"body.region": ["us", "apac"]}``    "any of"
``kafka_orders_big``   ``filter_function="order_filters.is_big_order"`` a Python predicate
``kafka_orders_valid`` ``filter_function="order_filters.require_valid_order"`` ``RejectMessage``:
                                                                      malformed orders go to the DLQ
=====================  =============================================  ================================

The offset of a message is committed only after every watcher's asset event for it is stored in
the metadata DB (or it was dead-lettered), so a triggerer crash loses nothing; it may redeliver,
which is why the consumers below deduplicate on ``message_id``.

Connection (upstream Kafka provider shape)::

    AIRFLOW_CONN_KAFKA_DEFAULT='{"conn_type": "kafka",
        "extra": {"bootstrap.servers": "broker:9092", "auto.offset.reset": "earliest"}}'

Environment knobs (read when the Dag file is parsed): ``ORDERS_TOPIC`` (default ``orders``),
``ORDERS_DLQ_TOPIC`` (default ``<topic>.dlq``), ``ORDERS_KAFKA_CONN_ID`` (default ``kafka_default``).
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher
from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
DLQ_TOPIC = os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")


def orders_asset(name: str, **watcher_filter: Any) -> Asset:
    """An asset fired by its own watcher on the shared ``orders`` stream: same producer settings, its own filter."""
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC],
        kafka_config_id=KAFKA_CONN_ID,
        dlq_topic=DLQ_TOPIC,
        **stream_options(),
        **watcher_filter,
    )
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


orders_eu = orders_asset("kafka_orders_eu", match={"body.region": "eu"})
orders_us_apac = orders_asset("kafka_orders_us_apac", match={"body.region": ["us", "apac"]})
orders_big = orders_asset("kafka_orders_big", filter_function="order_filters.is_big_order")
orders_valid = orders_asset(
    "kafka_orders_valid",
    filter_function="order_filters.require_valid_order",
    flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
)

# A Dag per asset, run on the asset's events (order_events.consumer_dag: dedup, one receipt per order).
consumer_dag("kafka_orders_eu_consumer", schedule=[orders_eu], sink="kafka_eu", broker="kafka")
consumer_dag("kafka_orders_us_apac_consumer", schedule=[orders_us_apac], sink="kafka_us_apac", broker="kafka")
consumer_dag("kafka_orders_big_consumer", schedule=[orders_big], sink="kafka_big", broker="kafka")

# All well-formed orders feed the PySpark pipeline (revenue per region and minute, in Parquet).
build_orders_spark_pipeline(dag_id="kafka_orders_spark_pipeline", source=orders_valid, dataset="kafka")
