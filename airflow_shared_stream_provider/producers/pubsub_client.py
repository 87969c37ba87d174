"""
The Google side of the Pub/Sub producer (:mod:`.pubsub`): the connection and its credentials (read
by :mod:`.pubsub_connection`), the GAPIC clients, the subscription's own settings, and what an RPC
error means. What each outcome does on Pub/Sub (acks, nacks, leases, ordering keys, dead letters)
stays in :mod:`.pubsub`.

Connection (``gcp_conn_id``, the upstream ``google_cloud_platform`` shape, read directly by
:func:`load_connection`):

=========================== =======================================================================
extra                       use
=========================== =======================================================================
``keyfile_dict``            service-account JSON (text or dict)
``key_path``                path of a service-account JSON file
``credential_config_file``  external-account (workload identity federation) JSON file or dict
``project``                 project of a short subscription name
``scope``                   comma-separated OAuth scopes (default cloud-platform)
``impersonation_chain``     service account (or comma-separated / list chain) to impersonate
``is_anonymous``            anonymous credentials
=========================== =======================================================================

Each extra may carry the old ``extra__google_cloud_platform__`` prefix. A missing connection
means Application Default Credentials. ``key_secret_name`` (Secret Manager) is refused with an
error naming it. When ``PUBSUB_EMULATOR_HOST`` is set (as the client library does) the emulator is
used over an insecure channel with no credentials.

The clients (``google.pubsub_v1`` async GAPIC clients) are built inside the triggerer's event loop.
The subscription is read once (:func:`inspect_subscription`): it must exist, and its ack deadline,
exactly-once delivery and dead-letter policy shape the producer's leases and acks; without
permission to read it (not needed to consume) a 10 s ack deadline and exactly-once delivery are
assumed. One ``Pull`` (:func:`pull`) is retried while the server is briefly unavailable
(:data:`TRANSIENT`); :func:`ack_failures` reads an exactly-once subscription's per-ack-id failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from airflow_shared_stream_provider._core.envelope import iso_timestamp
from airflow_shared_stream_provider._core.errors import (
    BrokerUnavailableError,
    SharedStreamConfigError,
    broker_sdk,
)
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider.producers.pubsub_connection import GcpConnection, load_gcp_connection

with broker_sdk("pubsub"):
    import grpc
    from google.api_core import exceptions as gexc
    from google.api_core.retry import AsyncRetry, if_exception_type
    from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
    from google.pubsub_v1.services.publisher.transports.grpc_asyncio import PublisherGrpcAsyncIOTransport
    from google.pubsub_v1.services.subscriber.transports.grpc_asyncio import SubscriberGrpcAsyncIOTransport

DEFAULT_SUBSCRIPTION_DEADLINE: Final = 10
EOD_FAILURE_REASON: Final = "EXACTLY_ONCE_ACKID_FAILURE"
# Seconds the subscription check at start may take, retries included (google-api-core's default
# for GetSubscription is 60 s, after which its RetryError named neither subscription nor connection).
CONNECT_TIMEOUT: Final = 20.0
# Errors worth retrying for unary calls (the server is busy, restarting or briefly unreachable).
TRANSIENT: Final[tuple[type[Exception], ...]] = (
    gexc.ServiceUnavailable,
    gexc.InternalServerError,
    gexc.Aborted,
    gexc.DeadlineExceeded,
    gexc.ResourceExhausted,
    gexc.Unknown,
)

# What the subscription check raises when the endpoint never answered (retries exhausted included).
UNREACHABLE: Final[tuple[type[Exception], ...]] = (gexc.RetryError, *TRANSIENT)

load_connection: Final = load_gcp_connection
"""The subscription's ``google_cloud_platform`` connection and credentials (see :mod:`.pubsub_connection`)."""

# The one place the Google SDK is imported: the producer takes the clients' types and the API's
# exceptions (``gexc``) from here.
__all__ = [
    "DEFAULT_SUBSCRIPTION_DEADLINE",
    "TRANSIENT",
    "PublisherAsyncClient",
    "Pulled",
    "SubscriberAsyncClient",
    "SubscriptionInfo",
    "ack_failures",
    "gexc",
    "inspect_subscription",
    "load_connection",
    "publisher_client",
    "pull",
    "subscriber_client",
]


