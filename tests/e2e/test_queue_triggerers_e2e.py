"""
Several triggerers on a queue-like broker: the consumers of two triggerers' streams compete for
messages, so a split loses messages for watchers (issue 15, part 2). Two real triggerers on one
metadata DB, 20 watchers (``kill_loop_w0`` .. ``kill_loop_w19``) on one shared stream
(tests/e2e/dags/e2e_kill_loop_watchers.py; every order matches all of them), per broker
(``loop_brokers.py``): SQS (moto server, one queue), Pub/Sub (Google's emulator, one
subscription) and Service Bus (the test broker of ``tests/servicebus_broker``, one queue).

Proven for each of the three brokers:

1. **The recipe holds**: ``[triggerer] queues_enabled = True`` and the second triggerer started with
   ``--queues``: it never takes a watcher (asset watchers have no queue), so every watcher runs in
   the first one; ``kill -9`` and restart of the first one: lost 0 per watcher (20 orders before the
   kill, 20 published while the first triggerer is down), no split reported by either triggerer.
2. **A split is detected loudly** (``_core/split.py``): the first triggerer forms the stream with all
   20 watchers (its cohort record lists them), is killed; the second one (``capacity`` 10) takes
   10 of them, the restarted first one the other 10. Both streams then log the ERROR
   ``is SPLIT across triggerers`` about ``10 of its watchers``, naming the other triggerer's stream.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.demo import build_dags_folder, make_order
from tests.e2e.loop_brokers import CONN_ID, Deliveries, LoopBroker, dag_env, loop_broker
from tests.slow import skip_unless_slow

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

COUNT = 20
WATCHERS = tuple(f"kill_loop_w{index}" for index in range(COUNT))
DAG_ID = "kill_loop_consumer"
DAG_FILE = Path(__file__).parent / "dags" / "e2e_kill_loop_watchers.py"
AT = datetime(2026, 11, 25, tzinfo=timezone.utc)
SPLIT = "is SPLIT across triggerers"
PUBLISH_RATE = 50.0  # messages per second: a burst, sent one by one


@pytest.fixture(
    params=[
        pytest.param("sqs", marks=pytest.mark.sqs),
        pytest.param("pubsub", marks=pytest.mark.pubsub),
        pytest.param("servicebus", marks=pytest.mark.servicebus),
    ]
)
def broker(request: pytest.FixtureRequest) -> Iterator[LoopBroker]:
    with loop_broker(str(request.param)) as started:
        yield started


def queue_airflow(broker: LoopBroker, tmp_path_factory: pytest.TempPathFactory, **triggerer: object) -> AirflowEnv:
    dags = build_dags_folder(tmp_path_factory.mktemp(f"queue-dags-{broker.name}"), files=(), extra=[DAG_FILE])
    return AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(broker.connection())},
        env=dag_env(broker, COUNT),
        triggerer={**triggerer, "triggerer_health_check_threshold": 30},  # Airflow's default
        # Heartbeats every 5 s (default 30) so the split shows within a test's patience.
        config={"shared_stream_provider": {"heartbeat_interval": 5}},
        home=tmp_path_factory.mktemp(f"queue-airflow-home-{broker.name}"),
    )


def publish(broker: LoopBroker, prefix: str, count: int) -> list[str]:
    """The envelope ``message_id`` of ``count`` new orders (every one matches every watcher)."""
    before = len(broker.published_ids())
    orders = [make_order(f"{prefix}{i}", "eu", 1.0, AT) for i in range(count)]
    broker.publish(orders, rate=PUBLISH_RATE, stop=threading.Event())
    ids = broker.published_ids()[before:]
    assert len(ids) == count, f"the {broker.name} broker accepted {len(ids)} of {count} orders"
    return ids


def holders(env: AirflowEnv) -> Counter[int | None]:
    return Counter(job for _, watcher, job in env.running_watchers() if watcher in WATCHERS)


def split_line(log: str) -> str | None:
    return next((line for line in log.splitlines() if SPLIT in line), None)


def test_one_watcher_triggerer_recipe_loses_nothing(
    request: pytest.FixtureRequest, broker: LoopBroker, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # CI's time budget (under 60 minutes): the recipe runs with -m slow or KILL_LOOP_SLOW=1 on every
    # queue broker (100-150 s each on the CI machine); it is broker-neutral (the triggerer's queues).
    skip_unless_slow(request.config, "KILL_LOOP_SLOW", f"the recipe on {broker.name} (about 2 minutes)")
    with queue_airflow(broker, tmp_path_factory, queues_enabled=True) as env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        deliveries = Deliveries(env, WATCHERS)
        job_a = env.latest_triggerer_job_id()
        env.add_triggerer("triggerer-b", args=["--queues", "not_watchers"])
        env.wait_until(lambda: env.latest_triggerer_job_id() > job_a, timeout=120, what="triggerer B's job")
        first = publish(broker, "recipe-a", 20)
        env.wait_until(lambda: not deliveries.refresh().missing(first), timeout=300, what="first orders", interval=2)
        previous = env.restart_triggerer(kill=True)
        second = publish(broker, "recipe-b", 20)  # waits in the broker while A is down
        env.wait_for_watchers(WATCHERS, newer_than_job=previous, timeout=300)
        try:
            env.wait_until(
                lambda: not deliveries.refresh().missing(second), timeout=300, what="second orders", interval=2
            )
        except Exception:
            lost = deliveries.refresh().missing(second)
            pytest.fail(
                f"{broker.name}: lost {sum(lost.values())} (watcher, order) pairs; per watcher: {lost}; "
                f"broker: {broker.diagnostics()}"
            )
        assert set(holders(env)) == {env.latest_triggerer_job_id()}, "triggerer B must never hold a watcher"
        counts = deliveries.refresh().counts
        dups = sum(counts[w, o] - 1 for o in first + second for w in WATCHERS)
        logs = env.components["triggerer"].log_text() + env.components["triggerer-b"].log_text()
        assert SPLIT not in logs
        print(
            f"\nQUEUE RECIPE {broker.name}: watchers={COUNT} orders={len(first) + len(second)} kills=1 "
            f"lost=0 dup={dups}"
        )


def test_a_split_across_two_triggerers_is_reported_loudly(
    request: pytest.FixtureRequest, broker: LoopBroker, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Split detection is broker-neutral (_core/split.py, whose rules tests/unit/test_split.py drives
    # through the real asset state store); this end-to-end proof takes over 2 minutes per broker on
    # the CI machine, so it runs with KILL_LOOP_SLOW=1 (or -m slow) only.
    skip_unless_slow(request.config, "KILL_LOOP_SLOW", f"split detection on {broker.name} (over 2 min)")
    with queue_airflow(broker, tmp_path_factory) as env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        deliveries = Deliveries(env, WATCHERS)
        first = publish(broker, "split-a", 5)
        # The stream forms with all 20 (its cohort record in every watcher's asset lists them).
        env.wait_until(lambda: not deliveries.refresh().missing(first), timeout=300, what="first orders", interval=2)
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

        def restarted_a_log() -> str:
            return env.components["triggerer"].log_text().split("===== devkit: start #")[-1]

        env.wait_until(
            lambda: SPLIT in env.components["triggerer-b"].log_text() and SPLIT in restarted_a_log(),
            timeout=180,
            what="both triggerers reporting the split",
            interval=2,
        )
        line_b = split_line(env.components["triggerer-b"].log_text())
        line_a = split_line(restarted_a_log())
        for line in (line_b, line_a):
            assert line is not None
            assert "10 of its watchers" in line, line
            assert "error" in line.lower(), line
        assert line_b is not None and line_a is not None
        print(f"\nSPLIT DETECTED {broker.name} (jobs {job_a} -> {job_a2} and {job_b}): B: {line_b[:400]}")
        print(f"SPLIT DETECTED {broker.name} (restarted A): {line_a[:400]}")
