"""
common-messaging integration: ``MessageQueueTrigger(scheme="shared+kafka", ...)`` builds our trigger.

The schemes are prefixed with ``shared+`` so they can never collide with the upstream providers'
``kafka``, ``sqs``, ``google+pubsub`` and ``azure+servicebus`` (a collision makes every Dag that
uses the scheme fail to parse). Trigger classes are imported lazily: no broker SDK is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

if TYPE_CHECKING:
    from airflow.triggers.base import BaseEventTrigger


class _SharedStreamQueueProvider(BaseMessageQueueProvider):
    trigger_path: str

    def trigger_class(self) -> type[BaseEventTrigger]:
        module_name, _, name = self.trigger_path.rpartition(".")
        return getattr(importlib.import_module(module_name), name)  # type: ignore[no-any-return]


class KafkaSharedStreamQueueProvider(_SharedStreamQueueProvider):
    """``scheme="shared+kafka"`` -> :class:`~airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger`."""

    scheme = "shared+kafka"
    trigger_path = "airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger"


class SqsSharedStreamQueueProvider(_SharedStreamQueueProvider):
    """``scheme="shared+sqs"`` -> :class:`~airflow_shared_stream_provider.triggers.sqs.SqsSharedStreamTrigger`."""

    scheme = "shared+sqs"
    trigger_path = "airflow_shared_stream_provider.triggers.sqs.SqsSharedStreamTrigger"


class PubSubSharedStreamQueueProvider(_SharedStreamQueueProvider):
    """``scheme="shared+pubsub"`` -> ``airflow_shared_stream_provider.triggers.pubsub.PubSubSharedStreamTrigger``."""

    scheme = "shared+pubsub"
    trigger_path = "airflow_shared_stream_provider.triggers.pubsub.PubSubSharedStreamTrigger"


class ServiceBusSharedStreamQueueProvider(_SharedStreamQueueProvider):
    """``scheme="shared+servicebus"`` -> the Service Bus ``ServiceBusSharedStreamTrigger``."""

    scheme = "shared+servicebus"
    trigger_path = "airflow_shared_stream_provider.triggers.servicebus.ServiceBusSharedStreamTrigger"
