"""
The lightest consumer Dag a user writes: one task that counts the orders among its run's asset
events. Shared by the production topology's extra Dag files (``kafka_latency_pair.py``,
``kafka_more_watchers.py``), which are copied beside it into the Dags folder. It defines no Dag.

The consumer Dag of an asset is ``<asset>_consumer``, its task ``handle_orders``
(``devkit.production.pair_dag`` and ``bench.production`` read those names).
"""

from __future__ import annotations

import json
from typing import Any

from airflow.sdk import Asset, AssetWatcher, dag, task
from airflow.triggers.base import BaseEventTrigger


def order_in(event_extra: Any) -> bool:
    """
    Whether one asset event carries an order (a JSON object body), in either provider's shape: the
    event's ``payload`` is upstream's message text, or our envelope with the body already parsed.
    """
    extra = event_extra if isinstance(event_extra, dict) else {}
    payload = extra.get("payload")
    if isinstance(payload, str):
        try:
            payload = {"body": json.loads(payload)}
        except ValueError:
            return False
    return isinstance(payload, dict) and isinstance(payload.get("body"), dict)


def orders_in(event_extra: Any) -> int:
    """How many orders one asset event carries: one per envelope of a batch event (``batch_size > 1``)."""
    extra = event_extra if isinstance(event_extra, dict) else {}
    payload = extra.get("payload")
    batch = payload.get("messages") if isinstance(payload, dict) else None
    if isinstance(batch, list):
        return sum(order_in({"payload": envelope}) for envelope in batch)
    return int(order_in(extra))


def watched_asset(name: str, trigger: BaseEventTrigger) -> Asset:
    """An asset with one watcher of the same name."""
    return Asset(name, watchers=[AssetWatcher(name=name, trigger=trigger)])


def light_consumer(dag_id: str, asset: Asset, *, tags: list[str]) -> None:
    """One task that counts its run's orders, run on ``asset``'s events."""

    @dag(dag_id=dag_id, schedule=[asset], max_active_runs=1, catchup=False, tags=tags)
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> int:
            events = [event for group in (triggering_asset_events or {}).values() for event in group]
            return sum(orders_in(event.extra) for event in events)

        handle_orders()

    consumer()
