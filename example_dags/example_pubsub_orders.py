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

from airflow.sdk import Asset, AssetWatcher, dag, task
from order_events import pipeline_flush_after, record_receipts, stream_options, unique_envelopes
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger

SUBSCRIPTION = os.environ.get("ORDERS_PUBSUB_SUBSCRIPTION", "projects/my-project/subscriptions/orders-airflow")
DLQ_TOPIC = os.environ.get("ORDERS_PUBSUB_DLQ_TOPIC", "projects/my-project/topics/orders-dlq")
GCP_CONN_ID = os.environ.get("ORDERS_GCP_CONN_ID", "google_cloud_default")


def orders_watcher(name: str, **watcher_filter: Any) -> AssetWatcher:
    """A watcher on the shared Pub/Sub stream: same producer settings, its own filter."""
    trigger = PubSubSharedStreamTrigger(
        subscription=SUBSCRIPTION,
        gcp_conn_id=GCP_CONN_ID,
        dead_letter_topic=DLQ_TOPIC,
        **stream_options(),
        **watcher_filter,
    )
    return AssetWatcher(name=name, trigger=trigger)


orders_eu = Asset("pubsub_orders_eu", watchers=[orders_watcher("pubsub_orders_eu", match={"body.region": "eu"})])
orders_us_apac = Asset(
    "pubsub_orders_us_apac",
    watchers=[orders_watcher("pubsub_orders_us_apac", match={"body.region": ["us", "apac"]})],
)
orders_big = Asset(
    "pubsub_orders_big", watchers=[orders_watcher("pubsub_orders_big", filter_function="order_filters.is_big_order")]
)
orders_valid = Asset(
    "pubsub_orders_valid",
    watchers=[
        orders_watcher(
            "pubsub_orders_valid",
            filter_function="order_filters.require_valid_order",
            flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
        )
    ],
)


def consumer_dag(dag_id: str, asset: Asset, sink: str) -> None:
    @dag(dag_id=dag_id, schedule=[asset], max_active_runs=1, catchup=False, tags=["shared-stream", "pubsub"])
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> dict[str, int]:
            envelopes = unique_envelopes(triggering_asset_events)  # dedup on message_id
            return {"events": len(envelopes), **record_receipts(envelopes, sink)}

        handle_orders()

    consumer()


consumer_dag("pubsub_orders_eu_consumer", orders_eu, "pubsub_eu")
consumer_dag("pubsub_orders_us_apac_consumer", orders_us_apac, "pubsub_us_apac")
consumer_dag("pubsub_orders_big_consumer", orders_big, "pubsub_big")
build_orders_spark_pipeline(dag_id="pubsub_orders_spark_pipeline", source=orders_valid, dataset="pubsub")
