"""
What the demo (:mod:`devkit.demo`) and its broker streams (:mod:`devkit.demo_streams`) share: the
Kafka scenario's names, one message of the scenario, and how far a stream got.

Both modules import this one and it imports neither, so they do not import each other in a circle:
``demo`` -> ``demo_streams`` -> ``demo_types``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

# What every broker's example Dag imports: the filters, the order events and the Spark pipeline.
PIPELINE_DAG_FILES: Final = ("order_filters.py", "order_events.py", "orders_spark.py", "orders_dags.py")


def example_dag_files(broker: str) -> tuple[str, ...]:
    """A broker's example Dag file and what it imports (example_dags/)."""
    return (f"example_{broker}_orders.py", *PIPELINE_DAG_FILES)


KAFKA_DAG_FILES: Final = example_dag_files("kafka")

TOPIC: Final = "orders"
DLQ_TOPIC: Final = "orders.dlq"
PARTITIONS: Final = 3
GROUP_ID: Final = "airflow-shared-stream.kafka_default.orders"

# The example watchers (asset name == watcher name); every broker's demo names its own after these.
WATCHERS: Final = ("kafka_orders_eu", "kafka_orders_us_apac", "kafka_orders_big", "kafka_orders_valid")


@dataclass(frozen=True)
class OrderMessage:
    """One message to publish: its key, raw value bytes and what kind of input it is."""

    key: bytes
    value: bytes
    kind: str  # order | malformed-json | not-an-order | binary | oversize | poison

    def body(self) -> Any:
        """The body as a watcher sees it (parsed JSON, else None)."""
        try:
            return json.loads(self.value.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None


@dataclass(frozen=True)
class Settlement:
    """How far the stream got: ``settled`` of ``total`` messages, with a one-line detail."""

    settled: int
    total: int
    detail: str

    @property
    def complete(self) -> bool:
        return self.settled >= self.total


@dataclass(frozen=True)
class BrokerRestart:
    """
    One graceful stop and start of a demo's local broker, its data kept, on the same address
    (:meth:`devkit.demo_streams.DemoStream.restart_keeping_data`; the chaos run records it).
    """

    address: str
    stop_s: float  # the graceful stop took (the broker flushes its data first)
    down_s: float  # from the stop's start until the broker accepted connections again
