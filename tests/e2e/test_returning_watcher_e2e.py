"""
Real Airflow, moto server: a watcher the triggerer force-fails (ack timeout) and re-creates while
its sibling goes on, on a queue broker. It must still get an asset event for every message
(docs/reliability.md, "Returning watchers").

Two SQS watchers share one receive loop: ``returning_all`` fires on every order; ``returning_stall``
too, but its filter (``filter_mode="thread"``) blocks once, on one order, for longer than the
triggerer's ``shared_stream_ack_timeout`` (5 s here). The manager force-fails it (``AckTimeout``),
the triggerer re-creates its trigger on a later loop, and orders keep arriving at 10 a second
meanwhile. Before the fix the messages the sibling acked while the stalled watcher was away were
deleted from the queue: lost for it (measured with this test on the code before the fix: see the
docs). Now the stream receives nothing while it is away and gives back what was broadcast
without it.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.demo import EXAMPLE_DAGS, sample_orders
from devkit.demo_streams import SqsOrders

pytestmark = [pytest.mark.e2e, pytest.mark.sqs, pytest.mark.timeout(600)]

CONN_ID = "aws_sqs_returning"
WATCHERS = ("returning_all", "returning_stall")
DAGS = tuple(f"{watcher}_consumer" for watcher in WATCHERS)
MESSAGES = 150
RATE = 10.0
STALL_INDEX = 30  # the order the stalling filter blocks on (once)
ACK_TIMEOUT = 5.0
STALL_SECONDS = 12.0

STALL_FILTER = textwrap.dedent(
    '''
    """Fires on everything; blocks once, on one order, longer than the triggerer's ack timeout."""

    from __future__ import annotations

    import os
    import time
    from pathlib import Path
    from typing import Any


    def stall_once(envelope: dict[str, Any]) -> bool:
        body = envelope.get("body")
        if isinstance(body, dict) and body.get("order_id") == os.environ["STALL_ORDER_ID"]:
            marker = Path(os.environ["STALL_MARKER"])
            if not marker.exists():
                marker.write_text("stalled")
                time.sleep(float(os.environ["STALL_SECONDS"]))
        return True
    '''
)

DAG_FILE = textwrap.dedent(
    '''
    """E2E: two SQS watchers on one queue; one of them stalls once past the ack timeout."""

    from __future__ import annotations

    import os
    from typing import Any

    from airflow.sdk import Asset, AssetWatcher, dag, task

    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger


    def watcher(name: str, **watcher_filter: Any) -> AssetWatcher:
        trigger = SqsSharedStreamTrigger(
            queue_url=os.environ["RETURNING_QUEUE_URL"],
            aws_conn_id=os.environ["RETURNING_AWS_CONN_ID"],
            wait_time_seconds=2,
            **watcher_filter,
        )
        return AssetWatcher(name=name, trigger=trigger)


    ASSETS = [
        Asset("returning_all", watchers=[watcher("returning_all")]),
        Asset(
            "returning_stall",
            watchers=[
                watcher(
                    "returning_stall",
                    filter_function="stall_filter.stall_once",
                    filter_mode="thread",
                    filter_timeout=300.0,
                )
            ],
        ),
    ]

    for _asset in ASSETS:

        @dag(dag_id=f"{_asset.name}_consumer", schedule=[_asset], max_active_runs=1, catchup=False, tags=["e2e"])
        def consumer() -> None:
            @task
            def noop() -> None:
                return None

            noop()

        consumer()
    '''
)


@pytest.fixture(scope="module")
def stall_marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stall") / "stalled"


@pytest.fixture(scope="module")
def airflow(
    sqs_orders: SqsOrders, stall_marker: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AirflowEnv]:
    dags = tmp_path_factory.mktemp("returning-dags")
    (dags / "e2e_returning_watcher.py").write_text(DAG_FILE)
    (dags / "stall_filter.py").write_text(STALL_FILTER)
    shutil.copy2(EXAMPLE_DAGS / "order_events.py", dags / "order_events.py")
    connection = sqs_orders.airflow_connection()
    env = AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(connection)},
        env={
            "RETURNING_QUEUE_URL": sqs_orders.queue_url,
            "RETURNING_AWS_CONN_ID": CONN_ID,
            "STALL_ORDER_ID": f"ret-{STALL_INDEX:06d}",
            "STALL_MARKER": str(stall_marker),
            "STALL_SECONDS": str(STALL_SECONDS),
        },
        # Everything else is Airflow's default (cohort, queue size); the ack timeout is short so
        # that the stall outlasts it.
        triggerer={"shared_stream_ack_timeout": ACK_TIMEOUT},
        home=tmp_path_factory.mktemp("returning-airflow-home"),
        python_path=(dags,),
    )
    with env:
        env.wait_for_dags(DAGS)
        env.unpause(DAGS)
        env.wait_for_watchers(WATCHERS)
        yield env


def events_per_watcher(env: AirflowEnv) -> dict[str, Counter[str]]:
    """``watcher -> message_id -> asset events`` from the metadata DB."""
    seen: dict[str, Counter[str]] = {watcher: Counter() for watcher in WATCHERS}
    for event in env.asset_events():
        extra = event.get("extra")
        payload = extra.get("payload") if isinstance(extra, dict) and extra.get("from_trigger") else None
        if isinstance(payload, dict) and event.get("name") in seen:
            seen[str(event["name"])][str(payload["message_id"])] += 1
    return seen


def test_a_force_failed_watcher_gets_every_message_after_the_triggerer_re_creates_it(
    airflow: AirflowEnv, sqs_orders: SqsOrders, stall_marker: Path
) -> None:
    messages = sample_orders(MESSAGES, seed=5, malformed_every=0, prefix="ret-")
    published = sqs_orders.publish(messages, rate=RATE)
    assert len(published) == MESSAGES
    # Waited for, not assumed: publishing takes MESSAGES / RATE seconds, and on a loaded machine
    # the stream may form (and its filter reach the stalling order) only after that (CI rehearsal
    # beside a kill loop: the stream formed 16 s after its triggers started).
    airflow.wait_until(stall_marker.exists, timeout=120, what="the stalling filter to run on its order", interval=1)

    def complete() -> dict[str, Counter[str]] | None:
        seen = events_per_watcher(airflow)
        return seen if all(set(published) <= set(seen[w]) for w in WATCHERS) else None

    try:
        airflow.wait_until(complete, timeout=240, what=f"both watchers' events for {MESSAGES} messages", interval=2)
    finally:
        seen = events_per_watcher(airflow)
        lost = {w: len(set(published) - set(seen[w])) for w in WATCHERS}
        print(f"lost per watcher: {lost}; events: { {w: sum(seen[w].values()) for w in WATCHERS} }")
    airflow.wait_until(lambda: sqs_orders.backlog(sqs_orders.queue_url) == 0, timeout=120, what="the queue to be empty")
    log = airflow.components["triggerer"].log_text()
    # It really was force-failed and re-created, and the stream waited for it.
    assert "Ack timeout; force-failing subscriber" in log
    assert "reads nothing until watcher" in log
    assert "reads again: watcher" in log
