"""
Real Airflow, real broker: five AssetWatchers (two Dag files) share one Kafka consumer of ``orders``.

The tests run in file order on one session-scoped Airflow (see ``conftest.py``); each asserts on the
messages it published itself:

1. every matching message becomes an asset event of each matching watcher, the triggerer runs ONE
   shared-stream group for the five watchers, and a committed offset never passes a message whose
   events are not in the metadata DB yet: on SQLite and again on PostgreSQL 15 (its own Airflow;
   a long variant, like 3 and 4 below);
2. bad input (malformed JSON, undecodable bytes, an oversize message, a filter that raises) ends
   as documented (dead-lettered, the right events still fire) and the triggerer keeps running;
3. ``kill -9`` of the triggerer at random points of a stream loses nothing (figures printed);
4. the PySpark pipeline's Parquet output equals the revenue of every valid order, each counted once.

3 and 4 are long variants (about 3 minutes each), run with ``-m slow`` or ``KAFKA_E2E_SLOW=1``:
CI keeps a triggerer ``kill -9`` in ``test_batch_e2e.py``, ``test_two_triggerers_e2e.py`` and the
production chaos run (``test_production.py``), which also checks the PySpark pipeline's output
table exactly (every valid order once, the revenue per region and minute).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.demo import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    GROUP_ID,
    SPARK_DAG,
    TOPIC,
    KafkaOrders,
    OrderMessage,
    Published,
    expected_revenue,
    expected_watchers,
    make_order,
    sample_orders,
    spark_message_ids,
    spark_revenue,
)
from tests.e2e.conftest import ALL_WATCHERS, PRIORITY_WATCHER, KafkaAirflow
from tests.slow import slow_opt_in
from tests.statsd_listener import Metric, StatsdListener

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.timeout(900)]

OPENING_LINE = f"Opening Kafka shared stream {TOPIC} for group {GROUP_ID}"


# -- expectations and observations ---------------------------------------------------------------
def is_oversize(message: OrderMessage) -> bool:
    return len(message.value) + 1024 > DEFAULT_MAX_PAYLOAD_BYTES


def expected_for(message: OrderMessage) -> tuple[set[str], bool]:
    """The example watchers' expectation plus the e2e priority watcher (raises on poison orders)."""
    fired, dead = expected_watchers(message)
    if is_oversize(message):
        return set(), True
    body = message.body()
    if isinstance(body, dict) and body.get("poison") is True:
        dead = True
    elif isinstance(body, dict) and body.get("priority") == "high":
        fired.add(PRIORITY_WATCHER)
    return fired, dead


def envelope_of(extra: Any) -> dict[str, Any] | None:
    """The envelope of a per-message asset event; None for anything else (e.g. a flush_after marker)."""
    if isinstance(extra, dict) and extra.get("from_trigger") and isinstance(extra.get("payload"), dict):
        payload = dict(extra["payload"])
        return payload if "message_id" in payload else None
    return None


def observed_events(env: AirflowEnv) -> Counter[tuple[str, str]]:
    """``(watcher/asset name, message_id) -> number of asset events`` from the REST API."""
    counts: Counter[tuple[str, str]] = Counter()
    for event in env.asset_events():
        envelope = envelope_of(event.get("extra"))
        if envelope is not None and event.get("name") in ALL_WATCHERS:
            counts[str(event["name"]), str(envelope["message_id"])] += 1
    return counts


def missing_events(published: Iterable[Published], events: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        (watcher, record.message_id)
        for record in published
        for watcher in sorted(expected_for(record.message)[0])
        if events[watcher, record.message_id] == 0
    ]


