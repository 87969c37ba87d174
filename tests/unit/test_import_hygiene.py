"""Dag files import trigger modules: they must load no broker SDK (checked in a fresh process)."""

from __future__ import annotations

import subprocess
import sys

SDK_PREFIXES = ("aiokafka", "aiobotocore", "botocore", "google.cloud.pubsub", "google.pubsub", "azure.servicebus")
TRIGGER_MODULES = [
    "airflow_shared_stream_provider",
    "airflow_shared_stream_provider.queues",
    "airflow_shared_stream_provider.triggers.kafka",
    "airflow_shared_stream_provider.triggers.sqs",
    "airflow_shared_stream_provider.triggers.pubsub",
    "airflow_shared_stream_provider.triggers.servicebus",
]


def test_trigger_modules_import_no_broker_sdk() -> None:
    code = (
        "import sys, importlib\n"
        f"for m in {TRIGGER_MODULES!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({SDK_PREFIXES!r}))\n"
        "print('SDK_MODULES=' + ','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("SDK_MODULES=")]
    assert line == "SDK_MODULES=", f"broker SDKs loaded by trigger modules: {line}"


def test_a_missing_sdk_gives_the_install_hint() -> None:
    code = (
        "import sys\n"
        "sys.modules['aiokafka'] = None\n"
        "try:\n"
        "    import airflow_shared_stream_provider.producers.kafka\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert "pip install 'airflow-shared-stream-provider[kafka]'" in result.stdout
