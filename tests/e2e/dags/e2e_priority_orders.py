"""
A fifth watcher on the example ``orders`` stream, in another Dag file, with a filter that raises.

Same producer settings as ``example_kafka_orders.py`` (so it joins the same shared consumer); its
``filter_function`` raises on poison orders, which ``on_filter_error="reject"`` dead-letters.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetWatcher, dag, task

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")

priority = Asset(
    "kafka_orders_priority",
    watchers=[
        AssetWatcher(
            name="kafka_orders_priority",
            trigger=KafkaSharedStreamTrigger(
                topics=[TOPIC],
                kafka_config_id=os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default"),
                dlq_topic=os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq"),
                filter_function="e2e_filters.explode_on_poison",
                on_filter_error="reject",
            ),
        )
    ],
)


@dag(dag_id="kafka_orders_priority_consumer", schedule=[priority], max_active_runs=1, catchup=False)
def kafka_orders_priority_consumer() -> None:
    @task
    def handle(triggering_asset_events: Any = None) -> int:
        return sum(len(events) for events in (triggering_asset_events or {}).values())

    handle()


kafka_orders_priority_consumer()
