"""
Azure Service Bus shared-stream trigger: many AssetWatchers, one peek-lock receiver.

Imports no Azure SDK: Dag files import this module. The receiver lives in
:mod:`airflow_shared_stream_provider.producers.servicebus`, loaded only in the triggerer.

Features: a queue or a topic subscription; PEEK_LOCK with prefetch and batch receive; a message is
completed only after every watcher's events are persisted; rejected and poison messages are
dead-lettered with a reason and description; locks of messages still being worked on are renewed
up to the triggerer's ack timeout. Session-enabled entities (``requiresSession``) with
``sessions=True``: up to ``max_concurrent_sessions`` sessions are accepted at once ("next
available session"), each read and settled in order on its own session receiver, and released
after ``session_idle_timeout`` seconds without messages so other sessions get a turn.

Connection (``azure_service_bus_conn_id``, the upstream ``azure_service_bus`` connection, read
directly): a connection string in the connection's *schema* field (or the ``connection_string``
extra; empty / ``"None"`` counts as unset), emulator strings with ``UseDevelopmentEmulator=true``
included; otherwise ``fully_qualified_namespace`` (extra) with ``DefaultAzureCredential``
(extras ``managed_identity_client_id`` / ``workload_identity_tenant_id`` are honoured).

Options (all part of the shared-stream key) and their defaults:

===========================  ===========  ==========================================================
option                       default      meaning
===========================  ===========  ==========================================================
``prefetch_count``           100          most messages the SDK buffers ahead of a receive call (locked);
                                         lowered to fit the byte budget (see below)
``max_message_count``        100          most messages one ``receive_messages`` call returns
``max_wait_time``            5.0          seconds a receive call waits for the first message
``renew_locks``              True         renew locks of messages (or sessions) still being worked on
``max_payload_bytes``        65536        cap of the event payload stored in the metadata DB
``oversize_policy``          dead_letter  ``dead_letter`` or ``truncate`` for larger messages
``max_delivery_attempts``    5            poison cap on ``delivery_count + 1`` (None = broker's own)
``max_in_flight``            10000        most messages received but not yet settled
``max_in_flight_bytes``      64 MiB       most bytes they hold (prefetch reserved in it)
``sessions``                 False        read a session-enabled entity (required for one)
``max_concurrent_sessions``  8            sessions held at once (``sessions=True`` only)
``session_idle_timeout``     2.0          seconds without messages before a session is released
===========================  ===========  ==========================================================

Example, two watchers and and a single peek-lock receiver (the triggers share their stream settings)::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger

    def orders_of(region: str) -> Asset:
        trigger = ServiceBusSharedStreamTrigger(queue_name="orders", match={"body.region": region})
        return Asset(f"{region}_orders", watchers=[AssetWatcher(name=f"{region}_orders", trigger=trigger)])

    eu_orders, us_orders = orders_of("eu"), orders_of("us")
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger, settings_arguments
from airflow_shared_stream_provider.brokers import BrokerName

DEFAULT_CONN_ID = "azure_service_bus_default"
DEFAULT_MAX_CONCURRENT_SESSIONS = 8
DEFAULT_SESSION_IDLE_TIMEOUT = 2.0
MAX_CONCURRENT_SESSIONS_LIMIT = 100
"""Each session is one AMQP connection (the SDK shares none between receivers): keep it bounded."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceBusStreamSettings(StreamSettings):
    """Everything :class:`~airflow_shared_stream_provider.producers.servicebus.ServiceBusSharedStreamProducer` reads."""

    broker: ClassVar[BrokerName] = BrokerName("servicebus")

    queue_name: str | None = None
    topic_name: str | None = None
    subscription_name: str | None = None
    azure_service_bus_conn_id: str = DEFAULT_CONN_ID
    prefetch_count: int = 100
    max_message_count: int = 100
    max_wait_time: float = 5.0
    renew_locks: bool = True
    sessions: bool = False
    max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS
    session_idle_timeout: float = DEFAULT_SESSION_IDLE_TIMEOUT

    def check(self) -> None:
        if self.queue_name is not None:
            if self.topic_name is not None or self.subscription_name is not None:
                raise SharedStreamConfigError(
                    "give either queue_name, or topic_name + subscription_name, not both "
                    f"(got queue_name={self.queue_name!r}, topic_name={self.topic_name!r}, "
                    f"subscription_name={self.subscription_name!r})"
                )
        elif self.topic_name is None and self.subscription_name is None:
            raise SharedStreamConfigError("give either queue_name, or topic_name + subscription_name")
        elif self.topic_name is None:
            raise SharedStreamConfigError(
                f"subscription_name={self.subscription_name!r} needs topic_name (the topic it belongs to)"
            )
        elif self.subscription_name is None:
            raise SharedStreamConfigError(
                f"topic_name={self.topic_name!r} needs subscription_name: a shared stream reads one "
                "subscription of a topic"
            )
        if isinstance(self.prefetch_count, bool) or not isinstance(self.prefetch_count, int):
            raise SharedStreamConfigError(f"prefetch_count must be an int, got {self.prefetch_count!r}")
        self.require_number("prefetch_count", self.prefetch_count, minimum=0, maximum=5000)
        if isinstance(self.max_message_count, bool) or not isinstance(self.max_message_count, int):
            raise SharedStreamConfigError(f"max_message_count must be an int, got {self.max_message_count!r}")
        self.require_number("max_message_count", self.max_message_count, minimum=1, maximum=5000)
        self.require_number("max_wait_time", self.max_wait_time, minimum=0.05, maximum=300)
        if not isinstance(self.renew_locks, bool):
            raise SharedStreamConfigError(f"renew_locks must be True or False, got {self.renew_locks!r}")
        self._validate_sessions()

    def _validate_sessions(self) -> None:
        if not isinstance(self.sessions, bool):
            raise SharedStreamConfigError(f"sessions must be True or False, got {self.sessions!r}")
        if isinstance(self.max_concurrent_sessions, bool) or not isinstance(self.max_concurrent_sessions, int):
            raise SharedStreamConfigError(
                f"max_concurrent_sessions must be an int, got {self.max_concurrent_sessions!r}"
            )
        self.require_number(
            "max_concurrent_sessions", self.max_concurrent_sessions, minimum=1, maximum=MAX_CONCURRENT_SESSIONS_LIMIT
        )
        self.require_number("session_idle_timeout", self.session_idle_timeout, minimum=0.1, maximum=3600)
        if not self.sessions:
            # Session options without sessions=True are a mistake (and would split the stream key).
            for name, default in (
                ("max_concurrent_sessions", DEFAULT_MAX_CONCURRENT_SESSIONS),
                ("session_idle_timeout", DEFAULT_SESSION_IDLE_TIMEOUT),
            ):
                if getattr(self, name) != default:
                    raise SharedStreamConfigError(
                        f"{name}={getattr(self, name)!r} only applies to session-enabled entities: "
                        "set sessions=True as well"
                    )

    @property
    def entity_path(self) -> str:
        """``queue`` or ``topic/Subscriptions/subscription`` (the address the receiver attaches to)."""
        if self.queue_name is not None:
            return self.queue_name
        return f"{self.topic_name}/Subscriptions/{self.subscription_name}"


