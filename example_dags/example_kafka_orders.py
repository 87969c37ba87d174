"""
Kafka: four AssetWatchers share ONE consumer of the ``orders`` topic.

Every watcher below passes the same producer settings (topic, connection, DLQ topic, ...), so the
triggerer runs one aiokafka consumer (group ``airflow-shared-stream.kafka_default.orders``) and
broadcasts each message to the four watchers; each applies its own filter (the table is in
``orders_dags.py``, the same on every broker).

The offset of a message is committed only after every watcher's asset event for it is stored in
the metadata DB (or it was dead-lettered), so a triggerer crash loses nothing; it may redeliver,
which is why the consumers below deduplicate on ``message_id``.

Connection (upstream Kafka provider shape)::

    AIRFLOW_CONN_KAFKA_DEFAULT='{"conn_type": "kafka",
        "extra": {"bootstrap.servers": "broker:9092", "auto.offset.reset": "earliest"}}'

Environment knobs (read when the Dag file is parsed): ``ORDERS_TOPIC`` (default ``orders``),
``ORDERS_DLQ_TOPIC`` (default ``<topic>.dlq``), ``ORDERS_KAFKA_CONN_ID`` (default ``kafka_default``).
"""

from __future__ import annotations

import os
from typing import Any

from orders_dags import declare_orders_dags

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
DLQ_TOPIC = os.environ.get("ORDERS_DLQ_TOPIC", f"{TOPIC}.dlq")
KAFKA_CONN_ID = os.environ.get("ORDERS_KAFKA_CONN_ID", "kafka_default")


def shared_stream_trigger(**options: Any) -> KafkaSharedStreamTrigger:
    """One watcher's trigger: the topic, connection and DLQ topic of every watcher, plus its own options."""
    return KafkaSharedStreamTrigger(topics=[TOPIC], kafka_config_id=KAFKA_CONN_ID, dlq_topic=DLQ_TOPIC, **options)


# The four assets and their Dags (orders_dags.py): each watcher has its own filter; all pass the
# same producer settings through shared_stream_trigger, so they share one stream.
assets = declare_orders_dags("kafka", shared_stream_trigger)
