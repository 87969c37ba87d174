"""Every example Dag file parses with no import error and loads no broker SDK (trigger modules import none)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from devkit.demo import EXAMPLE_DAGS

SDK_MODULES = ("aiokafka", "aiobotocore", "botocore", "google.cloud.pubsub_v1", "azure.servicebus")


def test_example_dags_parse_without_broker_sdks() -> None:
    # A fresh interpreter: the test session may already have imported SDKs.
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(EXAMPLE_DAGS)!r})
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(EXAMPLE_DAGS)!r})
        print(json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dag_ids),
                          "sdks": [m for m in {SDK_MODULES!r} if m in sys.modules]}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert report["sdks"] == []
    for broker in ("kafka", "sqs", "pubsub", "servicebus"):
        assert f"{broker}_orders_eu_consumer" in report["dags"]
        assert f"{broker}_orders_spark_pipeline" in report["dags"]
