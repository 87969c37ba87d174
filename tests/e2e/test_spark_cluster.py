"""
The PySpark pipeline of the example Dags on a real Spark cluster, through real Airflow tasks.

One module-scoped Spark standalone cluster (master + 2 workers, ``devkit.spark_cluster``) with a
Spark Connect server on it, and one real Airflow (scheduler, LocalExecutor, api-server). The Dag
file (written here) builds the example pipeline three times with
``orders_spark.build_orders_spark_pipeline``, identical but for the Spark connection, all scheduled
on one asset so that **one stream of asset events is the input of all three**:

* ``spark_cluster_local``: ``local[2]`` in the task process (the demo's connection), the reference;
* ``spark_cluster_standalone``: a ``spark`` connection to ``spark://127.0.0.1:<port>`` (the task is
  the driver, executors on the workers);
* ``spark_cluster_connect``: a ``spark_connect`` connection to ``sc://127.0.0.1:<port>`` (the
  server plans and runs everything; the task only holds a gRPC client).

Two batches go through (asset events posted over the REST API): the first with an in-batch
duplicate and a malformed order, the second with two orders of the first redelivered. Each batch is
exactly one Dag run per Dag (events posted while the Dags are paused wait in the asset's history;
the event that follows the unpause queues a run that takes them all), so the three runs of a batch
saw the same events. Asserted: both cluster Dags wrote exactly the local Dag's Parquet output
(rows, schema, per batch) and returned the same counts, the local output is what was sent, and the
work really ran on the cluster (master's application list) and on the Connect server (its log).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.airflow_env import AirflowEnv
from devkit.demo import SPARK_LOCAL_CONNECTION, build_dags_folder
from devkit.spark_cluster import SparkCluster
from tests.slow import slow_opt_in

pytestmark = [pytest.mark.e2e, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


# CI's time budget (about 4 minutes on the CI machine): the standalone cluster is in CI through
# tests/e2e/test_production.py (every pipeline run there goes to a standalone master with two
# workers); this module adds the three modes side by side and Spark Connect.
_slow_opt_in = slow_opt_in(
    "SPARK_CLUSTER_SLOW",
    "the pipeline on local, standalone and Connect side by side (4 min)",
    scope="module",
    autouse=True,
)


MODES = ("local", "standalone", "connect")
ASSET = "spark_cluster_orders"
CONNECT_USER = "orders-e2e"  # the Connect connection's login: the server logs it per session
DAG_FILES = ("orders_spark.py", "order_events.py", "order_filters.py")

DAG_FILE = f'''
"""The example PySpark pipeline, once per Spark connection, all on one asset (tests/e2e/test_spark_cluster.py)."""
from airflow.sdk import Asset
from orders_spark import build_orders_spark_pipeline

orders = Asset({ASSET!r})
for mode in {MODES!r}:
    build_orders_spark_pipeline(
        dag_id=f"spark_cluster_{{mode}}", source=orders, dataset=mode, conn_id=f"spark_{{mode}}"
    )
'''


def dag_id(mode: str) -> str:
    return f"spark_cluster_{mode}"


def order(message_id: str, region: str, amount: float, minute: int) -> dict[str, Any]:
    """An envelope as a watcher would fire it (the asset event's ``extra``)."""
    return {
        "message_id": message_id,
        "broker": "test",
        "source": "orders",
        "body": {
            "order_id": f"o-{message_id}",
            "region": region,
            "amount": amount,
            "created_at": f"2026-01-01T12:{minute:02d}:30Z",
        },
        "body_encoding": "json",
        "published_at": None,
    }


FIRST = [
    order("m01", "eu", 10.5, 0),
    order("m02", "eu", 4.25, 0),
    order("m03", "us", 100.0, 0),
    order("m04", "apac", 7.75, 1),
    order("m05", "us", 0.1, 1),
    order("m06", "latam", 1999.99, 1),
    order("m02", "eu", 4.25, 0),  # redelivered inside the batch: one row
    order("m07", "mars", 5.0, 1),  # malformed (unknown region): skipped by extract
    order("m08", "eu", 0.2, 2),
]
SECOND = [
    order("m03", "us", 100.0, 0),  # redelivered from the first batch: not counted again
    order("m09", "apac", 12.0, 2),
    order("m06", "latam", 1999.99, 1),  # redelivered from the first batch
    order("m10", "eu", 0.7, 2),
]
BATCHES = (FIRST, SECOND)


def expected_output() -> dict[str, Any]:
    """What the pipeline must write, restated from its documented semantics (not from its code)."""
    lines: list[tuple[Any, ...]] = []
    revenue: dict[tuple[int, str, str], tuple[int, float]] = {}
    stored: set[str] = set()
    # A run reads its triggering events and every event of the source stored since the previous
    # successful run's start, less a 10 minute margin (orders_spark.events_to_process): here every
    # batch so far. What it reads again is dropped as already stored.
    read_so_far: set[str] = set()
    results = []
    for index, batch in enumerate(BATCHES):
        valid = {e["message_id"]: e["body"] for e in batch if e["body"]["region"] != "mars"}
        new = {mid: body for mid, body in valid.items() if mid not in stored}
        stored |= set(new)
        read_so_far |= set(valid)
        for mid, body in new.items():
            minute = body["created_at"][:16]
            lines.append((index, mid, body["order_id"], body["region"], body["amount"], minute))
            count, total = revenue.get((index, body["region"], minute), (0, 0.0))
            revenue[index, body["region"], minute] = (count + 1, total + body["amount"])
        groups = sum(1 for key in revenue if key[0] == index)
        received = len(read_so_far)
        results.append({"received": received, "new": len(new), "duplicates": received - len(new), "groups": groups})
    return {
        "lines": sorted(lines),
        "revenue": sorted((*key, count, round(total, 2)) for key, (count, total) in revenue.items()),
        "results": results,
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[SparkCluster]:
    spark = SparkCluster(workers=2, worker_cores=2, worker_memory="1g", connect=True, connect_cores=2)
    with spark:
        yield spark
    # Every JVM of the cluster (master, workers, their executors, the Connect server) is gone.
    assert spark.leftover_pids() == []


@pytest.fixture(scope="module")
def airflow(cluster: SparkCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowEnv]:
    dags = build_dags_folder(tmp_path_factory.mktemp("spark-cluster-dags"), files=DAG_FILES)
    (dags / "spark_cluster_pipelines.py").write_text(DAG_FILE)
    env = AirflowEnv(
        dags,
        connections={
            "spark_local": SPARK_LOCAL_CONNECTION,
            "spark_standalone": cluster.standalone_connection(),
            "spark_connect": cluster.connect_connection(user_id=CONNECT_USER),
        },
        env={"ORDERS_OUTPUT_DIR": str(tmp_path_factory.mktemp("spark-cluster-output"))},
        home=tmp_path_factory.mktemp("spark-cluster-airflow-home"),
    )
    with env:
        env.wait_for_dags([dag_id(mode) for mode in MODES])
        yield env


@pytest.fixture(scope="module")
def runs(airflow: AirflowEnv) -> dict[str, list[dict[str, Any]]]:
    """Send both batches; ``mode -> its Dag runs`` (oldest first), every run finished."""
    asset = airflow.asset(ASSET)
    assert asset is not None
    dag_ids = [dag_id(mode) for mode in MODES]
    for number, batch in enumerate(BATCHES, start=1):
        # Paused Dags queue no run for an event; the events still go to the asset's history. The
        # first event after the unpause queues one run per Dag whose window (since the previous
        # run) holds the whole batch.
        airflow.pause(dag_ids)
        for envelope in batch[:-1]:
            airflow.api("POST", "/api/v2/assets/events", json={"asset_id": asset["id"], "extra": envelope})
        airflow.unpause(dag_ids, reparse=False)
        airflow.api("POST", "/api/v2/assets/events", json={"asset_id": asset["id"], "extra": batch[-1]})

        def finished(number: int = number) -> bool:
            for name in dag_ids:
                states = [run["state"] for run in airflow.dag_runs(name)]
                if len(states) < number or any(state not in ("success", "failed") for state in states):
                    return False
            return True

        airflow.wait_until(finished, timeout=420, what=f"batch {number}: one finished run per Dag", interval=2.0)
    result = {mode: airflow.dag_runs(dag_id(mode)) for mode in MODES}
    for mode, dag_runs in result.items():
        for run in dag_runs:
            if run["state"] != "success":
                pytest.fail(f"{dag_id(mode)} run {run['dag_run_id']} {run['state']}:\n{task_logs(airflow, mode, run)}")
    return result


def task_logs(airflow: AirflowEnv, mode: str, run: dict[str, Any]) -> str:
    return "\n".join(
        f"--- {task} ---\n{airflow.task_log(dag_id(mode), run['dag_run_id'], task)[-6000:]}"
        for task in ("extract", "aggregate")
    )


def output_of(airflow: AirflowEnv, mode: str, dag_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The Parquet datasets (read with pyarrow, no Spark) and the ``aggregate`` results, per batch."""
    import pyarrow.dataset as ds
    from orders_spark import batch_id_for

    base = Path(airflow.process_env["ORDERS_OUTPUT_DIR"]) / mode
    batch_index = {batch_id_for(str(run["dag_run_id"])): index for index, run in enumerate(dag_runs)}

    def rows(name: str, columns: list[str]) -> tuple[Any, list[tuple[Any, ...]]]:
        dataset = ds.dataset(str(base / name), format="parquet", partitioning="hive")
        table = dataset.to_table()
        out = [(batch_index[str(r["batch_id"])], *(r[c] for c in columns)) for r in table.to_pylist()]
        return dataset.schema, sorted(out)

    lines_schema, lines = rows("order_lines", ["message_id", "order_id", "region", "amount", "minute"])
    revenue_schema, revenue = rows("revenue_by_region_minute", ["region", "minute", "orders", "revenue"])
    results = []
    for run in dag_runs:
        entry = airflow.api(
            "GET",
            f"/api/v2/dags/{dag_id(mode)}/dagRuns/{run['dag_run_id']}/taskInstances/aggregate/xcomEntries/return_value",
        )
        value = dict(entry["value"])
        assert value.pop("batch_id") == batch_id_for(str(run["dag_run_id"]))
        results.append(value)
    return {
        "lines": lines,
        "revenue": revenue,
        "results": results,
        "schema": (str(lines_schema), str(revenue_schema)),
    }


@pytest.fixture(scope="module")
def outputs(airflow: AirflowEnv, runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {mode: output_of(airflow, mode, runs[mode]) for mode in MODES}


def test_local_output_is_what_was_sent(outputs: dict[str, dict[str, Any]]) -> None:
    expected = expected_output()
    local = outputs["local"]
    assert local["lines"] == expected["lines"]
    assert local["revenue"] == expected["revenue"]
    assert local["results"] == expected["results"]


@pytest.mark.parametrize("mode", ["standalone", "connect"])
def test_cluster_output_equals_local(mode: str, outputs: dict[str, dict[str, Any]]) -> None:
    assert outputs[mode] == outputs["local"]


def test_standalone_runs_ran_on_the_cluster(cluster: SparkCluster, runs: dict[str, list[dict[str, Any]]]) -> None:
    # @task.pyspark names the application "<dag_id>-<task_id>": one per run, each granted cores
    # (executors on the workers), and the local and Connect Dags never registered with the master.
    apps = cluster.applications()
    names = [app["name"] for app in apps]
    standalone = [app for app in apps if app["name"] == f"{dag_id('standalone')}-aggregate"]
    assert len(standalone) == len(runs["standalone"]) == len(BATCHES), names
    assert all(int(app["cores"]) > 0 for app in standalone), standalone
    assert not any(name.startswith((dag_id("local"), dag_id("connect"))) for name in names), names


def test_connect_runs_ran_on_the_server(cluster: SparkCluster, runs: dict[str, list[dict[str, Any]]]) -> None:
    # One client session per task run, opened with the connection's login as user id.
    log = cluster.log_path("connect").read_text(errors="replace")
    deadline = time.monotonic() + 30  # the server logs the close after the client's release call
    while log.count(f"Closing session with userId: {CONNECT_USER} ") < len(BATCHES) and time.monotonic() < deadline:
        time.sleep(1)
        log = cluster.log_path("connect").read_text(errors="replace")
    assert log.count(f"Closing session with userId: {CONNECT_USER} ") == len(runs["connect"]) == len(BATCHES)
