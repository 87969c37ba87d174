"""
20 watchers on one Kafka topic, for two triggerers on one metadata DB
(tests/e2e/test_two_triggerers_e2e.py): each watcher has its own filter (its own trigger row, so the
triggerers can split them), and every message matches all of them.
"""

from __future__ import annotations

import os

from airflow.sdk import Asset, AssetAny, AssetWatcher, dag, task

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ["TWO_TRIGGERERS_TOPIC"]
CONN_ID = os.environ["TWO_TRIGGERERS_CONN_ID"]
WATCHERS = int(os.environ.get("TWO_TRIGGERERS_WATCHERS", "20"))


def watcher(index: int) -> AssetWatcher:
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC],
        kafka_config_id=CONN_ID,
        poll_timeout=0.5,
        match={"body.kind": ["tick", f"w{index}"]},
    )
    return AssetWatcher(name=f"two_{index:02d}", trigger=trigger)


assets = [Asset(f"two_{index:02d}", watchers=[watcher(index)]) for index in range(WATCHERS)]


@dag(dag_id="two_triggerers_consumer", schedule=AssetAny(*assets), max_active_runs=1, catchup=False)
def two_triggerers_consumer() -> None:
    @task
    def consume() -> None:
        return None

    consume()


two_triggerers_consumer()
