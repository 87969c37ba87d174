"""Every example Dag file parses with no import error and loads no broker SDK (trigger modules import none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert report["sdks"] == []
    for broker in BROKER_NAMES:  # every registry broker ships the orders example Dags
        assert f"{broker}_orders_eu_consumer" in report["dags"]
        assert f"{broker}_orders_spark_pipeline" in report["dags"]


def test_devkit_dags_parse_and_join_the_example_stream(tmp_path: Path) -> None:
    """
    devkit/dags (the latency pair, the extra watchers), in a Dags folder as the production topology
    builds it: every Dag parses, and the 6 extra watchers join the example Kafka stream (one shared
    stream key with its 4 watchers: issue 23's "10 watchers" is one consumer, not two) as 10
    distinct triggers (Airflow merges watchers whose triggers serialize the same into one trigger
    row: one subscriber), each with the region filter devkit.production expects of it; the latency
    pair's own watcher is a stream of its own.
    """
    from devkit.demo import build_dags_folder
    from devkit.demo_types import KAFKA_DAG_FILES, WATCHERS
    from devkit.production import (
        LATENCY_PAIR,
        LATENCY_PAIR_FILE,
        LIGHT_CONSUMER_FILE,
        MORE_WATCHERS_FILE,
        OURS_N1_ASSET,
        more_watchers,
        pair_dag,
    )

    folder = build_dags_folder(
        tmp_path, files=KAFKA_DAG_FILES, extra=(LATENCY_PAIR_FILE, MORE_WATCHERS_FILE, LIGHT_CONSUMER_FILE)
    )
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(folder)!r})
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(folder)!r})
        keys = {{}}
        def assets(condition):  # an asset, or an AssetAll / AssetAny of them
            return [a for c in getattr(condition, "objects", ()) for a in assets(c)] or [condition]
        for dag in bag.dags.values():
            for asset in assets(dag.timetable.asset_condition):
                for watcher in getattr(asset, "watchers", ()):
                    key = getattr(watcher.trigger, "shared_stream_key", lambda: None)()
                    keys[watcher.name] = [repr(key), repr(watcher.trigger.serialize())]
        print(json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dag_ids), "keys": keys}}))
        """
    )
    env = {**os.environ, "ORDERS_MORE_WATCHERS": "6", "ORDERS_BATCH_SIZE": "50"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    extra = more_watchers(6)
    assert set(report["dags"]) >= {pair_dag(asset) for asset in (*LATENCY_PAIR, *extra)}
    keys = {name: key for name, (key, _) in report["keys"].items()}
    triggers = {name: trigger for name, (_, trigger) in report["keys"].items()}
    stream = (*extra, *WATCHERS)
    assert {keys[name] for name in stream} == {keys["kafka_orders_eu"]} != {"None"}
    assert len({triggers[name] for name in stream}) == len(stream) == 10
    for name, role in extra.items():
        assert f"'match': {{'body.region': {list(role.regions)!r}}}" in triggers[name]
    assert keys[OURS_N1_ASSET] != keys["kafka_orders_eu"]
