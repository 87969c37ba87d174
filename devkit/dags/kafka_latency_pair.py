"""
The latency pair: the upstream Kafka provider's shared stream and ours, each with **one** watcher
and the same light consumer task, on the same ``orders`` topic (``devkit.production
--upstream-kafka``, ``bench.production``; the comparison of docs/production.md).

* ``upstream_kafka_orders``: ``apache-airflow-providers-apache-kafka``'s
  ``KafkaSharedStreamTrigger``, consumer group set in the ``kafka_upstream`` connection (upstream
  requires one there);
* ``ours_kafka_orders_n1``: our ``KafkaSharedStreamTrigger`` with default settings (per-message,
  no filter) on the example Dags' connection, in a consumer group of its own so that it is a stream
  of one watcher, not a fifth watcher on the example stream.

Both Dags are built by one function: what differs is the trigger, nothing downstream. Each task
counts the orders among its run's events (upstream's payload is the message text, ours the
envelope's parsed body).
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.providers.apache.kafka.triggers.shared_stream import KafkaSharedStreamTrigger as UpstreamTrigger
from airflow.sdk import Asset, AssetWatcher, dag, task
from airflow.triggers.base import BaseEventTrigger

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")
UPSTREAM_ASSET = "upstream_kafka_orders"
OURS_ASSET = "ours_kafka_orders_n1"
OURS_GROUP_ID = "airflow-ours-kafka-orders-n1"


def order_in(event_extra: Any) -> bool:
    """
    Whether one asset event carries an order (a JSON object body), in either provider's shape: the
    event's ``payload`` is upstream's message text, or our envelope with the body already parsed.
    """
    extra = event_extra if isinstance(event_extra, dict) else {}
    payload = extra.get("payload")
    if isinstance(payload, str):
        try:
            payload = {"body": json.loads(payload)}
        except ValueError:
            return False
    return isinstance(payload, dict) and isinstance(payload.get("body"), dict)


def watched_asset(name: str, trigger: BaseEventTrigger) -> Asset:
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


def light_consumer(dag_id: str, asset: Asset) -> None:
    """One task that counts its run's orders: the lightest consumer a user writes."""

    @dag(dag_id=dag_id, schedule=[asset], max_active_runs=1, catchup=False, tags=["latency-pair"])
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> int:
            events = [event for group in (triggering_asset_events or {}).values() for event in group]
            return sum(order_in(event.extra) for event in events)

        handle_orders()

    consumer()


light_consumer(
    f"{UPSTREAM_ASSET}_consumer",
    watched_asset(UPSTREAM_ASSET, UpstreamTrigger(topics=[TOPIC], kafka_config_id="kafka_upstream")),
)
light_consumer(
    f"{OURS_ASSET}_consumer",
    watched_asset(
        OURS_ASSET, KafkaSharedStreamTrigger(topics=[TOPIC], kafka_config_id=KAFKA_CONN_ID, group_id=OURS_GROUP_ID)
    ),
)