def unexpected_events(published: Iterable[Published], events: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    wrong = []
    for record in published:
        fired, _ = expected_for(record.message)
        wrong += [(w, record.message_id) for w in ALL_WATCHERS if w not in fired and events[w, record.message_id]]
    return wrong


def dead_letters(orders: KafkaOrders) -> dict[str, str]:
    """``source message_id -> x-dead-letter-reason`` for every DLQ record (the Kafka kit's read)."""
    return orders.dead_letters()


def check_commit_invariant(orders: KafkaOrders, env: AirflowEnv, published: Sequence[Published]) -> int:
    """
    Read the committed offsets, THEN the asset events: every message below a committed offset must
    already have all its events in the DB. Returns how many messages the check covered.
    """
    committed = orders.committed()
    events = observed_events(env)
    covered = [r for r in list(published) if r.offset < committed.get(r.partition, 0)]
    missing = missing_events(covered, events)
    assert not missing, f"offsets committed past messages whose events are not stored: {missing[:10]}"
    return len(covered)


def wait_all_events(
    env: AirflowEnv, published: Sequence[Published], timeout: float = 300.0
) -> Counter[tuple[str, str]]:
    def complete() -> Counter[tuple[str, str]] | None:
        events = observed_events(env)
        return events if not missing_events(published, events) else None

    return env.wait_until(complete, timeout=timeout, what=f"asset events for {len(published)} messages", interval=2.0)


def wait_committed_to_end(env: AirflowEnv, orders: KafkaOrders, timeout: float = 180.0) -> dict[int, int]:
    def at_end() -> dict[int, int] | None:
        ends = orders.end_offsets()
        return ends if orders.committed() == ends else None

    return env.wait_until(at_end, timeout=timeout, what="committed offsets to reach the end of every partition")


def group_openings_per_start(env: AirflowEnv) -> list[int]:
    """How many times each triggerer start opened the shared consumer (split on devkit's start markers)."""
    segments = env.components["triggerer"].log_text().split("===== devkit: start #")[1:]
    return [segment.count(OPENING_LINE) for segment in segments]


def publish_in_background(
    orders: KafkaOrders, messages: Sequence[OrderMessage], rate: float
) -> tuple[threading.Thread, list[Published]]:
    out: list[Published] = []

    def run() -> None:
        out.extend(orders.publish(messages, rate=rate))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def since(orders: KafkaOrders, start: int) -> list[Published]:
    return list(orders.published[start:])


# -- the tests -------------------------------------------------------------------------------------
# PostgreSQL: its own Airflow and Tansu (144 s with setup and teardown), a long variant (-m slow or
# KAFKA_E2E_SLOW=1); CI runs the metadata DB on PostgreSQL in the two-triggerer and production e2e.
@pytest.mark.parametrize("kafka_airflow", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)], indirect=True)
def test_watchers_share_one_consumer_and_commit_only_after_persist(kafka_airflow: KafkaAirflow) -> None:
    airflow, orders = kafka_airflow.env, kafka_airflow.orders
    start = len(orders.published)
    messages = sample_orders(150, seed=1, prefix="happy-")
    messages += [make_order(f"happy-prio-{i}", "us", 42.0 + i, messages_time(i), priority="high") for i in range(5)]
    thread, _ = publish_in_background(orders, messages, rate=25.0)
    checks = 0
    while thread.is_alive() or checks == 0:
        checks += 1
        check_commit_invariant(orders, airflow, since(orders, start))
    thread.join()
    published = since(orders, start)
    assert len(published) == len(messages)

    covered = 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        covered = check_commit_invariant(orders, airflow, published)
        if covered == len(published):
            break
    events = wait_all_events(airflow, published)
    wait_committed_to_end(airflow, orders)
    assert check_commit_invariant(orders, airflow, published) == len(published)

    assert not unexpected_events(published, events)
    per_watcher = Counter(w for (w, mid) in events if mid in {p.message_id for p in published})
    expected_counts = Counter(w for p in published for w in expected_for(p.message)[0])
    assert per_watcher == expected_counts
    assert len(expected_counts) == len(ALL_WATCHERS), "the sample must exercise every watcher"

    dlq = dead_letters(orders)
    dead = {p.message_id for p in published if expected_for(p.message)[1]}
    assert dead, "the sample must contain malformed orders"
    assert {mid for mid in dlq if mid in {p.message_id for p in published}} == dead
    assert all("malformed order" in dlq[mid] for mid in dead)

    # One shared-stream group (one consumer) for the five watchers, all in one triggerer.
    openings = group_openings_per_start(airflow)
    assert openings[-1] == 1, f"expected exactly one shared consumer in the current triggerer, got {openings}"
    jobs = {job for _, watcher, job in airflow.running_watchers() if watcher in ALL_WATCHERS}
    assert len(jobs) == 1


def messages_time(index: int) -> Any:
    from datetime import datetime, timedelta, timezone

    return datetime(2026, 1, 1, 12, 7, tzinfo=timezone.utc) + timedelta(seconds=index)


