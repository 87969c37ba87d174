"""
common-messaging integration: ``MessageQueueTrigger(scheme="shared+kafka", ...)`` builds our trigger.

The schemes are prefixed with ``shared+`` so they can never collide with the upstream providers'
``kafka``, ``sqs``, ``google+pubsub`` and ``azure+servicebus`` (a collision makes every Dag that
uses the scheme fail to parse). Trigger classes are imported lazily: no broker SDK is loaded.

The deprecated ``MessageQueueTrigger(queue=URI, ...)`` form is supported too. Each URI names the
stream's source; every other argument is passed as a keyword, exactly as with ``scheme=``:

====================  ============================================================  ==========================
provider              queue URI                                                     trigger arguments it sets
====================  ============================================================  ==========================
Kafka                 ``shared+kafka://[<kafka_config_id>]/<topic>[,<topic>...]``   ``topics`` (or the
                      (an empty path takes the ``topics=`` keyword, as upstream)    keyword),
                                                                                    ``kafka_config_id``
SQS                   ``shared+sqs+https://sqs.<region>.amazonaws.com/<acct>/<q>``  ``queue_url`` (the URI
                      (``shared+sqs+http://`` for a local endpoint)                 without ``shared+sqs+``)
Pub/Sub               ``shared+pubsub://<project>/<subscription>``                  ``subscription`` (full
                                                                                    path)
Service Bus           ``shared+servicebus://[<conn_id>]/<queue>`` or                ``queue_name`` or
                      ``shared+servicebus://[<conn_id>]/<topic>/subscriptions/<s>`` ``topic_name`` +
                                                                                    ``subscription_name``,
                                                                                    ``azure_service_bus_conn_id``
====================  ============================================================  ==========================

Each provider names its broker (``broker = "kafka"``); its ``scheme`` and trigger class come from the
broker registry (:mod:`airflow_shared_stream_provider.brokers`), whose ``queue_provider`` entry
points back at the class, so ``provider.yaml``'s ``queues`` list is written from the registry too. A
new broker's provider subclasses :class:`SharedStreamQueueProvider` in its own module.

An empty connection part keeps the trigger's default connection. A URI of our scheme that is
malformed, or that sets an argument also given as a keyword, raises
:class:`~airflow_shared_stream_provider.SharedStreamConfigError` at Dag parse time: it is
recognised (the prefix is ours), so "matched by no provider" would hide the actual mistake, and a
silent choice between the two values would read the wrong source.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import unquote, urlsplit

from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider.brokers import broker_spec

if TYPE_CHECKING:
    from airflow.triggers.base import BaseEventTrigger


class SharedStreamQueueProvider(BaseMessageQueueProvider):
    """
    The common-messaging provider of one registry broker: a subclass sets ``broker``,
    ``queue_prefixes`` and :meth:`parse_queue`; ``scheme`` and ``trigger_path`` are the registry's.
    """

    broker: ClassVar[str]
    trigger_path: ClassVar[str]
    # Every queue URI this provider accepts starts with one of these. They are disjoint across our
    # providers and from every upstream provider's (which never use a ``shared+`` scheme), so a
    # URI is matched by at most one provider: common-messaging refuses a URI matched by two.
    queue_prefixes: tuple[str, ...]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = broker_spec(cls.broker)  # KeyError at import for a broker not in the registry
        cls.scheme = spec.queue_scheme
        cls.trigger_path = spec.trigger_path

    def trigger_class(self) -> type[BaseEventTrigger]:
        # Airflow 3.3's import_string (re-exported without __all__, hence the attr-defined ignore).
        from airflow.sdk.module_loading import import_string  # type: ignore[attr-defined]

        return import_string(self.trigger_path)  # type: ignore[no-any-return]

    def queue_matches(self, queue: str) -> bool:
        return queue.startswith(self.queue_prefixes)

    def trigger_kwargs(self, queue: str, **kwargs: Any) -> dict[str, Any]:
        """
        The trigger arguments the URI names. common-messaging passes them *and* ``kwargs`` to the
        trigger (``cls(**trigger_kwargs, **kwargs)``), so a name in both is refused here with the
        argument's name instead of Python's bare "got multiple values for keyword argument".
        """
        if not self.queue_matches(queue):
            raise SharedStreamConfigError(f"{type(self).__name__} does not handle the queue URI {queue!r}")
        from_uri = self.parse_queue(queue, kwargs)
        twice = sorted(set(from_uri) & set(kwargs))
        if twice:
            raise SharedStreamConfigError(
                f"queue URI {queue!r} sets {', '.join(twice)}, which is also given as a keyword argument: give it once"
            )
        return from_uri

    @abstractmethod
    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The trigger arguments ``queue`` names; ``kwargs`` are the other ones (read, never changed)."""


