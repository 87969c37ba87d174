"""
What the Service Bus producer (:mod:`.servicebus`) and its session receivers
(:mod:`.servicebus_sessions`) share: the azure-servicebus SDK (imported here once, with the install
hint), the broker payload of one message and how a received message reads as an envelope, the
counters, the lock arithmetic and the one receive call.

Both modules import this one and it imports neither, so they do not import each other in a circle:
``servicebus`` -> ``servicebus_sessions`` -> ``servicebus_types``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final, Protocol

from airflow_shared_stream_provider._core.envelope import iso_timestamp, json_safe, text_attributes, text_value
from airflow_shared_stream_provider._core.errors import broker_sdk
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.producer import Decided, Delivery
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusStreamSettings

with broker_sdk("servicebus"):
    from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusReceivedMessage, ServiceBusReceiveMode
    from azure.servicebus import exceptions as errors
    from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver
    from azure.servicebus.amqp import AmqpMessageBodyType

__all__ = [
    "LOCK_LOST",
    "NEXT_AVAILABLE_SESSION",
    "NO_SESSION",
    "ServiceBusClient",
    "ServiceBusCounters",
    "ServiceBusDelivery",
    "ServiceBusReceiveMode",
    "ServiceBusReceivedMessage",
    "ServiceBusReceiver",
    "SessionLane",
    "announced_max_message_size",
    "budget_prefetch",
    "envelope_fields",
    "errors",
    "lock_seconds_left",
    "message_body",
    "receive_batch",
    "renew_margin",
    "seconds_until",
]

LOCK_LOST: Final = (errors.MessageLockLostError, errors.SessionLockLostError)
"""The lock is gone (expired or taken back): the broker redelivers the message with ``delivery_count + 1``."""
NO_SESSION: Final = (errors.OperationTimeoutError, errors.SessionCannotBeLockedError)
"""An accept found no session to serve (none has a message, or all are held): availability, not configuration."""


@dataclass
class ServiceBusCounters(StreamCounters):
    """The shared counters plus what only session-enabled entities have."""

    sessions_accepted: int = 0
    sessions_released: int = 0
    sessions_lost: int = 0


class SessionLane(Protocol):
    """The session receiver a message came from: the one place it may be settled, in session order."""

    def take(self, entry: Decided[ServiceBusDelivery]) -> Decided[ServiceBusDelivery]: ...


@dataclass(slots=True)
class ServiceBusDelivery(Delivery):
    """What ``advance`` needs of one message: the received message (settled on its receiver)."""

    raw: ServiceBusReceivedMessage
    lock_token: str
    lane: Hashable
    session: SessionLane | None = None
    """The session receiver it came from (``sessions=True``): it is settled there, nowhere else."""


# -- locks -----------------------------------------------------------------------------------------
def renew_margin(lease_seconds: float) -> float:
    """Renew a third of the lock duration before expiry, at most 10 s before."""
    return min(10.0, lease_seconds / 3.0)


def seconds_until(moment: datetime | None, now: datetime | None = None) -> float | None:
    """Seconds from ``now`` (default: the current time) to a lock's UTC expiry; None when there is none."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (moment - (now or datetime.now(timezone.utc))).total_seconds()


def lock_seconds_left(message: ServiceBusReceivedMessage, now: datetime | None = None) -> float:
    """Seconds until the message's lock expires (negative when it already has)."""
    return seconds_until(message.locked_until_utc, now) or 0.0


