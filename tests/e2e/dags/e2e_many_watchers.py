"""
120 watchers on one SQS queue (tests/e2e/test_late_siblings_e2e.py): more than the 50 new triggers
a triggerer takes per loop, so after every (re)start the stream re-forms in waves.

One Dag scheduled on any of the 120 assets (Airflow registers a watcher only for an asset an
unpaused Dag is scheduled on); each watcher has its own filter (so its own trigger row), and every
EU or US order matches all of them.
"""

from __future__ import annotations

import os

from airflow.sdk import Asset, AssetAny, AssetWatcher, dag, task

from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

QUEUE_URL = os.environ["MANY_SQS_QUEUE_URL"]
AWS_CONN_ID = os.environ["MANY_AWS_CONN_ID"]
WATCHERS = int(os.environ.get("MANY_WATCHERS", "120"))


def watcher(index: int) -> AssetWatcher:
    # Distinct kwargs per watcher: Airflow keeps ONE Trigger row for identical trigger kwargs (all
    # its assets get each event), which would hide the late-sibling case.
    trigger = SqsSharedStreamTrigger(
        queue_url=QUEUE_URL,
        aws_conn_id=AWS_CONN_ID,
        wait_time_seconds=2,
        match={"body.region": ["eu", "us", f"w{index}"]},
    )
    return AssetWatcher(name=f"many_{index:03d}", trigger=trigger)


assets = [Asset(f"many_{index:03d}", watchers=[watcher(index)]) for index in range(WATCHERS)]


@dag(dag_id="many_watchers_consumer", schedule=AssetAny(*assets), max_active_runs=1, catchup=False)
def many_watchers_consumer() -> None:
    @task
    def consume() -> None:
        return None

    consume()


many_watchers_consumer()