def test_bad_input_is_dead_lettered_and_the_triggerer_keeps_running(airflow: AirflowEnv, orders: KafkaOrders) -> None:
    triggerer = airflow.components["triggerer"]
    starts_before = triggerer.starts
    start = len(orders.published)
    big_note = "x" * (DEFAULT_MAX_PAYLOAD_BYTES + 10_000)
    bad = [
        OrderMessage(b"bad-json", b'{"order_id": "bad-json", "region": "eu", "amount": ', "malformed-json"),
        OrderMessage(b"bad-bytes", bytes([0xFF, 0xFE, 0x00, 0x80]) * 8, "binary"),
        make_order("bad-oversize", "eu", 900.0, messages_time(1), note=big_note),
        make_order("bad-poison", "eu", 700.0, messages_time(2), poison=True, priority="high"),
        make_order("after-bad", "apac", 12.5, messages_time(3), priority="high"),
    ]
    assert is_oversize(bad[2])
    published = orders.publish(bad)
    by_key = {p.message.key.decode(): p for p in published}

    events = wait_all_events(airflow, published)
    wait_committed_to_end(airflow, orders)
    assert not unexpected_events(published, events)
    dlq = dead_letters(orders)

    # Malformed JSON: the body is kept as text; the validating watcher rejects it -> DLQ.
    reason = dlq[by_key["bad-json"].message_id]
    assert "malformed order" in reason and "not JSON" in reason
    # Undecodable bytes: base64 body, rejected the same way; nothing fires.
    assert "body_encoding='base64'" in dlq[by_key["bad-bytes"].message_id]
    assert not [k for k in events if k[1] == by_key["bad-bytes"].message_id]
    # Oversize: no watcher fires, the original message is dead-lettered intact.
    assert "payload too large" in dlq[by_key["bad-oversize"].message_id]
    assert not [k for k in events if k[1] == by_key["bad-oversize"].message_id]
    oversize_record = [r for r in orders.dlq_records() if r["key"] == b"bad-oversize"]
    assert oversize_record and oversize_record[0]["value"] == bad[2].value
    # A filter that raises: that watcher rejects (DLQ) and its siblings still fire.
    poison = by_key["bad-poison"].message_id
    assert "filter raised ValueError" in dlq[poison]
    assert {w for (w, mid) in events if mid == poison} == {"kafka_orders_eu", "kafka_orders_valid", "kafka_orders_big"}
    # ... and the triggerer kept running: same process, and it handled the message after them.
    assert triggerer.alive and triggerer.starts == starts_before
    assert events[PRIORITY_WATCHER, by_key["after-bad"].message_id] >= 1
    assert "after-bad" not in json.dumps(sorted(dlq.values()))
    assert len(since(orders, start)) == len(bad)


_slow_opt_in = slow_opt_in("KAFKA_E2E_SLOW", "a long Kafka e2e variant (about 3 minutes)")


@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
def test_triggerer_kill9_at_random_points_loses_nothing(airflow: AirflowEnv, orders: KafkaOrders) -> None:
    rng = random.Random(20261121)
    start = len(orders.published)
    messages = sample_orders(240, seed=3, prefix="crash-")
    thread, _ = publish_in_background(orders, messages, rate=5.0)
    planned_kills = 3
    kills = 0
    baseline = sum(observed_events(airflow).values())
    while kills < planned_kills:
        # A random point of the stream: after 3..30 more asset events have been stored.
        progress = rng.randint(3, 30)
        target = baseline + progress

        def progressed(target: int = target) -> bool:
            return sum(observed_events(airflow).values()) >= target

        airflow.wait_until(
            progressed,
            timeout=300,
            what=f"{progress} more asset events before kill #{kills + 1}",
            interval=0.5,
        )
        previous_job = airflow.restart_triggerer(kill=True)
        kills += 1
        airflow.wait_for_watchers(ALL_WATCHERS, newer_than_job=previous_job, timeout=240)
        baseline = sum(observed_events(airflow).values())
    thread.join(timeout=600)
    published = since(orders, start)
    assert len(published) == len(messages)

    events = wait_all_events(airflow, published, timeout=600)
    wait_committed_to_end(airflow, orders, timeout=300)
    mine = {p.message_id for p in published}
    lost = missing_events(published, events)
    pairs = [key for key in events if key[1] in mine]
    duplicates = sum(events[key] - 1 for key in pairs)
    redelivered_messages = len({mid for (_, mid) in pairs if events[_, mid] > 1})
    print(
        f"\ncrash-test figures: messages={len(published)} kills={kills} lost={len(lost)} "
        f"duplicates={duplicates} (asset events beyond the first, over {redelivered_messages} message(s)); "
        f"events={sum(events[key] for key in pairs)} expected_pairs={len(pairs)}"
    )
    assert kills == planned_kills
    assert not lost, f"lost (watcher, message) pairs: {lost[:20]}"
    assert not unexpected_events(published, events)
    dead = {p.message_id for p in published if expected_for(p.message)[1]}
    assert dead <= set(dead_letters(orders))
    # Every (re)started triggerer opened at most one shared consumer for the five watchers.
    assert all(count <= 1 for count in group_openings_per_start(airflow))