class ServiceBusSharedStreamTrigger(SharedStreamTrigger):
    """
    Fire asset events from an Azure Service Bus queue or topic subscription through one receiver.

    Watchers whose producer settings are equal share one client and one peek-lock receiver in the
    triggerer; each applies its own ``match`` / ``filter_function``. A message is completed only
    after every watcher's events for it are persisted in the metadata DB, dead-lettered when a
    watcher rejected it, abandoned (redelivered) when a watcher failed it. See
    ``docs/servicebus.md`` for the guarantees and the failure matrix.

    Give exactly one of ``queue_name`` or ``topic_name`` + ``subscription_name``.

    :param queue_name: queue to read.
    :param topic_name: topic whose subscription to read (with ``subscription_name``).
    :param subscription_name: subscription of ``topic_name`` to read.
    :param azure_service_bus_conn_id: Airflow connection of the upstream ``azure_service_bus``
        shape: connection string in *schema* (or extra ``connection_string``), or extra
        ``fully_qualified_namespace`` with ``DefaultAzureCredential``.

    Also takes the options every shared-stream trigger takes (``match``, ``filter_function``,
    ``on_filter_error``, ``flush_after``, ``max_payload_bytes``, ``oversize_policy``,
    ``max_in_flight``, ``max_in_flight_bytes``, ``batch_size``, ``batch_timeout``; see
    :class:`~airflow_shared_stream_provider._core.trigger.SharedStreamOptions`) and:

    :param max_delivery_attempts: poison cap: a failed message whose ``delivery_count + 1`` reached
        it is dead-lettered instead of abandoned (default 5; None leaves it to the entity's
        ``MaxDeliveryCount``).
    :param prefetch_count: most messages the SDK receives ahead of a call (default 100; 0 = none).
        They are locked while buffered: keep it well below what the group handles in one lock
        duration. It is an upper limit: the producer lowers it so that the SDK buffers of all its
        receivers (one, or ``max_concurrent_sessions``), full of messages of the entity's maximum
        size (as the broker announces it on the link; 100 MB when it announces none), fit half of
        ``max_in_flight_bytes``: ``min(prefetch_count, (max_in_flight_bytes // 2) // (receivers x
        held size of a maximum-size message))``, the held size being the body, the envelope's copy
        (up to ``max_payload_bytes``) and 1 KiB. Decided once, when the first receiver attaches (the
        receiver is then re-created before its first receive, holding nothing), and logged at INFO
        when lowered. Default budget: 100 on a Standard entity (256 KiB), 7 for 4 MiB, 0 for
        100 MB entities.
    :param max_message_count: most messages one receive call returns (default 100).
    :param max_wait_time: seconds one receive call waits for a first message (default 5.0).
    :param renew_locks: renew the locks of messages watchers still work on, up to the triggerer's
        ack timeout (default True); with ``sessions=True``, the session locks held.
    :param sessions: the entity is session-enabled (``requiresSession``): accept sessions ("next
        available session") and read each on its own session receiver, in order (default False;
        a session-enabled entity cannot be read without it). See "Sessions" in
        ``docs/servicebus.md`` for the ordering guarantee.
    :param max_concurrent_sessions: most sessions held at once (default 8; each is one AMQP
        connection). ``prefetch_count`` applies per session.
    :param session_idle_timeout: seconds a held session may go without a new message, everything
        from it settled, before it is released so another session gets a turn (default 2.0).
    """

    settings_class = ServiceBusStreamSettings
    producer_class_path = "airflow_shared_stream_provider.producers.servicebus.ServiceBusSharedStreamProducer"
    settings: ServiceBusStreamSettings

    def __init__(
        self,
        *,
        queue_name: str | None = None,
        topic_name: str | None = None,
        subscription_name: str | None = None,
        azure_service_bus_conn_id: str = DEFAULT_CONN_ID,
        prefetch_count: int = 100,
        max_message_count: int = 100,
        max_wait_time: float = 5.0,
        renew_locks: bool = True,
        sessions: bool = False,
        max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS,
        session_idle_timeout: float = DEFAULT_SESSION_IDLE_TIMEOUT,
        **options: Unpack[SharedStreamOptions],
    ) -> None:
        super().__init__(**settings_arguments(self.settings_class, locals()))
