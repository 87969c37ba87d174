"""
Google Pub/Sub shared-stream trigger: many AssetWatchers, one subscriber client.

Imports no Google library: Dag files import this module. The client lives in
:mod:`airflow_shared_stream_provider.producers.pubsub`, loaded only in the triggerer.

Example, two watchers and one subscriber client pulling for both (the triggers share their stream settings)::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger

    def orders_of(region: str) -> Asset:
        trigger = PubSubSharedStreamTrigger(
            subscription="projects/my-project/subscriptions/orders-airflow",
            dead_letter_topic="orders-dead-letter",
            match={"attributes.region": region},
        )
        return Asset(f"{region}_orders", watchers=[AssetWatcher(name=f"{region}_orders", trigger=trigger)])

    eu_orders, us_orders = orders_of("eu"), orders_of("us")

See ``docs/pubsub.md`` for the connection, every option with its default, the guarantees and the
failure matrix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, ClassVar, Final

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger, settings_arguments
from airflow_shared_stream_provider.brokers import BrokerName

DEFAULT_MAX_MESSAGES: Final = 100
DEFAULT_PULL_TIMEOUT: Final = 5.0
DEFAULT_ACK_DEADLINE_SECONDS: Final = 60
DEFAULT_ACK_FLUSH_INTERVAL: Final = 0.05

# Resource names as Pub/Sub defines them: 3-255 characters, starting with a letter, letters,
# digits and ``-_.~+%``, never starting with ``goog``.
_RESOURCE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
# Project ids: 6-30 lowercase letters, digits and hyphens (the emulator accepts any text).
_PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-.:]*")
_SUBSCRIPTION_PATH = re.compile(r"projects/(?P<project>[^/]+)/subscriptions/(?P<name>[^/]+)")
_TOPIC_PATH = re.compile(r"projects/(?P<project>[^/]+)/topics/(?P<name>[^/]+)")


def _check_name(kind: str, name: str) -> None:
    if not _RESOURCE_NAME.fullmatch(name) or name.startswith("goog"):
        raise SharedStreamConfigError(
            f"{kind} name {name!r} is not a valid Pub/Sub name (3-255 characters: a letter first, then "
            "letters, digits or -_.~+%, not starting with 'goog')"
        )


def _check_project(field: str, project: str) -> None:
    if not _PROJECT.fullmatch(project):
        raise SharedStreamConfigError(f"{field} {project!r} is not a valid Google Cloud project id")


def _split_path(field: str, value: str, pattern: re.Pattern[str], shape: str) -> tuple[str | None, str]:
    """``(project or None, short name)`` of a short name or a full ``projects/P/<kind>/N`` path."""
    if "/" not in value:
        _check_name(field, value)
        return None, value
    found = pattern.fullmatch(value)
    if found is None:
        raise SharedStreamConfigError(f"{field} {value!r} must be a short name or {shape!r}")
    _check_project(f"{field} project", found["project"])
    _check_name(field, found["name"])
    return found["project"], found["name"]


def split_subscription(subscription: str) -> tuple[str | None, str]:
    return _split_path("subscription", subscription, _SUBSCRIPTION_PATH, "projects/<project>/subscriptions/<name>")


def split_topic(topic: str) -> tuple[str | None, str]:
    return _split_path("dead_letter_topic", topic, _TOPIC_PATH, "projects/<project>/topics/<name>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PubSubStreamSettings(StreamSettings):
    """
    Everything :class:`~airflow_shared_stream_provider.producers.pubsub.PubSubSharedStreamProducer` reads.

    ``subscription`` is stored as a full path whenever the project is known at parse time (from the
    path itself or ``project_id``), so ``"orders"`` + ``project_id="p"`` and
    ``"projects/p/subscriptions/orders"`` share one stream. A short name without ``project_id`` is
    resolved in the triggerer against the connection's project (then ADC's).
    """

    broker: ClassVar[BrokerName] = BrokerName("pubsub")

    subscription: str
    project_id: str | None = None
    gcp_conn_id: str = "google_cloud_default"
    dead_letter_topic: str | None = None
    max_messages: int = DEFAULT_MAX_MESSAGES
    pull_timeout: float = DEFAULT_PULL_TIMEOUT
    ack_deadline_seconds: int = DEFAULT_ACK_DEADLINE_SECONDS
    ack_flush_interval: float = DEFAULT_ACK_FLUSH_INTERVAL

    def check(self) -> None:
        path_project, _ = split_subscription(self.subscription)
        if self.project_id is not None:
            _check_project("project_id", self.project_id)
            if path_project is not None and path_project != self.project_id:
                raise SharedStreamConfigError(
                    f"subscription {self.subscription!r} is in project {path_project!r} "
                    f"but project_id is {self.project_id!r}"
                )
        if self.dead_letter_topic is not None:
            split_topic(self.dead_letter_topic)
        if isinstance(self.max_messages, bool) or not isinstance(self.max_messages, int):
            raise SharedStreamConfigError(f"max_messages must be an int, got {self.max_messages!r}")
        self.require_number("max_messages", self.max_messages, minimum=1, maximum=1000)
        self.require_number("pull_timeout", self.pull_timeout, minimum=0.1, maximum=60)
        if isinstance(self.ack_deadline_seconds, bool) or not isinstance(self.ack_deadline_seconds, int):
            raise SharedStreamConfigError(f"ack_deadline_seconds must be an int, got {self.ack_deadline_seconds!r}")
        self.require_number("ack_deadline_seconds", self.ack_deadline_seconds, minimum=10, maximum=600)
        self.require_number("ack_flush_interval", self.ack_flush_interval, minimum=0, maximum=5)

    def subscription_path(self, default_project: str | None) -> str:
        """The full subscription path; ``default_project`` fills in a short name's project."""
        project, name = split_subscription(self.subscription)
        project = project or self.project_id or default_project
        if not project:
            raise SharedStreamConfigError(
                f"subscription {self.subscription!r} is a short name and no project is known: pass "
                f"project_id, a full 'projects/<project>/subscriptions/<name>' path, or set the 'project' "
                f"extra of connection {self.gcp_conn_id!r}"
            )
        return f"projects/{project}/subscriptions/{name}"

    def dead_letter_topic_path(self, subscription_path: str) -> str | None:
        """The full dead-letter topic path; a short name lives in the subscription's project."""
        if self.dead_letter_topic is None:
            return None
        project, name = split_topic(self.dead_letter_topic)
        if project is None:
            project = subscription_path.split("/")[1]
        return f"projects/{project}/topics/{name}"


