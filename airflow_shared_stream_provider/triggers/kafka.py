"""
Kafka shared-stream trigger: many AssetWatchers, one aiokafka consumer.

Imports no Kafka client: Dag files import this module. The consumer lives in
:mod:`airflow_shared_stream_provider.producers.kafka`, loaded only in the triggerer.

Example, two watchers and one aiokafka consumer between them (the triggers share their stream settings)::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

    def orders_of(region: str) -> Asset:
        trigger = KafkaSharedStreamTrigger(topics=["orders"], dlq_topic="orders.dlq", match={"body.region": region})
        return Asset(f"{region}_orders", watchers=[AssetWatcher(name=f"{region}_orders", trigger=trigger)])

    eu_orders, us_orders = orders_of("eu"), orders_of("us")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger, settings_arguments
from airflow_shared_stream_provider.brokers import BrokerName

PartialAssignmentPolicy = Literal["fail", "warn"]
PositionStore = Literal["watchers", "group"]
POSITION_STORES: tuple[PositionStore, ...] = ("watchers", "group")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KafkaStreamSettings(StreamSettings):
    """Everything :class:`~airflow_shared_stream_provider.producers.kafka.KafkaSharedStreamProducer` reads."""

    broker: ClassVar[BrokerName] = BrokerName("kafka")

    topics: tuple[str, ...]
    kafka_config_id: str = "kafka_default"
    group_id: str | None = None
    dlq_topic: str | None = None
    poll_timeout: float = 1.0
    max_batch_size: int = 500
    on_partial_assignment: PartialAssignmentPolicy = "fail"
    partial_assignment_grace: float = 30.0
    hold_backoff: float = 1.0
    position_store: PositionStore = "watchers"

    def check(self) -> None:
        if isinstance(self.topics, str) or not self.topics:
            raise SharedStreamConfigError(f"topics must be a non-empty list of topic names, got {self.topics!r}")
        for topic in self.topics:
            self.require_text("topics[]", topic)
        if self.dlq_topic in self.topics:
            raise SharedStreamConfigError(f"dlq_topic {self.dlq_topic!r} must not be one of the watched topics")
        self.require_number("poll_timeout", self.poll_timeout, minimum=0.01, maximum=60)
        self.require_number("max_batch_size", self.max_batch_size, minimum=1, maximum=100_000)
        self.require_number("partial_assignment_grace", self.partial_assignment_grace, minimum=0)
        self.require_number("hold_backoff", self.hold_backoff, minimum=0)
        if self.position_store not in POSITION_STORES:
            raise SharedStreamConfigError(
                f"position_store must be one of {POSITION_STORES}, got {self.position_store!r}"
            )
        if self.on_partial_assignment not in ("fail", "warn"):
            raise SharedStreamConfigError(
                f"on_partial_assignment must be 'fail' or 'warn', got {self.on_partial_assignment!r}"
            )

    def position_scope(self) -> Hashable | None:
        """
        ``position_store="watchers"``: positions are offsets of these topics, as read through this
        connection (the group only matters for the committed offsets, the fallback).
        """
        if self.position_store != "watchers":
            return None
        return ("kafka", self.kafka_config_id, self.topics, self.group_id)

    def effective_group_id(self) -> str:
        """``group_id`` if set, else the derived group (used when the connection has no ``group.id``)."""
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
    :param group_id: consumer group. Precedence: this ``group_id``, else the connection's
        ``group.id`` (the one the upstream Kafka provider requires, so a migrated stream keeps its
        group and committed offsets), else ``airflow-shared-stream.<conn>.<topics>``. The
        connection's value is read when the stream opens in the triggerer: changing it takes
        effect when the stream restarts (e.g. a triggerer restart). Two streams of one triggerer
        that resolve to one group on overlapping topics fail with ``SharedStreamConfigError``.
    :param dlq_topic: topic that receives rejected and poison messages (original key, value and
        headers plus ``x-dead-letter-*`` headers). Without it they are committed past and logged
        with their coordinates (they stay in the source topic until retention).

    Also takes the options every shared-stream trigger takes (``match``, ``filter_function``,
    ``on_filter_error``, ``flush_after``, ``max_payload_bytes``, ``oversize_policy``,
    ``max_in_flight``, ``max_in_flight_bytes``, ``batch_size``, ``batch_timeout``; see
    :class:`~airflow_shared_stream_provider._core.trigger.SharedStreamOptions`) and:

    :param max_delivery_attempts: poison cap, counted per consumer session (default 5, None = off).
    :param poll_timeout: seconds one fetch waits for data (default 1.0).
    :param max_batch_size: most records per fetch (default 500).
    :param on_partial_assignment: ``position_store="group"`` only: ``fail`` (default) or ``warn``
        when the group gives this consumer only some partitions of a topic (siblings on several
        triggerers sharing one group).
    :param partial_assignment_grace: seconds a partial assignment may last (rebalances) before it
        counts (default 30).
    :param hold_backoff: seconds before a held (zero-watcher) message is read again (default 1).
    :param position_store: where each watcher's progress lives. ``"watchers"`` (default): the
        stream reads every partition itself (no partition split between triggerers, no rebalances)
        and each watcher's position is kept in its asset's state store, so a watcher that moves to
        another triggerer's running stream replays from its own position, and its siblings skip
        what they already fired; offsets are still committed to the group (lag monitoring, and the
        start of a watcher without a position). ``"group"``: the previous behaviour, the group's
        committed offsets only, partitions assigned by the group (several triggerers split them:
        see ``on_partial_assignment``). See docs/kafka.md, "Several triggerers".
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
        poll_timeout: float = 1.0,
        max_batch_size: int = 500,
        on_partial_assignment: PartialAssignmentPolicy = "fail",
        partial_assignment_grace: float = 30.0,
        hold_backoff: float = 1.0,
        position_store: PositionStore = "watchers",
        **options: Unpack[SharedStreamOptions],
    ) -> None:
        if isinstance(topics, str):
            raise SharedStreamConfigError(f"topics must be a list of topic names, got the string {topics!r}")
        topics = tuple(sorted(set(topics)))  # one spelling per stream
        super().__init__(**settings_arguments(self.settings_class, locals()))
