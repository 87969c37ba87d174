"""
Batch mode and the ``flush_after`` marker in a real triggerer (tests/e2e/test_batch_e2e.py).

Three watchers share one Kafka consumer of ``batch-orders`` that broadcasts up to 50 messages as
one raw event; each fires one asset event per batch (payload ``{"messages": [...]}``):

* ``batch_all`` fires on every message and emits a flush marker 3 s after its last event; its
  consumer Dag runs with ``max_active_runs=1`` and takes a while, the situation in which Airflow
  3.3 strands the tail of a burst;
* ``batch_eu`` fires on EU orders (``match``);
* ``batch_valid`` rejects malformed orders, which are dead-lettered one by one while their
  neighbours in the same batch are delivered.
"""

from __future__ import annotations

import os
import time
from typing import Any

from airflow.sdk import Asset, AssetWatcher, dag, task
from order_events import record_receipts, unique_envelopes

from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

TOPIC = os.environ.get("BATCH_TOPIC", "batch-orders")
FLUSH_AFTER = float(os.environ.get("BATCH_FLUSH_AFTER", "3"))


def batch_watcher(name: str, **watcher: Any) -> AssetWatcher:
    trigger = KafkaSharedStreamTrigger(
        topics=[TOPIC], dlq_topic=f"{TOPIC}.dlq", batch_size=50, batch_timeout=0.5, **watcher
    )
    return AssetWatcher(name=name, trigger=trigger)


batch_all = Asset("batch_all", watchers=[batch_watcher("batch_all", flush_after=FLUSH_AFTER)])
batch_eu = Asset("batch_eu", watchers=[batch_watcher("batch_eu", match={"body.region": "eu"})])
batch_valid = Asset(
    "batch_valid", watchers=[batch_watcher("batch_valid", filter_function="order_filters.require_valid_order")]
)


def consumer_dag(asset: Asset, *, seconds_per_run: float) -> None:
    """Airflow registers a watcher only for an asset some Dag is scheduled on: one consumer each."""

    @dag(dag_id=f"{asset.name}_consumer", schedule=[asset], max_active_runs=1, catchup=False)
    def consumer() -> None:
        @task
        def consume(triggering_asset_events: Any = None) -> dict[str, int]:
            envelopes = unique_envelopes(triggering_asset_events)  # batches unpacked, markers skipped
            counts = record_receipts(envelopes, asset.name)
            time.sleep(seconds_per_run)  # a slow run: events keep arriving while it is queued or running
            return {"messages": len(envelopes), **counts}

        consume()

    consumer()


consumer_dag(batch_all, seconds_per_run=2)
consumer_dag(batch_eu, seconds_per_run=0)
consumer_dag(batch_valid, seconds_per_run=0)
