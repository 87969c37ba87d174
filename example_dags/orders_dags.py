"""
The example's Dags on one broker's shared stream (imported by the ``example_<broker>_orders.py`` files).

Every broker's example declares the same four assets, each fired by its own watcher on the one
shared stream, and the Dags scheduled on them:

* ``<broker>_orders_eu``: ``match={"body.region": "eu"}`` (equality on an envelope path);
* ``<broker>_orders_us_apac``: ``match={"body.region": ["us", "apac"]}`` ("any of");
* ``<broker>_orders_big``: ``filter_function="order_filters.is_big_order"`` (a Python predicate);
* ``<broker>_orders_valid``: ``filter_function="order_filters.require_valid_order"``, which raises
  ``RejectMessage`` for a malformed order: it goes to the dead-letter destination.

``<broker>_orders_{eu,us_apac,big}_consumer`` (:func:`order_events.consumer_dag`) record each order
of their run once; ``<broker>_orders_spark_pipeline`` (:mod:`orders_spark`) turns the valid orders
into revenue per region and minute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from order_events import consumer_dag, pipeline_flush_after, stream_options
from orders_spark import build_orders_spark_pipeline

if TYPE_CHECKING:
    from airflow.sdk import Asset
    from airflow.triggers.base import BaseEventTrigger

# The watcher that feeds the PySpark pipeline; each of the others has a one-task consumer Dag.
PIPELINE_WATCHER = "orders_valid"
# watcher -> its filter (the trigger's keyword arguments that are not producer settings).
WATCHER_FILTERS: dict[str, dict[str, Any]] = {
    "orders_eu": {"match": {"body.region": "eu"}},
    "orders_us_apac": {"match": {"body.region": ["us", "apac"]}},
    "orders_big": {"filter_function": "order_filters.is_big_order"},
    "orders_valid": {"filter_function": "order_filters.require_valid_order"},
}


def declare_orders_dags(broker: str, shared_stream_trigger: Callable[..., BaseEventTrigger]) -> dict[str, Asset]:
    """
    Declare the four assets of ``broker`` and their Dags; returns the assets by watcher name.

    ``shared_stream_trigger(**options)`` makes one watcher's trigger. It must pass the same
    producer settings (queue, connection, dead-letter destination) on every call: equal settings
    are what make the watchers share one stream. ``options`` are the example's own producer
    settings (:func:`order_events.stream_options`, the same for all four) and the watcher's filter.
    """
    from airflow.sdk import Asset, AssetWatcher

    assets: dict[str, Asset] = {}
    for watcher, watcher_filter in WATCHER_FILTERS.items():
        name = f"{broker}_{watcher}"
        options = {**stream_options(), **watcher_filter}
        if watcher == PIPELINE_WATCHER:
            options["flush_after"] = pipeline_flush_after()  # the tail of a burst gets its pipeline run
        asset = assets[watcher] = Asset(
            name, watchers=[AssetWatcher(name=name, trigger=shared_stream_trigger(**options))]
        )
        if watcher == PIPELINE_WATCHER:
            build_orders_spark_pipeline(dag_id=f"{broker}_orders_spark_pipeline", source=asset, dataset=broker)
        else:
            sink = f"{broker}_{watcher.removeprefix('orders_')}"
            consumer_dag(f"{name}_consumer", schedule=[asset], sink=sink, broker=broker)
    return assets
