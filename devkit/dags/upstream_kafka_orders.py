"""
The upstream Kafka provider's shared stream on the same ``orders`` topic, for comparison in the
production topology (``devkit.production --upstream-kafka``, ``bench.production``).

One AssetWatcher with ``apache-airflow-providers-apache-kafka``'s ``KafkaSharedStreamTrigger``
(its own consumer group, set in the ``kafka_upstream`` connection as upstream requires) and one
asset-scheduled Dag whose task reads the run's events, as our example consumers do. Upstream's
payload is the message text, so the task parses it to count orders.
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.providers.apache.kafka.triggers.shared_stream import KafkaSharedStreamTrigger
from airflow.sdk import Asset, AssetWatcher, dag, task

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
ASSET_NAME = "upstream_kafka_orders"

orders = Asset(
    ASSET_NAME,
    watchers=[
        AssetWatcher(
            name=ASSET_NAME, trigger=KafkaSharedStreamTrigger(topics=[TOPIC], kafka_config_id="kafka_upstream")
        )
    ],
)


@dag(dag_id="upstream_kafka_orders_consumer", schedule=[orders], max_active_runs=1, catchup=False, tags=["upstream"])
def upstream_consumer() -> None:
    @task
    def handle_orders(triggering_asset_events: Any = None) -> int:
        count = 0
        for events in (triggering_asset_events or {}).values():
            for event in events:
                payload = (event.extra or {}).get("payload")
                try:
                    body = json.loads(payload) if isinstance(payload, str) else None
                except ValueError:
                    body = None
                count += isinstance(body, dict)
        return count

    handle_orders()


upstream_consumer()
