"""
Google Cloud Pub/Sub: four AssetWatchers share ONE streaming pull of the ``orders`` subscription.

The watchers pass identical producer settings, so the triggerer pulls once and broadcasts each
message to the four filters. A message is acknowledged only after every watcher's asset event for
it is stored (or it was published to ``dead_letter_topic``); until then its ack deadline is
extended, up to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Google provider's ``google_cloud_default`` (or any ``gcp_conn_id``).

Environment knobs (read when the Dag file is parsed): ``ORDERS_PUBSUB_SUBSCRIPTION``
(``projects/<p>/subscriptions/<s>``), ``ORDERS_PUBSUB_DLQ_TOPIC`` (``projects/<p>/topics/<t>``),
``ORDERS_GCP_CONN_ID``.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher
from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger

SUBSCRIPTION = os.environ.get("ORDERS_PUBSUB_SUBSCRIPTION", "projects/my-project/subscriptions/orders-airflow")
DLQ_TOPIC = os.environ.get("ORDERS_PUBSUB_DLQ_TOPIC", "projects/my-project/topics/orders-dlq")
GCP_CONN_ID = os.environ.get("ORDERS_GCP_CONN_ID", "google_cloud_default")


def orders_asset(name: str, **watcher_filter: Any) -> Asset:
    """An asset fired by its own watcher on the shared Pub/Sub stream: same producer settings, its own filter."""
    trigger = PubSubSharedStreamTrigger(
        subscription=SUBSCRIPTION,
        gcp_conn_id=GCP_CONN_ID,
        dead_letter_topic=DLQ_TOPIC,
        **stream_options(),
        **watcher_filter,
    )
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


orders_eu = orders_asset("pubsub_orders_eu", match={"body.region": "eu"})
orders_us_apac = orders_asset("pubsub_orders_us_apac", match={"body.region": ["us", "apac"]})
orders_big = orders_asset("pubsub_orders_big", filter_function="order_filters.is_big_order")
orders_valid = orders_asset(
    "pubsub_orders_valid",
    filter_function="order_filters.require_valid_order",
    flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
)

# A Dag per asset, run on the asset's events (order_events.consumer_dag: dedup, one receipt per order).
consumer_dag("pubsub_orders_eu_consumer", schedule=[orders_eu], sink="pubsub_eu", broker="pubsub")
consumer_dag("pubsub_orders_us_apac_consumer", schedule=[orders_us_apac], sink="pubsub_us_apac", broker="pubsub")
consumer_dag("pubsub_orders_big_consumer", schedule=[orders_big], sink="pubsub_big", broker="pubsub")
build_orders_spark_pipeline(dag_id="pubsub_orders_spark_pipeline", source=orders_valid, dataset="pubsub")
