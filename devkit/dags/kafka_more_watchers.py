"""
More watchers on the example Kafka stream (``devkit.production --more-watchers N``,
``bench.production``): issue 23's "10 watchers" is the four of ``example_kafka_orders.py`` plus
six of these.

Each trigger passes **the same producer settings** as the example's (topic, connection, DLQ topic,
``batch_size`` from ``$ORDERS_BATCH_SIZE``), so it joins the example's shared stream, one more
subscriber of its one consumer, not a consumer of its own. Each has a ``match`` filter on a set
of regions of its own (``REGION_SETS``): Airflow 3.3 gives two watchers whose triggers serialize
the same **one** trigger row (one subscriber firing for both assets), so six watchers with equal
filters would be three subscribers, not six. ``devkit.production.more_watchers`` gives the same
names and region sets, from which the run knows what each must receive. Each feeds a one-task
consumer Dag (``light_consumer.py``, copied beside this file).

``$ORDERS_MORE_WATCHERS``: how many, at most ``len(REGION_SETS)`` (default 0: this file defines nothing).
"""

from __future__ import annotations

import os

from light_consumer import light_consumer, watched_asset
from order_events import stream_options

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

# The example's settings (example_kafka_orders.py): the same stream only if every one is equal.
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
DLQ_TOPIC = os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")
WATCHER_COUNT = int(os.environ.get("ORDERS_MORE_WATCHERS") or 0)

# Distinct from each other and from the example's filters (its eu watcher matches "eu", its
# us_apac watcher ["us", "apac"]): every watcher here is a trigger, and a subscriber, of its own.
REGION_SETS: tuple[tuple[str, ...], ...] = (
    ("us",),
    ("apac",),
    ("eu", "us"),
    ("apac", "eu"),
    ("apac", "eu", "us"),
    ("eu", "us", "apac", "latam"),
)
if not 0 <= WATCHER_COUNT <= len(REGION_SETS):
    raise ValueError(f"ORDERS_MORE_WATCHERS={WATCHER_COUNT}: 0 to {len(REGION_SETS)} (one distinct filter each)")

for index, regions in enumerate(REGION_SETS[:WATCHER_COUNT]):
    name = f"kafka_orders_more_{index + 1:02d}"
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC],
        kafka_config_id=KAFKA_CONN_ID,
        dlq_topic=DLQ_TOPIC,
        **stream_options(),
        match={"body.region": list(regions)},
    )
    light_consumer(f"{name}_consumer", watched_asset(name, trigger), tags=["more-watchers"])
