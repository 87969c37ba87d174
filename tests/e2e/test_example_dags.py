"""Every example Dag file parses with no import error and loads no broker SDK (trigger modules import none)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from airflow_shared_stream_provider.brokers import BROKER_NAMES, sdk_module_prefixes
from devkit.demo import EXAMPLE_DAGS

# Every registry broker's SDK module prefixes (airflow_shared_stream_provider/brokers.py).
SDK_MODULES = sdk_module_prefixes()


def test_example_dags_parse_without_broker_sdks() -> None:
    # A fresh interpreter: the test session may already have imported SDKs.
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(EXAMPLE_DAGS)!r})
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(EXAMPLE_DAGS)!r})
        print(json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dag_ids),
                          "sdks": sorted(m for m in sys.modules if m.startswith({SDK_MODULES!r}))}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert report["sdks"] == []
    for broker in BROKER_NAMES:  # every registry broker ships the orders example Dags
        assert f"{broker}_orders_eu_consumer" in report["dags"]
        assert f"{broker}_orders_spark_pipeline" in report["dags"]


def test_latency_pair_dags_parse() -> None:
    """devkit/dags/kafka_latency_pair.py: the upstream provider's watcher and ours, one Dag each."""
    from devkit.production import LATENCY_PAIR, LATENCY_PAIR_FILE, pair_dag

    code = textwrap.dedent(
        f"""
        import json
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(LATENCY_PAIR_FILE)!r})
        print(json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dag_ids)}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert report["dags"] == sorted(pair_dag(asset) for asset in LATENCY_PAIR)
