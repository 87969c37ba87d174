"""
Several triggerers on a plain queue (SQS, moto): the consumers of two triggerers' streams compete for
messages, so a split loses messages for watchers (issue 15, part 2). Two real triggerers on one
metadata DB, 20 watchers on one queue (tests/e2e/dags/e2e_many_watchers.py):

1. **The recipe holds**: ``[triggerer] queues_enabled = True`` and the second triggerer started with
   ``--queues``: it never takes a watcher (asset watchers have no queue), so every watcher runs in
   the first one; ``kill -9`` and restart of the first one: lost 0 per watcher, no split reported.
2. **A split is detected loudly** (``_core/split.py``): the first triggerer forms the stream with all
   20 watchers (its cohort record lists them), is killed; the second one (``capacity`` 10) takes
   10 of them, the restarted first one the other 10. Both streams then log the ERROR
   ``is SPLIT across triggerers``, naming the other triggerer's stream.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from order_events import envelopes_of  # example_dags (on sys.path: tests/e2e/conftest.py)

from devkit.airflow_env import AirflowEnv
from devkit.brokers import start_moto, stop_moto
from devkit.demo import build_dags_folder, make_order
from devkit.demo_streams import MOTO_KEY, SQS_REGION, SqsOrders

pytestmark = [pytest.mark.e2e, pytest.mark.sqs, pytest.mark.timeout(900)]

COUNT = 20
WATCHERS = tuple(f"many_{index:03d}" for index in range(COUNT))
DAG_ID = "many_watchers_consumer"
CONN_ID = "aws_queue_triggerers"
E2E_DAGS = Path(__file__).parent / "dags"
AT = datetime(2026, 11, 25, tzinfo=UTC)
SPLIT = "is SPLIT across triggerers"


@pytest.fixture
def queue() -> Iterator[SqsOrders]:
    handle = start_moto()
    try:
        yield SqsOrders(handle.address)
    finally:
        stop_moto(handle)


def queue_airflow(queue: SqsOrders, tmp_path_factory: pytest.TempPathFactory, **triggerer: object) -> AirflowEnv:
    dags = build_dags_folder(tmp_path_factory.mktemp("queue-dags"), files=(), extra=[E2E_DAGS / "e2e_many_watchers.py"])
    connection = {
        "conn_type": "aws",
        "login": MOTO_KEY,
        "password": MOTO_KEY,
        "extra": {"endpoint_url": queue.endpoint, "region_name": SQS_REGION},
    }
    return AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(connection)},
        env={"MANY_SQS_QUEUE_URL": queue.queue_url, "MANY_AWS_CONN_ID": CONN_ID, "MANY_WATCHERS": str(COUNT)},
        triggerer={**triggerer, "triggerer_health_check_threshold": 30},  # Airflow's default
        # Heartbeats every 5 s (default 30) so the split shows within a test's patience.
        config={"shared_stream_provider": {"heartbeat_interval": 5}},
        home=tmp_path_factory.mktemp("queue-airflow-home"),
    )


def deliveries(env: AirflowEnv) -> Counter[tuple[str, str]]:
    found: Counter[tuple[str, str]] = Counter()
    for event in env.asset_events():
        if event["name"] in WATCHERS:
            for envelope in envelopes_of(event["extra"]):
                found[str(event["name"]), str(envelope["message_id"])] += 1
    return found


def missing(message_ids: list[str], found: Counter[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(w, m) for m in message_ids for w in WATCHERS if not found[w, m]]


def publish(queue: SqsOrders, prefix: str, count: int) -> list[str]:
    """The SQS message ids (the envelopes' ``message_id``) of ``count`` new orders."""
    return list(queue.publish([make_order(f"{prefix}{i}", "eu", 1.0, AT) for i in range(count)]))


def holders(env: AirflowEnv) -> Counter[int | None]:
    return Counter(job for _, watcher, job in env.running_watchers() if watcher in WATCHERS)


def test_one_watcher_triggerer_recipe_loses_nothing(queue: SqsOrders, tmp_path_factory: pytest.TempPathFactory) -> None:
    with queue_airflow(queue, tmp_path_factory, queues_enabled=True) as env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        job_a = env.latest_triggerer_job_id()
        env.add_triggerer("triggerer-b", args=["--queues", "not_watchers"])
        env.wait_until(lambda: env.latest_triggerer_job_id() > job_a, timeout=120, what="triggerer B's job")
        first = publish(queue, "recipe-a", 20)
        env.wait_until(lambda: not missing(first, deliveries(env)), timeout=300, what="first orders", interval=2)
        previous = env.restart_triggerer(kill=True)
        second = publish(queue, "recipe-b", 20)  # waits in the queue while A is down
        env.wait_for_watchers(WATCHERS, newer_than_job=previous, timeout=300)
        try:
            env.wait_until(lambda: not missing(second, deliveries(env)), timeout=300, what="second orders", interval=2)
        except Exception:
            lost = missing(second, deliveries(env))
            pytest.fail(f"lost {len(lost)} (watcher, order) pairs, e.g. {lost[:5]}")
        assert set(holders(env)) == {env.latest_triggerer_job_id()}, "triggerer B must never hold a watcher"
        found = deliveries(env)
        dups = sum(found[w, o] - 1 for o in first + second for w in WATCHERS)
        logs = env.components["triggerer"].log_text() + env.components["triggerer-b"].log_text()
        assert SPLIT not in logs
        print(f"\nQUEUE RECIPE: watchers={COUNT} orders={len(first) + len(second)} kills=1 lost=0 dup={dups}")


def test_a_split_across_two_triggerers_is_reported_loudly(
    queue: SqsOrders, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with queue_airflow(queue, tmp_path_factory) as env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        first = publish(queue, "split-a", 5)
        # The stream forms with all 20 (its cohort record in every watcher's asset lists them).
        env.wait_until(lambda: not missing(first, deliveries(env)), timeout=300, what="first orders", interval=2)
        job_a = env.latest_triggerer_job_id()
        env.kill("triggerer")
        env.add_triggerer("triggerer-b", {"capacity": 10})
        env.wait_until(lambda: holders(env).get(env.latest_triggerer_job_id()) == 10, timeout=240, what="B taking 10")
        job_b = env.latest_triggerer_job_id()
        env.components["triggerer"].start()  # A again: it takes the other 10
        env.wait_until(lambda: env.latest_triggerer_job_id() > job_b, timeout=120, what="A's new job")
        job_a2 = env.latest_triggerer_job_id()
        env.wait_until(
            lambda: holders(env) == Counter({job_a2: 10, job_b: 10}), timeout=240, what="10 watchers on each"
        )
        env.wait_until(
            lambda: (
                SPLIT in env.components["triggerer-b"].log_text()
                and SPLIT in env.components["triggerer"].log_text().split("===== devkit: start #")[-1]
            ),
            timeout=180,
            what="both triggerers reporting the split",
            interval=2,
        )
        line = next(line for line in env.components["triggerer-b"].log_text().splitlines() if SPLIT in line)
        assert "10 of its watchers" in line, line
        print(f"\nSPLIT DETECTED (jobs {job_a} -> {job_a2} and {job_b}): {line[:400]}")
