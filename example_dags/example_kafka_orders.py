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

from airflow.sdk import Asset, AssetWatcher, dag, task
from order_events import pipeline_flush_after, record_receipts, stream_options, unique_envelopes
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
DLQ_TOPIC = os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")


def orders_watcher(name: str, **watcher_filter: Any) -> AssetWatcher:
    """A watcher on the shared ``orders`` stream: same producer settings, its own filter."""
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC],
        kafka_config_id=KAFKA_CONN_ID,
        dlq_topic=DLQ_TOPIC,
        **stream_options(),
        **watcher_filter,
    )
    return AssetWatcher(name=name, trigger=trigger)


orders_eu = Asset("kafka_orders_eu", watchers=[orders_watcher("kafka_orders_eu", match={"body.region": "eu"})])
orders_us_apac = Asset(
    "kafka_orders_us_apac",
    watchers=[orders_watcher("kafka_orders_us_apac", match={"body.region": ["us", "apac"]})],
)
orders_big = Asset(
    "kafka_orders_big",
    watchers=[orders_watcher("kafka_orders_big", filter_function="order_filters.is_big_order")],
)
orders_valid = Asset(
    "kafka_orders_valid",
    watchers=[
        orders_watcher(
            "kafka_orders_valid",
            filter_function="order_filters.require_valid_order",
            flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
        )
    ],
)


def consumer_dag(dag_id: str, asset: Asset, sink: str) -> None:
    """An asset-scheduled Dag that handles the batch of orders its run was created for."""

    @dag(
        dag_id=dag_id,
        schedule=[asset],
        max_active_runs=1,  # later events queue up and land in the next run's batch
        catchup=False,
        tags=["shared-stream", "kafka"],
    )
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> dict[str, int]:
            # One run may carry many events; a redelivered message has the same message_id.
            envelopes = unique_envelopes(triggering_asset_events)
            for envelope in envelopes:
                body = envelope["body"]
                print(f"{envelope['message_id']} attempt={envelope['delivery_attempt']}: {body}")
            counts = record_receipts(envelopes, sink)  # idempotent side effect
            return {"events": len(envelopes), **counts}

        handle_orders()

    consumer()


consumer_dag("kafka_orders_eu_consumer", orders_eu, "kafka_eu")
consumer_dag("kafka_orders_us_apac_consumer", orders_us_apac, "kafka_us_apac")
consumer_dag("kafka_orders_big_consumer", orders_big, "kafka_big")

# All well-formed orders feed the PySpark pipeline (revenue per region and minute, in Parquet).
build_orders_spark_pipeline(dag_id="kafka_orders_spark_pipeline", source=orders_valid, dataset="kafka")
