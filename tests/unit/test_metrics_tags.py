"""
The ``stream`` tag survives every Airflow metrics backend: through Airflow's own StatsD logger with
InfluxDB-style tags (the tag becomes part of the validated metric name) to a real UDP listener.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import statsd

from airflow_shared_stream_provider._core.metrics import MAX_TAG_VALUE_LENGTH, StreamCounters, metric_tag_value
from tests.statsd_listener import StatsdListener

SQS_QUEUE_URL = "https://sqs.eu-west-1.amazonaws.com:443/123456789012/orders.fifo"
PUBSUB_PATH = "projects/" + "p" * 60 + "/subscriptions/" + "s" * 200


@pytest.fixture
def influx_statsd() -> Iterator[StatsdListener]:
    """Airflow's SDK ``Stats`` sending to a listener as ``[metrics] statsd_influxdb_enabled`` does."""
    from airflow.sdk._shared.observability.metrics.statsd_logger import get_statsd_logger
    from airflow.sdk.observability import stats

    with StatsdListener() as listener:

        def factory() -> Any:  # a SafeStatsdLogger (Airflow types its factory with a Protocol it misses)
            return get_statsd_logger(
                stats_class=statsd.StatsClient,
                host="127.0.0.1",
                port=listener.port,
                prefix="airflow",
                influxdb_tags_enabled=True,
                statsd_influxdb_enabled=True,
            )

        stats.initialize(factory=factory, export_legacy_names=False)
        try:
            yield listener
        finally:
            from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger

            stats.initialize(factory=NoStatsLogger, export_legacy_names=False)


@pytest.mark.parametrize("source", [SQS_QUEUE_URL, PUBSUB_PATH, "orders,payments=1", "topic with spaces:1"])
def test_every_stream_reaches_influx_statsd_with_its_tag(influx_statsd: StatsdListener, source: str) -> None:
    counters = StreamCounters("sqs", source)
    counters.add("received", 3)
    counters.gauge("consumer_lag", 7, partition="0")
    metrics = influx_statsd.wait_for(lambda ms: len(ms) >= 2, timeout=10, what="two metrics")
    received = [m for m in metrics if m.name == "airflow.shared_stream_provider.sqs.received"]
    assert [(m.value, m.kind, m.tag("stream")) for m in received] == [(3.0, "c", metric_tag_value(source))]
    lag = [m for m in metrics if m.name == "airflow.shared_stream_provider.sqs.consumer_lag"]
    assert [(m.value, m.tag("partition")) for m in lag] == [(7.0, "0")]


def test_tag_values_are_safe_bounded_and_distinct() -> None:
    assert metric_tag_value("orders") == "orders"
    assert metric_tag_value(SQS_QUEUE_URL) == "https_//sqs.eu-west-1.amazonaws.com_443/123456789012/orders.fifo"
    long_a, long_b = metric_tag_value(PUBSUB_PATH), metric_tag_value(PUBSUB_PATH.replace("p" * 60, "q" * 60))
    assert len(long_a) == MAX_TAG_VALUE_LENGTH and long_a.endswith("s" * 50)
    assert long_a != long_b, "two long sources with the same tail keep separate series"
    assert metric_tag_value("a\r\nb\x00c,d=e") == "a__b_c_d_e"
