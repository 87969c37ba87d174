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

Both Dags are built by one function (``light_consumer.py``, copied beside this file): what differs
is the trigger, nothing downstream. Each task counts the orders among its run's events (upstream's
payload is the message text, ours the envelope's parsed body).
"""

from __future__ import annotations

import os

from airflow.providers.apache.kafka.triggers.shared_stream import KafkaSharedStreamTrigger as UpstreamTrigger
from light_consumer import light_consumer, watched_asset

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")
UPSTREAM_ASSET = "upstream_kafka_orders"
OURS_ASSET = "ours_kafka_orders_n1"
OURS_GROUP_ID = "airflow-ours-kafka-orders-n1"


light_consumer(
    f"{UPSTREAM_ASSET}_consumer",
    watched_asset(UPSTREAM_ASSET, UpstreamTrigger(topics=[TOPIC], kafka_config_id="kafka_upstream")),
    tags=["latency-pair"],
)
light_consumer(
    f"{OURS_ASSET}_consumer",
    watched_asset(
        OURS_ASSET, KafkaSharedStreamTrigger(topics=[TOPIC], kafka_config_id=KAFKA_CONN_ID, group_id=OURS_GROUP_ID)
    ),
    tags=["latency-pair"],
)