def path_segments(queue: str, path: str) -> list[str]:
    """The URI path's segments, percent-decoded; an empty segment (``a//b``, a trailing ``/``) is refused."""
    segments = [unquote(segment) for segment in path.removeprefix("/").split("/")] if path not in ("", "/") else []
    if any(not segment for segment in segments):
        raise SharedStreamConfigError(f"queue URI {queue!r} has an empty path segment")
    return segments


class KafkaSharedStreamQueueProvider(SharedStreamQueueProvider):
    """``scheme="shared+kafka"`` -> :class:`~airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger`."""

    broker = "kafka"
    queue_prefixes = ("shared+kafka://",)

    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        parts = urlsplit(queue)
        segments = path_segments(queue, parts.path)
        if len(segments) > 1 or parts.query or parts.fragment or (not segments and "topics" not in kwargs):
            raise SharedStreamConfigError(
                f"queue URI {queue!r} is not shared+kafka://[<kafka_config_id>]/<topic>[,<topic>...] "
                "(the topics may instead be the topics= keyword)"
            )
        result: dict[str, Any] = {}
        if segments:
            topics = segments[0].split(",")
            if any(not topic for topic in topics):
                raise SharedStreamConfigError(f"queue URI {queue!r} has an empty topic name")
            result["topics"] = topics
        if parts.netloc:
            result["kafka_config_id"] = unquote(parts.netloc)
        return result


class SqsSharedStreamQueueProvider(SharedStreamQueueProvider):
    """``scheme="shared+sqs"`` -> :class:`~airflow_shared_stream_provider.triggers.sqs.SqsSharedStreamTrigger`."""

    broker = "sqs"
    queue_prefixes = ("shared+sqs+https://", "shared+sqs+http://")

    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        # The queue URL is kept byte for byte: it is part of the stream's key, and a sibling
        # declared with scheme= and the same queue_url must share the stream.
        queue_url = queue.removeprefix("shared+sqs+")
        parts = urlsplit(queue_url)
        if not parts.netloc or len(path_segments(queue, parts.path)) < 2 or parts.query or parts.fragment:
            raise SharedStreamConfigError(
                f"queue URI {queue!r} is not shared+sqs+<queue URL> (https://sqs.<region>.amazonaws.com/<account>/<queue>)"
            )
        return {"queue_url": queue_url}


class PubSubSharedStreamQueueProvider(SharedStreamQueueProvider):
    """``scheme="shared+pubsub"`` -> ``airflow_shared_stream_provider.triggers.pubsub.PubSubSharedStreamTrigger``."""

    broker = "pubsub"
    queue_prefixes = ("shared+pubsub://",)

    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        parts = urlsplit(queue)
        segments = path_segments(queue, parts.path)
        if not parts.netloc or len(segments) != 1 or parts.query or parts.fragment:
            raise SharedStreamConfigError(f"queue URI {queue!r} is not shared+pubsub://<project>/<subscription>")
        # The full path: the trigger checks it (and any project_id keyword) like a path given directly.
        return {"subscription": f"projects/{unquote(parts.netloc)}/subscriptions/{segments[0]}"}


class ServiceBusSharedStreamQueueProvider(SharedStreamQueueProvider):
    """``scheme="shared+servicebus"`` -> the Service Bus ``ServiceBusSharedStreamTrigger``."""

    broker = "servicebus"
    queue_prefixes = ("shared+servicebus://",)

    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        parts = urlsplit(queue)
        segments = path_segments(queue, parts.path)
        result: dict[str, Any]
        if len(segments) == 1:
            result = {"queue_name": segments[0]}
        elif len(segments) == 3 and segments[1].lower() == "subscriptions":
            # <topic>/Subscriptions/<subscription> is Service Bus's own entity path for a subscription.
            result = {"topic_name": segments[0], "subscription_name": segments[2]}
        else:
            result = {}
        if not result or parts.query or parts.fragment:
            raise SharedStreamConfigError(
                f"queue URI {queue!r} is not shared+servicebus://[<conn_id>]/<queue> "
                "or shared+servicebus://[<conn_id>]/<topic>/subscriptions/<subscription>"
            )
        if parts.netloc:
            result["azure_service_bus_conn_id"] = unquote(parts.netloc)
        return result