@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
def test_pyspark_pipeline_counts_every_valid_order_once(
    airflow: AirflowEnv, orders: KafkaOrders, output_dir: Path
) -> None:
    dataset = output_dir / "kafka"
    # No flush message: Airflow 3.3 strands the events of a burst that arrive while a run waits to
    # be created; the pipeline's watcher has flush_after (30 s by default), whose markers queue
    # the run that takes them.
    published = list(orders.published)
    valid_ids = {p.message_id for p in published if "kafka_orders_valid" in expected_for(p.message)[0]}

    def complete() -> bool:
        return valid_ids <= set(spark_message_ids(dataset)) and airflow.dag_idle(SPARK_DAG)

    airflow.wait_until(complete, timeout=600, what="the PySpark Dag to store every valid order", interval=3.0)
    stored = spark_message_ids(dataset)
    assert len(stored) == len(set(stored)), "a message was stored twice (idempotency broken)"
    assert set(stored) == valid_ids
    expected = expected_revenue(p.message for p in published)
    assert spark_revenue(dataset) == expected
    runs = airflow.dag_run_states(SPARK_DAG)
    assert runs.get("success", 0) >= 2 and not runs.get("failed"), runs


def test_a_statsd_collector_receives_the_stream_metrics(
    airflow: AirflowEnv, orders: KafkaOrders, statsd: StatsdListener
) -> None:
    """
    The provider's counters and gauges reach a real StatsD listener from the real triggerer, tagged
    with the stream (``statsd_influxdb_enabled``: tags travel in the name), every series valid.
    """
    start = len(orders.published)
    good = [make_order(f"metrics-{i}", "eu", 10.0 + i, messages_time(10 + i)) for i in range(5)]
    bad = OrderMessage(b"metrics-bad", b'{"order_id": "metrics-bad", "amount": ', "malformed-json")
    published = orders.publish([*good, bad])
    wait_all_events(airflow, published)
    wait_committed_to_end(airflow, orders)

    prefix = "airflow.shared_stream_provider.kafka."
    counters = ("received", "fired", "advanced", "committed", "dead_lettered", "rejected")
    gauges = ("outstanding", "consumer_lag")

    def arrived(metrics: list[Metric]) -> bool:
        names = {m.name for m in metrics}
        return all(prefix + name in names for name in (*counters, *gauges))

    metrics = statsd.wait_for(arrived, timeout=60, what="the provider's Kafka metrics")
    # The collector works for Airflow's own metrics too (same process, same client).
    assert any(m.name == "airflow.triggerer_heartbeat" for m in metrics)
    ours = [m for m in metrics if m.name.startswith(prefix)]
    assert {m.tag("stream") for m in ours} == {TOPIC}, "every series carries the stream tag"
    for name in counters:
        assert all(m.kind == "c" for m in ours if m.name == prefix + name), name
    totals = Counter[str]()
    for metric in ours:
        if metric.kind == "c":
            totals[metric.name.removeprefix(prefix)] += int(metric.value)
    # Every message this session published ended committed or dead-lettered (kill -9 restarts
    # may commit some twice, never fewer).
    assert totals["committed"] + totals["dead_lettered"] >= len(orders.published)
    assert totals["received"] >= totals["advanced"] > 0
    lag = [m for m in ours if m.name == prefix + "consumer_lag"]
    assert all(m.kind == "g" and m.tag("topic") == TOPIC and m.tag("partition") is not None for m in lag)
    assert len(since(orders, start)) == len(published)
