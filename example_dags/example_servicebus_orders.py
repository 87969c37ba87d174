"""
Azure Service Bus: four AssetWatchers share ONE receiver of the ``orders`` queue.

The watchers pass identical producer settings, so the triggerer receives once (peek-lock) and
broadcasts each message to the four filters. A message is completed only after every watcher's
asset event for it is stored; a rejected one (``RejectMessage``, oversize, poison) is moved to the
entity's own dead-letter sub-queue. Locks are renewed up to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Microsoft Azure provider's ``azure_service_bus_default`` (connection string or
fully-qualified namespace + credential).

Environment knobs (read when the Dag file is parsed): ``ORDERS_SERVICEBUS_QUEUE``,
``ORDERS_SERVICEBUS_CONN_ID``.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher, dag, task
from order_events import pipeline_flush_after, record_receipts, stream_options, unique_envelopes
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger

QUEUE = os.environ.get("ORDERS_SERVICEBUS_QUEUE", "orders")
CONN_ID = os.environ.get("ORDERS_SERVICEBUS_CONN_ID", "azure_service_bus_default")


def orders_watcher(name: str, **watcher_filter: Any) -> AssetWatcher:
    """A watcher on the shared Service Bus stream: same producer settings, its own filter."""
    trigger = ServiceBusSharedStreamTrigger(
        queue_name=QUEUE, azure_service_bus_conn_id=CONN_ID, **stream_options(), **watcher_filter
    )
    return AssetWatcher(name=name, trigger=trigger)


orders_eu = Asset(
    "servicebus_orders_eu", watchers=[orders_watcher("servicebus_orders_eu", match={"body.region": "eu"})]
)
orders_us_apac = Asset(
    "servicebus_orders_us_apac",
    watchers=[orders_watcher("servicebus_orders_us_apac", match={"body.region": ["us", "apac"]})],
)
orders_big = Asset(
    "servicebus_orders_big",
    watchers=[orders_watcher("servicebus_orders_big", filter_function="order_filters.is_big_order")],
)
orders_valid = Asset(
    "servicebus_orders_valid",
    watchers=[
        orders_watcher(
            "servicebus_orders_valid",
            filter_function="order_filters.require_valid_order",
            flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
        )
    ],
)


def consumer_dag(dag_id: str, asset: Asset, sink: str) -> None:
    @dag(dag_id=dag_id, schedule=[asset], max_active_runs=1, catchup=False, tags=["shared-stream", "servicebus"])
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> dict[str, int]:
            envelopes = unique_envelopes(triggering_asset_events)  # dedup on message_id
            return {"events": len(envelopes), **record_receipts(envelopes, sink)}

        handle_orders()

    consumer()


consumer_dag("servicebus_orders_eu_consumer", orders_eu, "servicebus_eu")
consumer_dag("servicebus_orders_us_apac_consumer", orders_us_apac, "servicebus_us_apac")
consumer_dag("servicebus_orders_big_consumer", orders_big, "servicebus_big")
build_orders_spark_pipeline(dag_id="servicebus_orders_spark_pipeline", source=orders_valid, dataset="servicebus")
