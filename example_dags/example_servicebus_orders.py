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

from airflow.sdk import Asset, AssetWatcher
from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger

QUEUE = os.environ.get("ORDERS_SERVICEBUS_QUEUE", "orders")
CONN_ID = os.environ.get("ORDERS_SERVICEBUS_CONN_ID", "azure_service_bus_default")


def orders_asset(name: str, **watcher_filter: Any) -> Asset:
    """An asset fired by its own watcher on the shared Service Bus stream: same producer settings, its own filter."""
    trigger = ServiceBusSharedStreamTrigger(
        queue_name=QUEUE, azure_service_bus_conn_id=CONN_ID, **stream_options(), **watcher_filter
    )
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


orders_eu = orders_asset("servicebus_orders_eu", match={"body.region": "eu"})
orders_us_apac = orders_asset("servicebus_orders_us_apac", match={"body.region": ["us", "apac"]})
orders_big = orders_asset("servicebus_orders_big", filter_function="order_filters.is_big_order")
orders_valid = orders_asset(
    "servicebus_orders_valid",
    filter_function="order_filters.require_valid_order",
    flush_after=pipeline_flush_after(),  # the tail of a burst gets its pipeline run (Airflow 3.3)
)

# A Dag per asset, run on the asset's events (order_events.consumer_dag: dedup, one receipt per order).
consumer_dag("servicebus_orders_eu_consumer", schedule=[orders_eu], sink="servicebus_eu", broker="servicebus")
consumer_dag(
    "servicebus_orders_us_apac_consumer", schedule=[orders_us_apac], sink="servicebus_us_apac", broker="servicebus"
)
consumer_dag("servicebus_orders_big_consumer", schedule=[orders_big], sink="servicebus_big", broker="servicebus")
build_orders_spark_pipeline(dag_id="servicebus_orders_spark_pipeline", source=orders_valid, dataset="servicebus")
