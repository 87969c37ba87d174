"""
The demo on SQS (``python -m devkit.demo --broker sqs``), run as a user runs it: a moto server, a
throwaway Airflow, ``example_dags/example_sqs_orders.py`` with its PySpark pipeline.

The demo checks its own outcome from independent clients (asset events in the metadata DB, the
queue emptied, the DLQ queue's count, the Parquet output) and exits 0 only when all of it matches
the scenario's documented expectations; this test holds it to that and to its summary.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from devkit.demo import REPO_ROOT, expected_watchers, flush_order, sample_orders

pytestmark = [pytest.mark.e2e, pytest.mark.sqs, pytest.mark.spark, pytest.mark.timeout(900)]

MESSAGES = 60


def test_the_sqs_demo_runs_the_example_dags_end_to_end() -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "devkit.demo",
            "--broker",
            "sqs",
            "--plain",
            "--messages",
            str(MESSAGES),
            "--rate",
            "30",
            "--timeout",
            "500",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert re.search(r"result\s+: OK", completed.stdout), completed.stdout[-3000:]

    messages = [*sample_orders(MESSAGES), flush_order()]
    expected_dlq = sum(expected_watchers(message)[1] for message in messages)
    valid = sum("kafka_orders_valid" in expected_watchers(message)[0] for message in messages)
    assert f"settled            : {MESSAGES + 1} of {MESSAGES + 1}: 0 still in queue orders" in completed.stdout
    assert f"dead-lettered      : {expected_dlq} (expected {expected_dlq}) in queue orders-dlq" in completed.stdout
    fired = re.search(r"asset events sqs_orders_valid\s+: (\d+)", completed.stdout)
    assert fired is not None and int(fired.group(1)) >= valid  # at least once: a redelivery may repeat one
    assert f"'order_lines': {valid}," in completed.stdout  # the PySpark pipeline wrote every valid order once
