"""
Kafka shared-stream trigger: many AssetWatchers, one aiokafka consumer.

Imports no Kafka client: Dag files import this module. The consumer lives in
:mod:`airflow_shared_stream_provider.producers.kafka`, loaded only in the triggerer.

Example::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

    eu_orders = Asset(
        "eu_orders",
        watchers=[
            AssetWatcher(
                name="eu_orders_watcher",
                trigger=KafkaSharedStreamTrigger(
                    topics=["orders"], dlq_topic="orders.dlq", match={"body.region": "eu"}
                ),
            )
        ],
    )
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from airflow_shared_stream_provider._core.dispositions import DEFAULT_MAX_DELIVERY_ATTEMPTS
from airflow_shared_stream_provider._core.envelope import DEFAULT_MAX_PAYLOAD_BYTES, OversizePolicy
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.filtering import FilterErrorPolicy
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger

PartialAssignmentPolicy = Literal["fail", "warn"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KafkaStreamSettings(StreamSettings):
    """Everything :class:`~airflow_shared_stream_provider.producers.kafka.KafkaSharedStreamProducer` reads."""

    broker: ClassVar[Literal["kafka"]] = "kafka"

    topics: tuple[str, ...]
    kafka_config_id: str = "kafka_default"
    group_id: str | None = None
    dlq_topic: str | None = None
    poll_timeout: float = 1.0
    max_batch_size: int = 500
    on_partial_assignment: PartialAssignmentPolicy = "fail"
    partial_assignment_grace: float = 30.0
    hold_backoff: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.topics, str) or not self.topics:
            raise SharedStreamConfigError(f"topics must be a non-empty list of topic names, got {self.topics!r}")
        for topic in self.topics:
            self.require_text("topics[]", topic)
        self.require_text("kafka_config_id", self.kafka_config_id)
        self.require_text("group_id", self.group_id, allow_none=True)
        self.require_text("dlq_topic", self.dlq_topic, allow_none=True)
        if self.dlq_topic in self.topics:
            raise SharedStreamConfigError(f"dlq_topic {self.dlq_topic!r} must not be one of the watched topics")
        self.require_number("poll_timeout", self.poll_timeout, minimum=0.01, maximum=60)
        self.require_number("max_batch_size", self.max_batch_size, minimum=1, maximum=100_000)
        self.require_number("partial_assignment_grace", self.partial_assignment_grace, minimum=0)
        self.require_number("hold_backoff", self.hold_backoff, minimum=0)
        if self.on_partial_assignment not in ("fail", "warn"):
            raise SharedStreamConfigError(
                f"on_partial_assignment must be 'fail' or 'warn', got {self.on_partial_assignment!r}"
            )

    def effective_group_id(self) -> str:
        """The consumer group: ``group_id`` if set, else one derived from connection and topics."""
        if self.group_id:
            return self.group_id
        return f"airflow-shared-stream.{self.kafka_config_id}.{'+'.join(self.topics)}"


class KafkaSharedStreamTrigger(SharedStreamTrigger):
    """
    Fire asset events from Kafka topics through one shared consumer per stream.

    Watchers whose producer settings are equal share one consumer (one consumer group member) in
    the triggerer; each applies its own ``match`` / ``filter_function``. Offsets are committed
    only after every watcher's events for a message are persisted in the metadata DB. See
    ``docs/kafka.md`` for the guarantees and the failure matrix.

    :param topics: topics to read (order does not matter).
    :param kafka_config_id: Airflow connection of the upstream Kafka provider's shape (extras in
        librdkafka style: ``bootstrap.servers``, ``security.protocol``, ``sasl.*``, ``ssl.*``...).
    :param group_id: consumer group; default ``airflow-shared-stream.<conn>.<topics>``. Overrides
        the connection's ``group.id``.
    :param dlq_topic: topic that receives rejected and poison messages (original key, value and
        headers plus ``x-dead-letter-*`` headers). Without it they are committed past and logged
        with their coordinates (they stay in the source topic until retention).
    :param match: per-watcher filter on envelope paths, e.g. ``{"body.region": ["eu", "uk"]}``.
    :param filter_function: dotted path of ``f(envelope) -> bool`` (may raise ``RejectMessage``).
    :param on_filter_error: what a filter exception does: ``reject`` (default), ``skip``, ``fail``.
    :param max_payload_bytes: cap of the event payload stored in the metadata DB (default 65536).
    :param oversize_policy: ``dead_letter`` (default) or ``truncate`` for larger messages.
    :param max_delivery_attempts: poison cap, counted per consumer session (default 5, None = off).
    :param max_in_flight: most messages yielded but not yet committed (default 10000).
    :param poll_timeout: seconds one fetch waits for data (default 1.0).
    :param max_batch_size: most records per fetch (default 500).
    :param on_partial_assignment: ``fail`` (default) or ``warn`` when the group gives this consumer
        only some partitions of a topic (siblings on several triggerers sharing one group).
    :param partial_assignment_grace: seconds a partial assignment may last (rebalances) before it
        counts (default 30).
    :param hold_backoff: seconds before a held (zero-watcher) message is read again (default 1).
    """

    settings_class = KafkaStreamSettings
    producer_class_path = "airflow_shared_stream_provider.producers.kafka.KafkaSharedStreamProducer"
    settings: KafkaStreamSettings

    def __init__(
        self,
        *,
        topics: Sequence[str],
        kafka_config_id: str = "kafka_default",
        group_id: str | None = None,
        dlq_topic: str | None = None,
        match: Mapping[str, Any] | None = None,
        filter_function: str | None = None,
        on_filter_error: FilterErrorPolicy = "reject",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        oversize_policy: OversizePolicy = "dead_letter",
        max_delivery_attempts: int | None = DEFAULT_MAX_DELIVERY_ATTEMPTS,
        max_in_flight: int = 10_000,
        poll_timeout: float = 1.0,
        max_batch_size: int = 500,
        on_partial_assignment: PartialAssignmentPolicy = "fail",
        partial_assignment_grace: float = 30.0,
        hold_backoff: float = 1.0,
    ) -> None:
        if isinstance(topics, str):
            raise SharedStreamConfigError(f"topics must be a list of topic names, got the string {topics!r}")
        settings = KafkaStreamSettings(
            topics=tuple(sorted(set(topics))),
            kafka_config_id=kafka_config_id,
            group_id=group_id,
            dlq_topic=dlq_topic,
            max_payload_bytes=max_payload_bytes,
            oversize_policy=oversize_policy,
            max_delivery_attempts=max_delivery_attempts,
            max_in_flight=max_in_flight,
            poll_timeout=poll_timeout,
            max_batch_size=max_batch_size,
            on_partial_assignment=on_partial_assignment,
            partial_assignment_grace=partial_assignment_grace,
            hold_backoff=hold_backoff,
        )
        super().__init__(
            settings=settings, match=match, filter_function=filter_function, on_filter_error=on_filter_error
        )