# -- prefetch within the byte budget ---------------------------------------------------------------
def budget_prefetch(*, ceiling: int, budget_bytes: int, receivers: int, message_bytes: int) -> int:
    """
    The prefetch each of ``receivers`` receivers may have so that all their SDK buffers, full of
    messages that each hold ``message_bytes`` (the held size of a maximum-size message), fit half
    the byte budget: ``receivers x prefetch x message_bytes <= budget_bytes // 2``; at most
    ``ceiling`` (the user's ``prefetch_count``), at least 0.

    Half, because that is what the flow gate reserves for an SDK buffer at most
    (:meth:`~airflow_shared_stream_provider._core.flow.FlowGate.byte_credit`): the other half is
    what the producer itself holds, so buffer + held stay within the budget (plus one message).
    """
    if message_bytes <= 0:
        return ceiling
    return max(0, min(ceiling, (budget_bytes // 2) // (max(1, receivers) * message_bytes)))


def announced_max_message_size(receiver: ServiceBusReceiver) -> int | None:
    """
    The entity's maximum message size as the broker announced it when the receiver's link attached
    (``max-message-size`` of its AMQP attach); None when it announced none (0 means "no limit" in
    AMQP) or the SDK does not expose it. Read through the SDK's transport, the way its own sender
    reads the limit for batches (``get_remote_max_message_size``).
    """
    try:
        size = receiver._amqp_transport.get_remote_max_message_size(receiver._handler)  # type: ignore[no-untyped-call]
    except Exception:  # an SDK without the attribute, a fake receiver, a link not attached
        return None
    return size if isinstance(size, int) and size > 0 else None


# -- receiving -------------------------------------------------------------------------------------
async def receive_batch(
    receiver: ServiceBusReceiver,
    *,
    count: int,
    wait: float,
    busy: bool,
    settings: ServiceBusStreamSettings,
    counters: StreamCounters,
) -> list[ServiceBusReceivedMessage]:
    """
    One ``receive_messages`` call for at most ``count`` messages, waiting at most ``wait`` s.

    ``busy``: a short wait while messages are in flight (a settlement may be requested at any
    moment and it waits for this call). Such a wait that comes back empty with prefetch on was
    served from the SDK's buffer and sent no AMQP frame, so it is not counted as an API call.
    """
    batch = await receiver.receive_messages(max_message_count=count, max_wait_time=wait)
    if not busy or receiver_prefetch(receiver, settings) == 0 or batch:
        counters.add("api_calls")
    return batch


def receiver_prefetch(receiver: ServiceBusReceiver, settings: ServiceBusStreamSettings) -> int:
    """The prefetch the receiver was created with (the producer may lower ``prefetch_count``)."""
    prefetch = getattr(receiver, "_prefetch_count", None)
    return prefetch if isinstance(prefetch, int) else settings.prefetch_count


# -- message -> envelope ---------------------------------------------------------------------------
def message_body(message: ServiceBusReceivedMessage) -> bytes | str | None:
    """The body as bytes (data sections joined) or JSON text (value / sequence bodies)."""
    body_type = message.body_type
    body = message.body
    if body_type == AmqpMessageBodyType.DATA:
        if isinstance(body, bytes | bytearray | memoryview):
            return bytes(body)
        return b"".join(bytes(chunk) for chunk in body)
    if body_type == AmqpMessageBodyType.SEQUENCE:
        return json.dumps(json_safe([list(section) for section in body]))
    if body is None or isinstance(body, bytes | str):
        return body  # type: ignore[no-any-return]
    return json.dumps(json_safe(body))


def envelope_fields(message: ServiceBusReceivedMessage, *, entity_path: str) -> dict[str, Any]:
    """
    The envelope arguments of one received message (everything but size handling).

    Read in the receive loop, before the base's envelope guard: whatever reading a property raises
    must not end the stream. AMQP fixes each section's type (application-properties is a map), but
    the SDK hands on what a sender's encoder wrote, and encoders other than Azure's write other
    types. Such a message goes to the guard as ``unreadable`` with only what the broker itself set
    (its sequence number and delivery count): every watcher rejects it and it is dead-lettered
    intact, with ``envelope failed: <ExcType>: ...`` as the reason.
    """
    try:
        return _readable_fields(message, entity_path=entity_path)
    except Exception as exc:
        sequence_number = _broker_int(lambda: message.sequence_number)
        return {
            "source": entity_path,
            "message_id": f"{entity_path}/{sequence_number}",
            "body": None,
            "unreadable": exc,
            "attributes": {},
            "published_at": None,
            "delivery_attempt": (_broker_int(lambda: message.delivery_count) or 0) + 1,
            "metadata": {"entity_path": entity_path, "sequence_number": sequence_number},
        }


def _broker_int(read: Callable[[], Any]) -> int | None:
    """A number the broker sets (sequence number, delivery count), or None if it cannot be read."""
    try:
        value = read()
    except Exception:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _readable_fields(message: ServiceBusReceivedMessage, *, entity_path: str) -> dict[str, Any]:
    sequence_number = message.sequence_number
    delivery_count = message.delivery_count or 0
    message_id = message.message_id
    metadata: dict[str, Any] = {
        "entity_path": entity_path,
        "sequence_number": sequence_number,
        "enqueued_time": iso_timestamp(message.enqueued_time_utc),
        "delivery_count": delivery_count,
        "message_id": None if message_id is None else text_value(message_id),
        "session_id": message.session_id,
        "correlation_id": None if message.correlation_id is None else text_value(message.correlation_id),
        "subject": message.subject,
        "content_type": message.content_type,
        "partition_key": message.partition_key,
    }
    # An AMQP value or sequence body is any nesting of AMQP types a sender chose (a list nested
    # thousands deep, a map with binary keys): rendering it as JSON may raise (RecursionError in
    # json_safe / json.dumps). That is this message's problem, not the stream's: the base's
    # envelope guard forced-rejects it (``unreadable``) and the broker dead-letters it intact.
    unreadable: Exception | None = None
    try:
        body = message_body(message)
    except Exception as exc:
        body, unreadable = None, exc
    return {
        "source": entity_path,
        # The sender's message id when it set one (dedup across resends), else the sequence number,
        # unique and stable per entity across redeliveries.
        "message_id": text_value(message_id) if message_id is not None else f"{entity_path}/{sequence_number}",
        "body": body,
        "unreadable": unreadable,
        "attributes": text_attributes(message.application_properties),
        "published_at": iso_timestamp(message.enqueued_time_utc),
        "delivery_attempt": delivery_count + 1,
        "metadata": metadata,
    }
