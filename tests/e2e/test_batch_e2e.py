"""
Batch mode and the ``flush_after`` marker in a real triggerer, with Airflow's default ``[triggerer]``
settings (no cohort grace period):

1. three watchers share one consumer broadcasting batches of up to 50 messages; ``kill -9`` of the
   triggerer at random points of a steady stream loses no (watcher, message) pair, malformed
   orders are dead-lettered one by one while their batch neighbours are delivered;
2. a burst consumed by a slow ``max_active_runs=1`` Dag: Airflow 3.3 strands the events that arrive
   while a run is queued (they wait for the next event); the ``flush_after`` marker brings every
   one of them into a run with no further message published.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from order_events import envelopes_of, safe_name

from devkit.airflow_env import AirflowEnv
from devkit.demo import (
    KafkaOrders,
    OrderMessage,
    Published,
    build_dags_folder,
    expected_watchers,
    kafka_connection,
    sample_orders,
)

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.timeout(900)]

TOPIC = "batch-orders"
WATCHERS = ("batch_all", "batch_eu", "batch_valid")
CONSUMER_DAG = "batch_all_consumer"
CONSUMER_DAGS = tuple(f"{watcher}_consumer" for watcher in WATCHERS)
FLUSH_AFTER = 15.0  # longer than one run of the consumer Dag takes here (see the Dag file)
E2E_DAGS = Path(__file__).parent / "dags"


def expected_for(message: OrderMessage) -> tuple[set[str], bool]:
    """Which of the three watchers fire (by the example watchers' documented semantics), and DLQ."""
    example, dead = expected_watchers(message)
    fired = {"batch_all"}
    if "kafka_orders_eu" in example:
        fired.add("batch_eu")
    if "kafka_orders_valid" in example:
        fired.add("batch_valid")
    return fired, dead


@pytest.fixture(scope="module")
def batch_orders(kafka_bootstrap: str) -> KafkaOrders:
    stream = KafkaOrders(
        kafka_bootstrap, topic=TOPIC, dlq_topic=f"{TOPIC}.dlq", group_id=f"airflow-shared-stream.kafka_default.{TOPIC}"
    )
    stream.create_topics()
    return stream


@pytest.fixture(scope="module")
def batch_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-output")


@pytest.fixture(scope="module")
def batch_airflow(
    batch_orders: KafkaOrders, batch_output: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AirflowEnv]:
    dags = build_dags_folder(
        tmp_path_factory.mktemp("batch-dags"),
        files=("order_events.py", "order_filters.py"),
        extra=[E2E_DAGS / "e2e_batch_orders.py"],
    )
    env = AirflowEnv(
        dags,
        connections={"kafka_default": kafka_connection(batch_orders.bootstrap)},
        env={"ORDERS_OUTPUT_DIR": str(batch_output), "BATCH_TOPIC": TOPIC, "BATCH_FLUSH_AFTER": str(FLUSH_AFTER)},
        home=tmp_path_factory.mktemp("batch-airflow-home"),
    )  # [triggerer] left at Airflow's defaults
    with env:
        env.wait_for_dags(CONSUMER_DAGS)
        env.unpause(CONSUMER_DAGS)
        env.wait_for_watchers(WATCHERS)
        yield env


def observed(env: AirflowEnv) -> tuple[Counter[tuple[str, str]], list[dict[str, object]], int]:
    """``(watcher, message_id) -> deliveries``, the flush markers, and the number of batch events."""
    deliveries: Counter[tuple[str, str]] = Counter()
    markers: list[dict[str, object]] = []
    batch_events = 0
    for event in env.asset_events():
        name = str(event["name"])
        if name not in WATCHERS:
            continue
        extra = event.get("extra")
        payload = extra.get("payload") if isinstance(extra, dict) else None
        if isinstance(payload, dict) and payload.get("marker") == "flush":
            markers.append({**payload, "timestamp": event["timestamp"]})
            continue
        batch_events += 1
        for envelope in envelopes_of(extra):
            deliveries[name, str(envelope["message_id"])] += 1
    return deliveries, markers, batch_events


def message_id(record: Published) -> str:
    """``Published.message_id`` names the demo's topic; this stream has its own."""
    return f"{TOPIC}/{record.partition}/{record.offset}"


def missing(published: Sequence[Published], deliveries: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        (watcher, message_id(record))
        for record in published
        for watcher in sorted(expected_for(record.message)[0])
        if deliveries[watcher, message_id(record)] == 0
    ]


def test_batches_survive_kill9_of_the_triggerer_losing_nothing(
    batch_airflow: AirflowEnv, batch_orders: KafkaOrders
) -> None:
    rng = random.Random(20261125)
    messages = sample_orders(400, seed=11, prefix="batch-")
    published: list[Published] = []
    thread = threading.Thread(target=lambda: published.extend(batch_orders.publish(messages, rate=8.0)), daemon=True)
    thread.start()
    kills = 0
    for _ in range(2):
        before = sum(observed(batch_airflow)[0].values())
        target = before + rng.randint(10, 60)
        batch_airflow.wait_until(
            lambda target=target: sum(observed(batch_airflow)[0].values()) >= target or not thread.is_alive(),  # type: ignore[misc]
            timeout=300,
            what=f"deliveries to reach {target} before kill #{kills + 1}",
            interval=0.5,
        )
        previous_job = batch_airflow.restart_triggerer(kill=True)
        kills += 1
        batch_airflow.wait_for_watchers(WATCHERS, newer_than_job=previous_job, timeout=240)
        time.sleep(rng.uniform(4, 10))  # let the restarted stream commit for a while before the next kill
    thread.join(timeout=300)
    assert len(published) == len(messages)

    def complete() -> Counter[tuple[str, str]] | None:
        found = observed(batch_airflow)[0]
        return found if not missing(published, found) else None

    deliveries = batch_airflow.wait_until(
        complete,
        timeout=600,
        what="every (watcher, message) pair delivered",
        interval=2.0,
    )
    mine = {message_id(p) for p in published}
    pairs = [key for key in deliveries if key[1] in mine]
    duplicates = sum(deliveries[key] - 1 for key in pairs)
    _, _, batch_events = observed(batch_airflow)
    print(
        f"\nbatch kill -9 figures: messages={len(published)} kills={kills} lost=0 pairs={len(pairs)} "
        f"duplicates={duplicates} batch_events={batch_events}"
    )
    # Nothing unexpected: a watcher fires only on what its filter accepts.
    by_id = {message_id(p): p for p in published}
    for watcher, message_id_ in pairs:
        record = by_id[message_id_]
        assert watcher in expected_for(record.message)[0], (watcher, message_id_)
    # Fewer, fuller events: far fewer asset events than (watcher, message) deliveries (per message
    # it would be one each). How full depends on the backlog each restart builds: a steady 8 msgs/s
    # over 3 partitions fills about 2 messages per lane in batch_timeout=0.5 s, a restart's backlog
    # fills whole batches; with watcher positions a restart replays less than it did (measured:
    # 13.5 deliveries per event before them, 4.5 after).
    assert batch_events * 3 < len(pairs), (batch_events, len(pairs))
    # The runner logs every event with its repr: a batch is named, not repeated (_core/events.py).
    runner_log = batch_airflow.components["triggerer"].log_text().splitlines()
    fired = [line for line in runner_log if "Trigger fired event" in line]
    assert any("batch of" in line for line in fired), fired[:3]
    assert max(len(line) for line in fired) < 600, max(fired, key=len)[:600]
    # Malformed orders were rejected by batch_valid one by one: dead-lettered, their neighbours not.
    dead = {message_id(p) for p in published if expected_for(p.message)[1]}
    assert dead

    def dead_lettered() -> set[str] | None:
        # A batch is dead-lettered when it is advanced, which can trail the deliveries by a round.
        found = {record["headers"].get("x-dead-letter-source") for record in batch_orders.dlq_records()}
        return found if dead <= found else None

    sources = batch_airflow.wait_until(
        dead_lettered, timeout=120, what=f"{len(dead)} malformed orders dead-lettered", interval=2
    )
    assert not (sources & (mine - dead))


def test_flush_marker_brings_the_stranded_tail_of_a_burst_into_a_run(
    batch_airflow: AirflowEnv, batch_orders: KafkaOrders, batch_output: Path
) -> None:
    # Let the earlier test's runs finish, then send a burst into a slow max_active_runs=1 Dag.
    batch_airflow.wait_until(
        lambda: batch_airflow.dag_idle(CONSUMER_DAG), timeout=600, what="the consumer Dag to be idle", interval=2.0
    )
    published = batch_orders.publish(sample_orders(150, seed=12, prefix="tail-"), rate=30.0)
    ids = {message_id(p) for p in published}
    receipts = batch_output / "receipts" / "batch_all"

    def consumed() -> bool:
        return all((receipts / f"{safe_name(mid)}.json").exists() for mid in ids)

    # Every message of the burst lands in some run with nothing more published: the marker
    # (flush_after after the last event) is the only asset event that can queue the last run.
    batch_airflow.wait_until(
        consumed, timeout=FLUSH_AFTER + 240, what="every message of the burst in a run", interval=2.0
    )
    batch_airflow.wait_until(
        lambda: batch_airflow.dag_idle(CONSUMER_DAG), timeout=300, what="the consumer Dag to be idle", interval=2.0
    )

    # The marker comes flush_after after the burst's last event whether or not a run already
    # took the tail (a run created late enough takes it all): wait for it, not assume it.
    def marker_after_the_burst() -> bool:
        _, markers, _ = observed(batch_airflow)
        return bool({marker["after_message_id"] for marker in markers} & ids)

    try:
        batch_airflow.wait_until(marker_after_the_burst, timeout=FLUSH_AFTER + 120, what="the marker", interval=2.0)
    except Exception:
        raise AssertionError(f"no marker after the burst: {observed(batch_airflow)[1]}") from None
    runs = batch_airflow.dag_run_states(CONSUMER_DAG)
    assert not runs.get("failed"), runs
