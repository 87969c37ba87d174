"""
The one envelope every broker's TriggerEvent payload uses.

An envelope is a JSON-safe ``dict`` built **once per broker message** by the producer and shared
(read-only) by every watcher that fires on it; it becomes the asset event's ``extra`` in the
metadata DB. Keys (always present):

==================  ===========================================================================
``broker``          ``"kafka" | "sqs" | "pubsub" | "servicebus"``
``source``          topic / queue URL / subscription path / entity path the message came from
``message_id``      stable per broker message (Kafka: ``"topic/partition/offset"``): dedup on it
``body``            parsed JSON if the bytes are JSON, else UTF-8 text, else base64 text
``body_encoding``   ``"json" | "text" | "base64"`` (``"none"`` when dropped for size)
``attributes``      headers / message attributes / application properties, ``str -> str``
``published_at``    ISO-8601 UTC timestamp of the broker's publish/enqueue time, or ``None``
``delivery_attempt`` 1 on first delivery, +1 for every redelivery the broker or producer counted
``metadata``        the broker-specific rest (partition, offset, sequence number, ...)
==================  ===========================================================================

Size cap: ``max_payload_bytes`` bounds the serialized envelope (default 65536). A larger message
follows ``oversize_policy``:

* ``"dead_letter"`` (default): no event fires; every watcher rejects the message, so the producer
  dead-letters it **intact** (original bytes) with the reason ``payload too large``.
* ``"truncate"``: the event fires with ``body=None``, ``body_encoding="none"``,
  ``body_truncated=True`` and ``body_bytes=<size>``; attributes and metadata are kept so a Dag can
  locate the original. The broker message is then committed like any other.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

BrokerName = Literal["kafka", "sqs", "pubsub", "servicebus"]
OversizePolicy = Literal["dead_letter", "truncate"]
OVERSIZE_POLICIES: Final = ("dead_letter", "truncate")

DEFAULT_MAX_PAYLOAD_BYTES: Final = 65536
# JSON escaping can grow a string at most 6x (\u00XX for control characters); below this bound the
# exact (costly) serialization for the size check is skipped.
_JSON_WORST_CASE_GROWTH: Final = 6
_ENVELOPE_OVERHEAD: Final = 512


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """
    The raw event broadcast to every watcher of one shared stream.

    ``seq`` is the flow-control sequence number (see :mod:`.flow`). ``forced_rejection`` is set by
    the producer when every watcher must reject the message (oversize with ``dead_letter``).
    ``rejections`` collects the reasons watchers gave, so the producer can put them in the
    dead-letter record; ``failures`` the errors of watchers that stopped on this message
    (``on_filter_error="fail"``), which the producer counts as *failed* although the manager
    resolved them as accepted when those watchers left. Both lists are shared between watchers on
    purpose.
    """

    envelope: dict[str, Any]
    seq: int
    forced_rejection: str | None = None
    rejections: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def decode_body(data: bytes | str | None) -> tuple[Any, str]:
    """Decode message bytes: JSON if they parse, else UTF-8 text, else base64 (never raises)."""
    if data is None:
        return None, "json"
    if isinstance(data, str):
        text = data
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(data).decode("ascii"), "base64"
    stripped = text.lstrip()
    if (
        stripped[:1] in ("{", "[", '"')
        or stripped[:1].isdigit()
        or stripped[:1] == "-"
        or stripped
        in (
            "true",
            "false",
            "null",
        )
    ):
        try:
            return json.loads(text), "json"
        except ValueError:
            pass
    return text, "text"


def text_value(value: Any) -> str:
    """Render one header / attribute value as text (base64 with a prefix when not UTF-8)."""
    if value is None:
        return ""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(raw).decode("ascii")
    if isinstance(value, str):
        return value
    return str(value)


def text_attributes(items: Mapping[Any, Any] | list[tuple[Any, Any]] | None) -> dict[str, str]:
    """Normalize broker headers into ``str -> str`` (bytes keys and values decoded)."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, Mapping) else items
    return {text_value(key): text_value(value) for key, value in pairs}


def iso_timestamp(value: datetime | float | int | None, *, unit: Literal["s", "ms"] = "s") -> str | None:
    """ISO-8601 UTC text for a datetime or an epoch number (seconds or milliseconds)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
    else:
        seconds = float(value) / 1000.0 if unit == "ms" else float(value)
        moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.astimezone(UTC).isoformat()


def json_safe(value: Any) -> Any:
    """Make metadata values JSON-safe (bytes -> text, datetimes -> ISO, others -> str)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return text_value(value)
    if isinstance(value, datetime):
        return iso_timestamp(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


def build_envelope(
    *,
    broker: BrokerName,
    source: str,
    message_id: str,
    body: bytes | str | None,
    attributes: dict[str, str],
    published_at: str | None,
    delivery_attempt: int,
    metadata: dict[str, Any],
    max_payload_bytes: int,
    oversize_policy: OversizePolicy,
) -> tuple[dict[str, Any], str | None]:
    """
    Build the envelope for one message and apply the size cap.

    Returns ``(envelope, forced_rejection)``: ``forced_rejection`` is a reason string when the
    message is over the cap and the policy is ``dead_letter`` (every watcher must reject it).
    """
    decoded, encoding = decode_body(body)
    envelope: dict[str, Any] = {
        "broker": broker,
        "source": source,
        "message_id": message_id,
        "body": decoded,
        "body_encoding": encoding,
        "attributes": attributes,
        "published_at": published_at,
        "delivery_attempt": delivery_attempt,
        "metadata": metadata,
    }
    raw_size = len(body) if body is not None else 0
    attr_size = sum(len(k) + len(v) for k, v in attributes.items())
    if (raw_size + attr_size) * _JSON_WORST_CASE_GROWTH + _ENVELOPE_OVERHEAD <= max_payload_bytes:
        return envelope, None
    size = len(json.dumps(envelope, separators=(",", ":"), default=str))
    if size <= max_payload_bytes:
        return envelope, None
    reason = f"payload too large: envelope is {size} bytes, max_payload_bytes={max_payload_bytes}"
    if oversize_policy == "dead_letter":
        envelope["body"] = None
        envelope["body_encoding"] = "none"
        envelope["body_truncated"] = True
        envelope["body_bytes"] = raw_size
        return envelope, reason
    envelope["body"] = None
    envelope["body_encoding"] = "none"
    envelope["body_truncated"] = True
    envelope["body_bytes"] = raw_size
    if len(json.dumps(envelope, separators=(",", ":"), default=str)) > max_payload_bytes:
        # Even without the body the attributes/metadata are over the cap: drop attributes too
        # rather than write an unbounded row into the metadata DB.
        envelope["attributes"] = {}
        envelope["attributes_truncated"] = True
    return envelope, None


def body_bytes_of(envelope: Mapping[str, Any]) -> bytes:
    """Re-encode an envelope's body to bytes (used by tests and Dags that need the raw bytes)."""
    encoding = envelope.get("body_encoding")
    body = envelope.get("body")
    if encoding == "base64":
        try:
            return base64.b64decode(str(body), validate=True)
        except binascii.Error as exc:
            raise ValueError("envelope body is not valid base64") from exc
    if encoding == "text":
        return str(body).encode("utf-8")
    if encoding == "none" or body is None:
        return b""
    return json.dumps(body).encode("utf-8")
