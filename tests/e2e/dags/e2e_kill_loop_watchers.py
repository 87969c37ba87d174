"""
Kill loops (tests/e2e/test_kill_loop.py): several watchers on ONE shared stream of one broker.

``KILL_LOOP_BROKER`` picks the broker (``kafka``, ``sqs``, ``pubsub`` or ``servicebus``), the other
``KILL_LOOP_*`` variables name its source and connection. Every watcher passes the same producer
settings (so the triggerer runs one consumer and broadcasts each message to all of them) and its
own ``match`` (Airflow keeps one Trigger row for identical trigger kwargs, which would hide the
siblings); every ``eu`` order matches all of them.

One Dag is scheduled on any of the assets: Airflow registers a watcher only for an asset an
unpaused Dag is scheduled on. The test counts asset events, so the Dag's task never needs to run.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, AssetAny, AssetWatcher, dag, task

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

BROKER = os.environ.get("KILL_LOOP_BROKER", "kafka")
WATCHERS = int(os.environ.get("KILL_LOOP_WATCHERS", "5"))
CONN_ID = os.environ.get("KILL_LOOP_CONN_ID", "kill_loop")
SOURCE = os.environ.get("KILL_LOOP_SOURCE", "kill-loop")  # topic, queue URL, subscription path or queue name


def trigger(index: int) -> Any:
    watcher: dict[str, Any] = {"match": {"body.region": ["eu", f"w{index}"]}}
    if BROKER == "kafka":
        return KafkaSharedStreamTrigger(topics=[SOURCE], kafka_config_id=CONN_ID, dlq_topic=f"{SOURCE}.dlq", **watcher)
    if BROKER == "sqs":
        return SqsSharedStreamTrigger(queue_url=SOURCE, aws_conn_id=CONN_ID, wait_time_seconds=2, **watcher)
    if BROKER == "pubsub":
        return PubSubSharedStreamTrigger(subscription=SOURCE, gcp_conn_id=CONN_ID, **watcher)
    if BROKER == "servicebus":
        return ServiceBusSharedStreamTrigger(
            queue_name=SOURCE, azure_service_bus_conn_id=CONN_ID, max_wait_time=1.0, **watcher
        )
    raise ValueError(f"KILL_LOOP_BROKER={BROKER!r}: expected kafka, sqs, pubsub or servicebus")


assets = [
    Asset(f"kill_loop_w{index}", watchers=[AssetWatcher(name=f"kill_loop_w{index}", trigger=trigger(index))])
    for index in range(WATCHERS)
]


@dag(dag_id="kill_loop_consumer", schedule=AssetAny(*assets), max_active_runs=1, catchup=False)
def kill_loop_consumer() -> None:
    @task
    def consume() -> None:
        return None

    consume()


kill_loop_consumer()
