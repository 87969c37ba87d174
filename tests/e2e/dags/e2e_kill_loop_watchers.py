"""
Kill loops (tests/e2e/test_kill_loop.py): several watchers on ONE shared stream of one broker.

``KILL_LOOP_BROKER`` picks the broker (any registry name: ``kafka``, ``sqs``, ``pubsub``,
``servicebus``, ...), the other ``KILL_LOOP_*`` variables name its connection and the trigger's
arguments (``tests/e2e/loop_brokers.py``'s ``dag_env``): the trigger class and the argument naming
the connection come from the broker registry, so this Dag names no broker. Every watcher passes
the same producer settings (so the triggerer runs one consumer and broadcasts each message to all
of them) and its own ``match`` (Airflow keeps one Trigger row for identical trigger kwargs, which
would hide the siblings); every ``eu`` order matches all of them.

One Dag is scheduled on any of the assets: Airflow registers a watcher only for an asset an
unpaused Dag is scheduled on. The test counts asset events, so the Dag's task never needs to run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.sdk import Asset, AssetAny, AssetWatcher, dag, task

from airflow_shared_stream_provider.brokers import broker_spec, load

BROKER = os.environ.get("KILL_LOOP_BROKER", "kafka")
WATCHERS = int(os.environ.get("KILL_LOOP_WATCHERS", "5"))
CONN_ID = os.environ.get("KILL_LOOP_CONN_ID", "kill_loop")
# The source and the broker's own arguments (LoopBroker.trigger_kwargs), e.g. {"topics": [...]}.
TRIGGER_KWARGS: dict[str, Any] = json.loads(os.environ.get("KILL_LOOP_TRIGGER_KWARGS", "null")) or {}
if not TRIGGER_KWARGS:
    raise ValueError("KILL_LOOP_TRIGGER_KWARGS is unset: tests/e2e/loop_brokers.py's dag_env sets it")
SPEC = broker_spec(BROKER)
TRIGGER_CLASS = load(SPEC.trigger)


def trigger(index: int) -> Any:
    watcher: dict[str, Any] = {"match": {"body.region": ["eu", f"w{index}"]}}
    return TRIGGER_CLASS(**TRIGGER_KWARGS, **{SPEC.conn_id_arg: CONN_ID}, **watcher)


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
