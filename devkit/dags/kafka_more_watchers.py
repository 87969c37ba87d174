"""
More watchers on the example Kafka stream (``devkit.production --more-watchers N``,
``bench.production``): issue 23's "10 watchers" is the four of ``example_kafka_orders.py`` plus
six of these.

Each trigger passes **the same producer settings** as the example's (topic, connection, DLQ topic,
``batch_size`` from ``$ORDERS_BATCH_SIZE``), so it joins the example's shared stream, one more
subscriber of its one consumer, not a consumer of its own. Watcher ``i`` (1-based) takes the
filter of one of the example's plain roles, in turn: ``match`` on ``eu``, ``match`` on
``us``/``apac``, ``order_filters.is_big_order``; ``devkit.production.more_watchers`` gives the same
names and roles, from which the run knows what each must receive. Each feeds a one-task consumer
Dag (``light_consumer.py``, copied beside this file).

``$ORDERS_MORE_WATCHERS``: how many (default 0: this file defines nothing).
"""

from __future__ import annotations

import os
from typing import Any

from light_consumer import light_consumer, watched_asset
from order_events import stream_options

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

# The example's settings (example_kafka_orders.py): the same stream only if every one is equal.
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
DLQ_TOPIC = os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")
COUNT = int(os.environ.get("ORDERS_MORE_WATCHERS") or 0)

ROLE_FILTERS: dict[str, dict[str, Any]] = {
    "kafka_orders_eu": {"match": {"body.region": "eu"}},
    "kafka_orders_us_apac": {"match": {"body.region": ["us", "apac"]}},
    "kafka_orders_big": {"filter_function": "order_filters.is_big_order"},
}

for index in range(COUNT):
    name = f"kafka_orders_more_{index + 1:02d}"
    role = list(ROLE_FILTERS)[index % len(ROLE_FILTERS)]
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC], kafka_config_id=KAFKA_CONN_ID, dlq_topic=DLQ_TOPIC, **stream_options(), **ROLE_FILTERS[role]
    )
    light_consumer(f"{name}_consumer", watched_asset(name, trigger), tags=["more-watchers"])
