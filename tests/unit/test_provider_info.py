"""The provider as Airflow sees it: metadata, entry point, common-messaging schemes."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import yaml

from airflow_shared_stream_provider.get_provider_info import get_provider_info

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_CONNECTION_TYPES = {"kafka", "aws", "google_cloud_platform", "azure_service_bus"}
UPSTREAM_SCHEMES = {"kafka", "sqs", "google+pubsub", "azure+servicebus", "redis+pubsub"}


def test_get_provider_info_is_provider_yaml() -> None:
    assert get_provider_info() == yaml.safe_load((ROOT / "provider.yaml").read_text())


def test_the_entry_point_is_registered() -> None:
    [entry] = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_shared_stream")]
    assert entry.load() is get_provider_info


def test_no_upstream_connection_type_is_declared() -> None:
    info = get_provider_info()
    declared = {c.get("connection-type") for c in info.get("connection-types", [])}
    assert not declared & UPSTREAM_CONNECTION_TYPES
    assert "hook-class-names" not in info


def test_every_declared_module_and_class_imports() -> None:
    import importlib

    info = get_provider_info()
    for trigger in info["triggers"]:
        for module in trigger["python-modules"]:
            importlib.import_module(module)
    schemes = set()
    for path in info["queues"]:
        module_name, _, name = path.rpartition(".")
        provider = getattr(importlib.import_module(module_name), name)()
        assert provider.trigger_class().__name__.endswith("SharedStreamTrigger")
        schemes.add(provider.scheme)
    assert schemes == {"shared+kafka", "shared+sqs", "shared+pubsub", "shared+servicebus"}
    assert not schemes & UPSTREAM_SCHEMES


def test_airflow_lists_the_provider_and_its_triggers() -> None:
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-shared-stream-provider" in manager.providers
    manager.initialize_providers_queues()
    assert "airflow_shared_stream_provider.queues.KafkaSharedStreamQueueProvider" in manager.queue_class_names
    trigger_modules = {t.package_name for t in manager.trigger}
    assert "airflow-shared-stream-provider" in trigger_modules


def test_message_queue_trigger_builds_and_serializes_our_trigger_with_the_same_key() -> None:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

    generic = MessageQueueTrigger(scheme="shared+kafka", topics=["orders"], match={"body.region": "eu"})
    classpath, kwargs = generic.serialize()
    assert classpath == "airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger"
    rebuilt = KafkaSharedStreamTrigger(**kwargs)
    direct = KafkaSharedStreamTrigger(topics=["orders"])
    assert rebuilt.shared_stream_key() == direct.shared_stream_key()
    assert rebuilt.match == {"body.region": "eu"}
