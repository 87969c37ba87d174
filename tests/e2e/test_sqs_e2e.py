"""
Real Airflow, moto server: four SQS AssetWatchers (one Dag file) share one receive loop of ``orders``.

The Dag file is written by this module (the example's watchers, without the PySpark pipeline, to
keep the test fast): two ``match`` watchers on the region, one ``is_big_order`` filter and one
``require_valid_order`` filter that rejects malformed orders to the ``orders-dlq`` queue.

Every matching message must become an asset event of each matching watcher, the source queue must
end empty (messages are deleted only once every watcher's events are stored), malformed orders must
be in the DLQ queue, and the triggerer must open ONE receive loop for the four watchers.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections import Counter
from collections.abc import Iterator

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.demo import EXAMPLE_DAGS, OrderMessage, expected_watchers, sample_orders
from devkit.demo_streams import SqsOrders

pytestmark = [pytest.mark.e2e, pytest.mark.sqs, pytest.mark.timeout(600)]

CONN_ID = "aws_sqs_e2e"
WATCHERS = ("sqs_orders_eu", "sqs_orders_us_apac", "sqs_orders_big", "sqs_orders_valid")
DAGS = tuple(f"{watcher}_consumer" for watcher in WATCHERS)
MESSAGES = 40

DAG_FILE = textwrap.dedent(
    '''
    """E2E: four SQS watchers on one queue (same producer settings), trivial consumer Dags."""

    from __future__ import annotations

    import os
    from typing import Any

    from airflow.sdk import Asset, AssetWatcher, dag, task
    from order_events import unique_envelopes

    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

    QUEUE_URL = os.environ["ORDERS_SQS_QUEUE_URL"]
    DLQ_URL = os.environ["ORDERS_SQS_DLQ_URL"]
    AWS_CONN_ID = os.environ["ORDERS_AWS_CONN_ID"]


    def orders_watcher(name: str, **watcher_filter: Any) -> AssetWatcher:
        trigger = SqsSharedStreamTrigger(
            queue_url=QUEUE_URL, aws_conn_id=AWS_CONN_ID, dlq_queue_url=DLQ_URL, wait_time_seconds=5, **watcher_filter
        )
        return AssetWatcher(name=name, trigger=trigger)


    ASSETS = [
        Asset("sqs_orders_eu", watchers=[orders_watcher("sqs_orders_eu", match={"body.region": "eu"})]),
        Asset(
            "sqs_orders_us_apac",
            watchers=[orders_watcher("sqs_orders_us_apac", match={"body.region": ["us", "apac"]})],
        ),
        Asset(
            "sqs_orders_big",
            watchers=[orders_watcher("sqs_orders_big", filter_function="order_filters.is_big_order")],
        ),
        Asset(
            "sqs_orders_valid",
            watchers=[orders_watcher("sqs_orders_valid", filter_function="order_filters.require_valid_order")],
        ),
    ]


    def consumer_dag(asset: Asset) -> None:
        @dag(dag_id=f"{asset.name}_consumer", schedule=[asset], max_active_runs=1, catchup=False, tags=["e2e"])
        def consumer() -> None:
            @task
            def count_orders(triggering_asset_events: Any = None) -> int:
                return len(unique_envelopes(triggering_asset_events))

            count_orders()

        consumer()


    for _asset in ASSETS:
        consumer_dag(_asset)
    '''
)


# -- expectations and observations -------------------------------------------------------------------
def expected_for(message: OrderMessage) -> tuple[set[str], bool]:
    """The Kafka example's documented expectation, renamed to the SQS watchers."""
    fired, dead = expected_watchers(message)
    return {name.replace("kafka_", "sqs_", 1) for name in fired}, dead


def observed_events(env: AirflowEnv) -> Counter[tuple[str, str]]:
    """``(watcher/asset name, message_id) -> number of asset events`` from the metadata DB."""
    counts: Counter[tuple[str, str]] = Counter()
    for event in env.asset_events():
        extra = event.get("extra")
        payload = extra.get("payload") if isinstance(extra, dict) and extra.get("from_trigger") else None
        if isinstance(payload, dict) and event.get("name") in WATCHERS:
            counts[str(event["name"]), str(payload["message_id"])] += 1
    return counts


