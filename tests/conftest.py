"""Test-wide setup: an isolated AIRFLOW_HOME, and the core fixtures every suite shares."""

from __future__ import annotations

import os

from devkit.scratch import throwaway_dir

# Before anything imports airflow: never touch ~/airflow, never load example Dags.
os.environ["AIRFLOW_HOME"] = os.environ.get("AIRFLOW_HOME") or throwaway_dir("airflow-home-tests-")
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")

from collections.abc import Iterator

import pytest

from airflow_shared_stream_provider._core.flow import gates
from tests import ast_guard

ast_guard.install()


@pytest.fixture
def queue_size(monkeypatch: pytest.MonkeyPatch) -> int:
    """A small subscriber queue, configured where the producer reads it (Airflow config)."""
    size = 64
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_SUBSCRIBER_QUEUE_SIZE", str(size))
    return size


@pytest.fixture(autouse=True)
def _cohort_settle_off_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    In-process tests add every watcher in one loop turn, so the producer need not wait for late
    ones (``cohort_settle`` 3 s by default would add 3 s to every stream). Tests of the cohort set
    it themselves; end-to-end tests run real triggerers on the real default.
    """
    if request.node.get_closest_marker("e2e") is None:
        monkeypatch.setenv("AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE", "0")


@pytest.fixture(autouse=True)
def _no_leaked_flow_gates() -> Iterator[None]:
    """Every producer and watcher must give its flow gate back."""
    yield
    leaked = dict(gates._gates)
    gates._gates.clear()
    assert not leaked, f"flow gates leaked by the test: {list(leaked)}"
