"""
The deployment advice for large XComs (``devkit.production.xcom_object_storage_config``): the
options, set as Airflow reads them from the environment, make Airflow's own object-storage backend
write a pipeline batch to a file and hand back only its path, and read the batch back whole.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.providers.common.io.xcom.backend import XComObjectStorageBackend

from devkit.airflow_env import _config_env, _config_value
from devkit.production import XCOM_OBJECT_STORAGE_BACKEND, xcom_object_storage_config


def configure(monkeypatch: pytest.MonkeyPatch, root: Path, threshold: int) -> None:
    config = xcom_object_storage_config(root, threshold)
    assert config["core"]["xcom_backend"] == XCOM_OBJECT_STORAGE_BACKEND
    for section, options in config.items():
        for option, value in options.items():
            monkeypatch.setenv(_config_env(section, option), _config_value(value))


def batch(orders: int) -> list[dict[str, Any]]:
    return [
        {"message_id": f"m-{i}", "order_id": f"o-{i}", "region": "eu", "amount": 1.5, "minute": "2026-11-28T06:00"}
        for i in range(orders)
    ]


def test_a_dotted_section_is_named_as_airflow_reads_it() -> None:
    assert _config_env("common.io", "xcom_objectstorage_path") == "AIRFLOW__COMMON_IO__XCOM_OBJECTSTORAGE_PATH"


def test_a_large_batch_goes_to_a_file_and_comes_back_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    configure(monkeypatch, tmp_path, 64 * 1024)
    rows = batch(2_000)  # ~200 KB of JSON
    stored = XComObjectStorageBackend.serialize_value(
        rows, key="return_value", task_id="extract", dag_id="d", run_id="r"
    )
    assert len(stored) < 500, "the metadata DB gets the path, not the batch"
    (written,) = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert written.suffix == ".gz" and json.loads(gzip.decompress(written.read_bytes())) == rows
    assert XComObjectStorageBackend.deserialize_value(SimpleNamespace(value=stored)) == rows


def test_a_small_value_stays_in_the_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    configure(monkeypatch, tmp_path, 64 * 1024)
    stored = XComObjectStorageBackend.serialize_value(12, key="orders", task_id="extract", dag_id="d", run_id="r")
    assert not any(tmp_path.rglob("*"))
    assert XComObjectStorageBackend.deserialize_value(SimpleNamespace(value=stored)) == 12