def missing_events(published: dict[str, OrderMessage], events: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        (watcher, message_id)
        for message_id, message in published.items()
        for watcher in sorted(expected_for(message)[0])
        if events[watcher, message_id] == 0
    ]


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sqs_airflow(sqs_orders: SqsOrders, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowEnv]:
    dags = tmp_path_factory.mktemp("sqs-dags")
    (dags / "e2e_sqs_orders.py").write_text(DAG_FILE)
    for helper in ("order_events.py", "order_filters.py"):
        shutil.copy2(EXAMPLE_DAGS / helper, dags / helper)
    connection = sqs_orders.airflow_connection()
    env = AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(connection)},
        env={
            "ORDERS_SQS_QUEUE_URL": sqs_orders.queue_url,
            "ORDERS_SQS_DLQ_URL": sqs_orders.dlq_url,
            "ORDERS_AWS_CONN_ID": CONN_ID,
            "ORDERS_OUTPUT_DIR": str(tmp_path_factory.mktemp("sqs-output")),
        },
        triggerer={"shared_stream_ack_timeout": 120.0},
        home=tmp_path_factory.mktemp("sqs-airflow-home"),
        python_path=(dags,),
    )
    with env:
        env.wait_for_dags(DAGS)
        env.unpause(DAGS)
        env.wait_for_watchers(WATCHERS)
        yield env


# -- the test --------------------------------------------------------------------------------------------
def test_sqs_watchers_share_one_poller_and_delete_after_persist(sqs_airflow: AirflowEnv, sqs_orders: SqsOrders) -> None:
    messages = sample_orders(MESSAGES, seed=11, malformed_every=8, prefix="sqs-")
    published = sqs_orders.publish(messages)
    assert len(published) == MESSAGES

    def all_events() -> Counter[tuple[str, str]] | None:
        events = observed_events(sqs_airflow)
        return events if not missing_events(published, events) else None

    sqs_airflow.wait_until(all_events, timeout=180, what=f"asset events for {MESSAGES} messages", interval=2)

    dead = {mid for mid, message in published.items() if expected_for(message)[1]}
    assert dead, "the sample must contain malformed orders"
    sqs_airflow.wait_until(
        lambda: dead <= set(sqs_orders.dead_letters()), timeout=120, what="malformed orders in the DLQ queue"
    )
    sqs_airflow.wait_until(
        lambda: sqs_orders.backlog(sqs_orders.queue_url) == 0, timeout=120, what="the source queue to be empty"
    )

    events = observed_events(sqs_airflow)
    assert not missing_events(published, events)
    unexpected = [
        (watcher, mid)
        for mid, message in published.items()
        for watcher in WATCHERS
        if watcher not in expected_for(message)[0] and events[watcher, mid]
    ]
    assert not unexpected, unexpected
    per_watcher = Counter(w for (w, mid) in events if mid in published)
    expected_counts = Counter(w for message in published.values() for w in expected_for(message)[0])
    assert set(per_watcher) == set(expected_counts) == set(WATCHERS), "the sample must exercise every watcher"
    # At least once: a redelivery may repeat an event, never drop one (checked above).
    assert all(per_watcher[w] >= expected_counts[w] for w in WATCHERS), (per_watcher, expected_counts)

    dlq = sqs_orders.dead_letters()
    assert {mid for mid in dlq if mid in published} == dead
    assert all("malformed order" in dlq[mid] for mid in dead), {mid: dlq[mid] for mid in dead}

    # One shared receive loop for the four watchers: one client opened, one triggerer job.
    opening = f"SQS shared stream connecting to {sqs_orders.queue_url}"
    log = sqs_airflow.components["triggerer"].log_text()
    assert log.count(opening) == 1, f"expected exactly one shared SQS poller, log has {log.count(opening)}"
    jobs = {job for _, watcher, job in sqs_airflow.running_watchers() if watcher in WATCHERS}
    assert len(jobs) == 1
