"""
End-to-end fixtures: one real Airflow (SQLite, dag-processor, triggerer, scheduler, api-server) and
one Kafka-compatible broker (Tansu) for the whole session; the tests publish to the same ``orders``
stream one after another and assert on what they published (message ids are unique per offset).

``kafka_airflow`` (indirect parameter ``"sqlite"`` or ``"postgres"``) gives a test either that
session Airflow or, for ``"postgres"``, a second one of its own on a throwaway PostgreSQL 15
(``devkit.postgres``) with its own Tansu, started for that test and stopped right after it.

``KAFKA_BOOTSTRAP_SERVERS`` points the suite at an existing broker instead of Tansu.

``STARVE_CPUS`` (an integer or ``all``) runs that many CPU burners at Airflow's priority for the
whole of each module that uses ``starved_cpus`` (``devkit.stress``; docs/reliability.md, "Starved
machine").
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.brokers import BrokerProcess, start_kafka, start_moto, stop_moto
from devkit.demo import (
    CONSUMER_DAGS,
    EXAMPLE_DAGS,
    SPARK_LOCAL_CONNECTION,
    WATCHERS,
    KafkaOrders,
    build_dags_folder,
    kafka_connection,
)
from devkit.demo_streams import SqsOrders
from devkit.postgres import FAST_SETTINGS, PostgresServer
from devkit.stress import CpuStress, cpu_count, stress_from_env
from tests.slow import skip_unless_slow
from tests.statsd_listener import StatsdListener

E2E_DAGS = Path(__file__).parent / "dags"
PRIORITY_WATCHER = "kafka_orders_priority"
ALL_WATCHERS = (*WATCHERS, PRIORITY_WATCHER)
ALL_DAGS = (*CONSUMER_DAGS, "kafka_orders_priority_consumer")

# The example Dags' helper modules (orders_spark, order_events, order_filters) for in-process tests.
if str(EXAMPLE_DAGS) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_DAGS))


@pytest.fixture(scope="module")
def starved_cpus() -> Iterator[CpuStress]:
    """
    ``STARVE_CPUS`` CPU burners (none when unset) for the whole module that uses it.

    Module-scoped and requested first (``pytest.mark.usefixtures`` in the module's ``pytestmark``),
    so the burners start before the module's broker and Airflow fixtures and run through their
    start, the test and their teardown: the Airflow under test starts, restarts and drains on a
    starved machine. Yields the :class:`devkit.stress.CpuStress` (its ``timeout_factor``).
    """
    with stress_from_env() as stress:
        started = time.monotonic()
        if stress.workers:
            print(f"\nSTARVE: {stress.describe()}, pids {stress.pids}", flush=True)
        yield stress
        if stress.workers:
            wall = time.monotonic() - started
            burned = stress.cpu_seconds()
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            print(
                f"\nSTARVE: {stress.workers} burner(s) used {burned:.0f} CPU-s in {wall:.0f} s "
                f"({burned / max(wall, 1e-9):.2f} of {cpu_count()} cores); load average {load}",
                flush=True,
            )


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    configured = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if configured:
        yield configured
        return
    broker: BrokerProcess = start_kafka()
    try:
        yield broker.address
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def sqs_orders() -> Iterator[SqsOrders]:
    """A moto server of the module's own with the ``orders`` / ``orders-dlq`` queues."""
    handle = start_moto()
    try:
        yield SqsOrders(handle.address)
    finally:
        stop_moto(handle)


@pytest.fixture(scope="session")
def orders(kafka_bootstrap: str) -> KafkaOrders:
    stream = KafkaOrders(kafka_bootstrap)
    stream.create_topics()
    return stream


@pytest.fixture(scope="session")
def output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("orders-output")


@contextlib.contextmanager
def running_airflow(
    orders: KafkaOrders,
    output_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    sql_alchemy_conn: str | None = None,
    parallelism: int = 4,
    config: dict[str, dict[str, object]] | None = None,
) -> Iterator[AirflowEnv]:
    """Airflow with the example Kafka Dags plus a fifth watcher whose filter raises, all unpaused."""
    dags = build_dags_folder(
        tmp_path_factory.mktemp("dags"), extra=[E2E_DAGS / "e2e_filters.py", E2E_DAGS / "e2e_priority_orders.py"]
    )
    env = AirflowEnv(
        dags,
        connections={"kafka_default": kafka_connection(orders.bootstrap), "spark_orders": SPARK_LOCAL_CONNECTION},
        env={"ORDERS_OUTPUT_DIR": str(output_dir), "ORDERS_SPARK_CONN_ID": "spark_orders"},
        triggerer={"shared_stream_ack_timeout": 120.0},
        home=tmp_path_factory.mktemp("airflow-home"),
        sql_alchemy_conn=sql_alchemy_conn,
        parallelism=parallelism,
        config=config or {},
    )
    with env:
        env.wait_for_dags(ALL_DAGS)
        env.unpause(ALL_DAGS)
        env.wait_for_watchers(ALL_WATCHERS)
        yield env
        if os.environ.get("E2E_SHOW_LOGS"):
            print(env.log_tails(200))


@pytest.fixture(scope="session")
def statsd() -> Iterator[StatsdListener]:
    """A StatsD collector (UDP on a free loopback port) that the session Airflow sends its metrics to."""
    with StatsdListener() as listener:
        yield listener


@pytest.fixture(scope="session")
def airflow(
    orders: KafkaOrders, output_dir: Path, tmp_path_factory: pytest.TempPathFactory, statsd: StatsdListener
) -> Iterator[AirflowEnv]:
    # StatsD on, with InfluxDB-style tags (Telegraf's statsd input): the provider's ``stream`` tag
    # travels in the metric name, which Airflow then validates (tests/e2e/test_metrics_e2e.py).
    metrics = {
        "statsd_on": True,
        "statsd_host": "127.0.0.1",
        "statsd_port": statsd.port,
        "statsd_influxdb_enabled": True,
    }
    with running_airflow(orders, output_dir, tmp_path_factory, config={"metrics": metrics}) as env:
        yield env


@dataclass(frozen=True)
class KafkaAirflow:
    """One Airflow and the Kafka ``orders`` stream its watchers read."""

    db: str
    env: AirflowEnv
    orders: KafkaOrders


@pytest.fixture
def airflow_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaAirflow]:
    """
    The same Airflow as ``airflow`` on a throwaway PostgreSQL 15, with its own Tansu (the example
    Dags' topic and consumer group are fixed: a shared broker would put both Airflows' consumers in
    one group). Function-scoped: it runs next to the session Airflow only for its own test.
    Durability is off (``FAST_SETTINGS``): the commit-after-persist check reads what the server
    answers, which fsync does not change.
    """
    broker = start_kafka()
    try:
        orders = KafkaOrders(broker.address)
        orders.create_topics()
        with (
            PostgresServer(settings=FAST_SETTINGS) as pg,
            running_airflow(
                orders,
                tmp_path_factory.mktemp("orders-output-pg"),
                tmp_path_factory,
                sql_alchemy_conn=pg.url,
                parallelism=2,
            ) as env,
        ):
            yield KafkaAirflow("postgres", env, orders)
    finally:
        broker.stop()


@pytest.fixture
def kafka_airflow(request: pytest.FixtureRequest) -> KafkaAirflow:
    """Indirect parameter ``"sqlite"`` (the session Airflow) or ``"postgres"`` (``airflow_postgres``)."""
    db = str(request.param)
    if db == "sqlite":
        return KafkaAirflow("sqlite", request.getfixturevalue("airflow"), request.getfixturevalue("orders"))
    if db == "postgres":
        # before its Airflow and broker start
        skip_unless_slow(request.config, "KAFKA_E2E_SLOW", "the Kafka e2e on PostgreSQL (about 2.5 minutes)")
        stack: KafkaAirflow = request.getfixturevalue("airflow_postgres")
        return stack
    raise ValueError(f"kafka_airflow: unknown metadata DB {db!r}")