class PubSubSharedStreamTrigger(SharedStreamTrigger):
    """
    Fire asset events from a Pub/Sub subscription through one shared subscriber per stream.

    Watchers whose producer settings are equal share one pull loop on one client in the
    triggerer; each applies its own ``match`` / ``filter_function``. A message is acknowledged
    only after every watcher's events for it are persisted in the metadata DB. See
    ``docs/pubsub.md`` for the guarantees and the failure matrix.

    :param subscription: short name (project from ``project_id``, else the connection's, else
        ADC's) or a full ``projects/<project>/subscriptions/<name>`` path.
    :param project_id: project of a short ``subscription`` name.
    :param gcp_conn_id: Airflow connection of the upstream ``google_cloud_platform`` shape (extras
        ``key_path``, ``keyfile_dict``, ``credential_config_file``, ``project``, ``scope``,
        ``impersonation_chain``; old ``extra__google_cloud_platform__`` prefixes accepted). A
        missing connection means Application Default Credentials. ``PUBSUB_EMULATOR_HOST`` wins
        over both (no credentials, insecure channel).
    :param dead_letter_topic: topic (short name in the subscription's project, or a full path)
        that receives rejected and poison messages: original data and attributes plus
        ``x-dead-letter-*`` attributes, then the original is acked. Without it such messages are
        nacked so the subscription's own dead-letter policy takes them.

    Also takes the options every shared-stream trigger takes (``match``, ``filter_function``,
    ``on_filter_error``, ``flush_after``, ``max_payload_bytes``, ``oversize_policy``,
    ``max_in_flight``, ``max_in_flight_bytes``, ``batch_size``, ``batch_timeout``; see
    :class:`~airflow_shared_stream_provider._core.trigger.SharedStreamOptions`) and:

    :param max_delivery_attempts: poison cap (default 5, None = off). Counted by Pub/Sub when the
        subscription has a dead-letter policy (``delivery_attempt``), else by this producer.
    :param max_messages: most messages per pull (default 100, at most 1000).
    :param pull_timeout: seconds one pull may wait for messages (default 5.0).
    :param ack_deadline_seconds: ack deadline requested each time the lease of a message still
        being worked on is extended (default 60, 10..600); extension stops at the ack timeout.
    :param ack_flush_interval: seconds acks / nacks are gathered into one batched call
        (default 0.05; 0 = flush as soon as the flusher runs).
    """

    settings_class = PubSubStreamSettings
    producer_class_path = "airflow_shared_stream_provider.producers.pubsub.PubSubSharedStreamProducer"
    settings: PubSubStreamSettings

    def __init__(
        self,
        *,
        subscription: str,
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        dead_letter_topic: str | None = None,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        pull_timeout: float = DEFAULT_PULL_TIMEOUT,
        ack_deadline_seconds: int = DEFAULT_ACK_DEADLINE_SECONDS,
        ack_flush_interval: float = DEFAULT_ACK_FLUSH_INTERVAL,
        **options: Unpack[SharedStreamOptions],
    ) -> None:
        # Checked here as well as in the settings: both are read (and folded) before those exist,
        # and an empty project_id must fail, not fall through as "no project given".
        self.settings_class.require_text("subscription", subscription)
        self.settings_class.require_text("project_id", project_id, allow_none=True)
        path_project, name = split_subscription(subscription)
        project = path_project or project_id
        if project is not None:
            _check_project("project_id", project)
            if path_project is not None and project_id is not None and path_project != project_id:
                raise SharedStreamConfigError(
                    f"subscription {subscription!r} is in project {path_project!r} but project_id is {project_id!r}"
                )
            # One spelling per stream: the full path, and project_id folded into it.
            subscription, project_id = f"projects/{project}/subscriptions/{name}", None
        if dead_letter_topic is not None and isinstance(dead_letter_topic, str) and project is not None:
            topic_project, topic_name = split_topic(dead_letter_topic)
            dead_letter_topic = f"projects/{topic_project or project}/topics/{topic_name}"
        super().__init__(**settings_arguments(self.settings_class, locals()))