def _emulator_channel(host: str) -> grpc.aio.Channel:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    return grpc.aio.insecure_channel(host, options=options)


def subscriber_client(connection: GcpConnection) -> SubscriberAsyncClient:
    """The subscriber client: the emulator's insecure channel, else the connection's credentials."""
    if connection.emulator_host:
        return SubscriberAsyncClient(
            transport=SubscriberGrpcAsyncIOTransport(channel=_emulator_channel(connection.emulator_host))
        )
    return SubscriberAsyncClient(credentials=connection.credentials)


def publisher_client(connection: GcpConnection) -> PublisherAsyncClient:
    """The publisher client (dead letters), built like :func:`subscriber_client`."""
    if connection.emulator_host:
        return PublisherAsyncClient(
            transport=PublisherGrpcAsyncIOTransport(channel=_emulator_channel(connection.emulator_host))
        )
    return PublisherAsyncClient(credentials=connection.credentials)


@dataclass(frozen=True, slots=True)
class SubscriptionInfo:
    """What the producer needs to know of its subscription."""

    ack_deadline_seconds: int = DEFAULT_SUBSCRIPTION_DEADLINE
    exactly_once: bool = False
    has_dead_letter_policy: bool = False


async def inspect_subscription(
    client: SubscriberAsyncClient,
    path: str | None,
    *,
    dead_letter_topic: str | None,
    counters: StreamCounters,
    log: logging.Logger,
    where: str = "",
) -> SubscriptionInfo:
    """
    Check the subscription exists and learn its ack deadline, exactly-once and dead-letter policy.
    ``where`` (connection id and endpoint) goes into the errors. A ``dead_letter_topic`` that is
    the subscription's own topic is refused (a :class:`SharedStreamConfigError`): only the
    subscription knows its topic, so this is the one place the loop can be seen.

    An endpoint that does not answer within :data:`CONNECT_TIMEOUT` (google-api-core retries
    ``GetSubscription`` meanwhile) is a :class:`BrokerUnavailableError`: the group fails, the
    triggerer re-creates the triggers, nothing was received so nothing is lost.
    """
    try:
        subscription = await client.get_subscription(
            request={"subscription": path},
            retry=AsyncRetry(
                predicate=if_exception_type(*TRANSIENT), initial=0.5, maximum=4.0, timeout=CONNECT_TIMEOUT
            ),
            timeout=CONNECT_TIMEOUT / 2,
        )
    except UNREACHABLE as exc:
        error = BrokerUnavailableError(
            f"Pub/Sub subscription {path!r}: the endpoint did not answer within {CONNECT_TIMEOUT:.0f} s "
            f"({type(exc).__name__}: {exc}) ({where}); the stream resumes when the trigger is re-created "
            "and Pub/Sub answers again"
        )
        raise error from exc
    except gexc.NotFound:
        raise SharedStreamConfigError(f"Pub/Sub subscription {path!r} does not exist") from None
    except gexc.PermissionDenied:
        # pubsub.subscriptions.get is not needed to consume: assume the conservative defaults.
        log.warning(
            "No permission to read subscription %s; assuming a %ss ack deadline and exactly-once delivery%s",
            path,
            DEFAULT_SUBSCRIPTION_DEADLINE,
            ", and not checking that dead_letter_topic is not the topic it reads" if dead_letter_topic else "",
        )
        return SubscriptionInfo(exactly_once=True)
    counters.add("api_calls")
    if dead_letter_topic is not None and dead_letter_topic == subscription.topic:
        # Every dead letter would be published to the topic this subscription reads and come back
        # to it: a rejected message loops forever (the poison cap restarts with each new copy).
        raise SharedStreamConfigError(
            f"dead_letter_topic {dead_letter_topic!r} is the topic subscription {path!r} reads: every "
            "rejected message would be published back to it and rejected again, forever; use a separate "
            "dead-letter topic"
        )
    info = SubscriptionInfo(
        ack_deadline_seconds=subscription.ack_deadline_seconds or DEFAULT_SUBSCRIPTION_DEADLINE,
        exactly_once=bool(subscription.enable_exactly_once_delivery),
        has_dead_letter_policy=bool(subscription.dead_letter_policy.dead_letter_topic),
    )
    if dead_letter_topic is None and not info.has_dead_letter_policy:
        log.warning(
            "Subscription %s has no dead-letter policy and no dead_letter_topic is set: rejected and "
            "poison messages are nacked and redelivered until they expire",
            path,
        )
    return info


