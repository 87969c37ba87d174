"""
The production topology's consumer pool (``devkit.production``, ``consumer_pool_slots``): the
cluster policy it writes to ``AIRFLOW_HOME/config`` puts every task of a light consumer Dag in the
pool and leaves the PySpark pipelines' tasks in the default pool, on real Airflow tasks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

from devkit.production import CONSUMER_POOL, ProductionTopology, write_consumer_pool_policy


def load_policy(home: Path) -> ModuleType:
    path = write_consumer_pool_policy(home)
    assert path == home / "config" / "airflow_local_settings.py"
    spec = importlib.util.spec_from_file_location("airflow_local_settings_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("dag_id", "pool"),
    [
        ("kafka_orders_eu_consumer", CONSUMER_POOL),
        ("kafka_orders_more_03_consumer", CONSUMER_POOL),
        ("kafka_orders_spark_pipeline", "default_pool"),
        ("sqs_orders_spark_pipeline", "default_pool"),
    ],
)
def test_the_policy_pools_the_light_consumers_only(tmp_path: Path, dag_id: str, pool: str) -> None:
    policy = load_policy(tmp_path)
    with DAG(dag_id, schedule=None):
        task = EmptyOperator(task_id="consume")
    policy.task_policy(task)
    assert task.pool == pool


def test_a_pool_of_no_slots_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="consumer_pool_slots must be at least 1"):
        ProductionTopology(brokers=("kafka",), workdir=tmp_path, consumer_pool_slots=0)
