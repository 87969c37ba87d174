"""
Late siblings with Airflow's default ``[triggerer]`` settings, in a real triggerer.

120 watchers share one SQS receive loop (moto). A triggerer takes at most 50 new triggers per loop,
so after ``kill -9`` and restart the stream re-forms in three waves while a backlog waits in the
sqs_orders. Before the producer's cohort wait (``_core/cohort.py``) the first wave received and deleted
the backlog before the other 70 watchers subscribed (measured on the real manager: 70 of 120
watchers missed 64 of 300 orders). Every watcher must get every message.

A long variant (about 5 minutes with its setup), run with ``-m slow`` or ``KILL_LOOP_SLOW=1``: the
cohort wait it checks end to end runs in CI on the real manager (``tests/unit/test_cohort.py``,
the waves of 50 triggers per loop; the brokers' contract suites).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from order_events import envelopes_of

from devkit.airflow_env import AirflowEnv
from devkit.demo import build_dags_folder, make_order
from devkit.demo_streams import SqsOrders
from tests.slow import slow_opt_in

# ``starved_cpus``: STARVE_CPUS=N runs N CPU burners for the whole module (tests/e2e/conftest.py).
# _slow_opt_in first: a skip before the module's broker and Airflow fixtures start.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.sqs,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("_slow_opt_in", "starved_cpus"),
]


_slow_opt_in = slow_opt_in(
    "KILL_LOOP_SLOW", "late siblings after kill -9, 120 watchers (about 5 minutes)", scope="module"
)


COUNT = 120
WATCHERS = tuple(f"many_{index:03d}" for index in range(COUNT))
DAG_ID = "many_watchers_consumer"
CONN_ID = "aws_many"
E2E_DAGS = Path(__file__).parent / "dags"
AT = datetime(2026, 11, 25, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def many_airflow(sqs_orders: SqsOrders, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowEnv]:
    dags = build_dags_folder(tmp_path_factory.mktemp("many-dags"), files=(), extra=[E2E_DAGS / "e2e_many_watchers.py"])
    connection = sqs_orders.airflow_connection()
    # [triggerer] left at Airflow's defaults (no cohort grace period, 50 new triggers per loop).
    # Manual negative control (docs/reliability.md, "Late siblings"): LATE_SIBLINGS_COHORT_OFF=1
    # turns the producer's cohort wait off (settle and max wait 0); LATE_SIBLINGS_PER_LOOP=10 makes
    # the re-formation take more triggerer loops.
    per_loop = os.environ.get("LATE_SIBLINGS_PER_LOOP")
    cohort_off = os.environ.get("LATE_SIBLINGS_COHORT_OFF") == "1"
    env = AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(connection)},
        env={"MANY_SQS_QUEUE_URL": sqs_orders.queue_url, "MANY_AWS_CONN_ID": CONN_ID, "MANY_WATCHERS": str(COUNT)},
        triggerer={"max_trigger_to_select_per_loop": int(per_loop)} if per_loop else {},
        config={"shared_stream_provider": {"cohort_settle": 0, "cohort_max_wait": 0}} if cohort_off else {},
        home=tmp_path_factory.mktemp("many-airflow-home"),
    )
    with env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        yield env


def deliveries(env: AirflowEnv) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for event in env.asset_events():
        for envelope in envelopes_of(event.get("extra")):
            counts[str(event["name"]), str(envelope["message_id"])] += 1
    return counts


def missing(message_ids: list[str], found: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(w, m) for m in message_ids for w in WATCHERS if not found[w, m]]


def test_a_backlog_received_after_kill9_reaches_all_120_watchers(
    many_airflow: AirflowEnv, sqs_orders: SqsOrders
) -> None:
    before = list(sqs_orders.publish([make_order(f"many-a{i}", "eu", 1.0, AT) for i in range(5)]))
    many_airflow.wait_until(
        lambda: not missing(before, deliveries(many_airflow)),
        timeout=300,
        what="the first messages everywhere",
        interval=2,
    )
    # kill -9; the backlog waits in the queue while the watchers wait to be re-assigned (30 s
    # health check) and the new triggerer takes them 50 per loop.
    previous_job = many_airflow.restart_triggerer(kill=True)
    backlog = list(sqs_orders.publish([make_order(f"many-b{i}", "us", 2.0, AT) for i in range(30)]))
    many_airflow.wait_for_watchers(WATCHERS, newer_than_job=previous_job, timeout=300)

    def complete() -> Counter[tuple[str, str]] | None:
        found = deliveries(many_airflow)
        return found if not missing(backlog, found) and sqs_orders.backlog(sqs_orders.queue_url) == 0 else None

    try:
        found = many_airflow.wait_until(complete, timeout=300, what="the backlog at all 120 watchers", interval=3)
    except Exception:
        lost = missing(backlog, deliveries(many_airflow))
        short = Counter(watcher for watcher, _ in lost)
        pytest.fail(f"{len(short)} watcher(s) missed {len(lost)} (watcher, message) pairs, e.g. {lost[:5]}")
    duplicates = sum(found[w, m] - 1 for m in backlog for w in WATCHERS)
    log = many_airflow.components["triggerer"].log_text().split("===== devkit: start #")[-1]
    formed = [line for line in log.splitlines() if "formed with" in line]
    print(f"\nlate-siblings figures: watchers={COUNT} backlog={len(backlog)} lost=0 duplicates={duplicates}")
    print("\n".join(line[:200] for line in formed))
    assert any("formed with 120 watcher(s)" in line for line in formed), formed