@dataclass(slots=True)
class Pulled:
    """One received message, copied out of the ``Pull`` response (see :func:`pull`)."""

    ack_id: str
    message_id: str
    ordering_key: str
    delivery_attempt: int
    attributes: dict[str, str]
    published_at: str | None
    data: bytes


def unpack(received: Sequence[Any]) -> list[Pulled]:
    """
    The messages of a ``Pull`` response as plain Python objects.

    Why copy at once: every message of a response lives in the response's one protobuf arena, and
    any field object still referenced (one ``ReceivedMessage`` held until its watchers are done)
    keeps the whole arena, every body of the pull, alive beside the ``bytes`` copies the stream
    holds. With 10 MB messages that doubled what the byte budget counts. Copied here, inside the
    pull's task, the arena is freed when the task returns, before the first message is yielded.
    """
    pulled = []
    for item in received:
        msg = item.message
        stamp = msg.publish_time
        pulled.append(
            Pulled(
                ack_id=item.ack_id,
                message_id=msg.message_id,
                ordering_key=msg.ordering_key,
                delivery_attempt=item.delivery_attempt,
                attributes=dict(msg.attributes),
                published_at=iso_timestamp(stamp.seconds + stamp.nanos / 1e9) if stamp.seconds else None,
                data=msg.data,
            )
        )
    return pulled


async def pull(
    client: SubscriberAsyncClient, path: str | None, max_messages: int, *, timeout: float, log: logging.Logger
) -> tuple[float, list[Pulled]]:
    """
    One ``Pull``, retried while the server is briefly unavailable: ``(monotonic start, the
    messages)``, empty when nothing arrived within ``timeout``.
    """
    backoff = 0.1
    while True:
        started = time.monotonic()
        try:
            response = await client.pull(
                request={"subscription": path, "max_messages": max_messages}, timeout=timeout, retry=None
            )
        except gexc.DeadlineExceeded:
            return started, []  # nothing arrived within pull_timeout
        except gexc.NotFound:
            raise SharedStreamConfigError(f"Pub/Sub subscription {path!r} does not exist") from None
        except gexc.PermissionDenied as exc:
            raise SharedStreamConfigError(f"no permission to pull from {path!r}: {exc.message}") from None
        except TRANSIENT as exc:
            log.warning("Pull from %s failed (%s); retrying in %.1fs", path, type(exc).__name__, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
            continue
        # The raw protobuf: proto-plus wrappers cost more per field than the rest of the fan-out.
        return started, unpack(type(response).pb(response).received_messages)


def ack_failures(exc: BaseException) -> dict[str, str] | None:
    """
    Per-ack-id failures of an exactly-once subscription's ``Acknowledge`` / ``ModifyAckDeadline``.

    Pub/Sub reports them as an ``ErrorInfo`` (reason ``EXACTLY_ONCE_ACKID_FAILURE``) whose metadata
    maps ack ids to ``PERMANENT_FAILURE_*`` / ``TRANSIENT_FAILURE_*``. ``None`` when the error does
    not carry such a map (a plain RPC error).
    """
    metadata = getattr(exc, "metadata", None)
    if getattr(exc, "reason", None) == EOD_FAILURE_REASON and isinstance(metadata, Mapping):
        return {str(k): str(v) for k, v in metadata.items()}
    for detail in getattr(exc, "details", None) or ():
        if getattr(detail, "reason", None) == EOD_FAILURE_REASON:
            return {str(k): str(v) for k, v in dict(detail.metadata).items()}
    return None
