"""
The one envelope every broker's TriggerEvent payload uses.

An envelope is a JSON-safe ``dict`` built **once per broker message** by the producer and shared
(read-only) by every watcher that fires on it; it becomes the asset event's ``extra`` in the
metadata DB. Keys (always present):

==================  ===========================================================================
``broker``          the broker's registry name (:mod:`airflow_shared_stream_provider.brokers`): ``"kafka"``, ...
``source``          topic / queue URL / subscription path / entity path the message came from
``message_id``      stable per broker message (Kafka: ``"topic/partition/offset"``): dedup on it
``body``            parsed JSON if the bytes are JSON nested at most :data:`MAX_BODY_DEPTH` levels,
                    else UTF-8 text, else base64 text
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

Depth cap: JSON nested deeper than :data:`MAX_BODY_DEPTH` is delivered as its text with
``body_depth_exceeded=True``, so every payload stays serialisable by recursive serialisers.

Never raises: :func:`build_envelope` takes any bytes; :func:`fallback_envelope` is what a producer
delivers (forced-rejected, so dead-lettered intact) should building one fail anyway.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final, Literal, Protocol

import msgspec

from airflow_shared_stream_provider.brokers import BrokerName

OversizePolicy = Literal["dead_letter", "truncate"]
OVERSIZE_POLICIES: Final = ("dead_letter", "truncate")

DEFAULT_MAX_PAYLOAD_BYTES: Final = 65536
# JSON escaping can grow a string at most 6x (\u00XX for control characters); below this bound the
# exact (costly) serialization for the size check is skipped.
_JSON_WORST_CASE_GROWTH: Final = 6
_ENVELOPE_OVERHEAD: Final = 512

MAX_BODY_DEPTH: Final = 64
"""
Deepest JSON body delivered as JSON (``[]`` is 1 level, ``[[]]`` 2). A payload is serialised by
recursive code: ``json.dumps`` (1 frame per level), Airflow's serde and ``BaseSerialization`` (2
per level: 397 levels is their limit when the caller is 200 frames deep, measured on 3.3.2), the
triggerer's pydantic + msgpack frame (~790 then), and whatever a Dag does with it. The envelope
and a batch add 3 levels. 64 keeps a 6x margin under the tightest of those while 200 frames deep,
and is far above what real messages nest; deeper bodies are delivered as text (flagged), which
any serialiser takes.
"""


# The mark a watcher puts on a message while the runner takes its event (``_core/trigger.py``),
# left in place when the event was never recorded. A message whose only failures are such marks
# is handed back without counting a delivery attempt (Disposition.HOLD): nothing judged it.
UNRECORDED: Final = "watcher stopped before the triggerer recorded its event"


def unrecorded_only(message: StreamMessage) -> bool:
    """True if every failure recorded on ``message`` is an :data:`UNRECORDED` mark (and there is one)."""
    failures = message.failures
    return failures is not None and bool(failures) and all(failure == UNRECORDED for failure in failures)


class StreamMessage:
    """
    The raw event broadcast to every watcher of one shared stream.

    ``seq`` is the flow-control sequence number (see :mod:`.flow`). ``forced_rejection`` is set by
    the producer when every watcher must reject the message (oversize with ``dead_letter``).
    ``rejections`` collects the reasons watchers gave, so the producer can put them in the
    dead-letter record; ``failures`` the errors of watchers that stopped on this message
    (``on_filter_error="fail"``), which the producer counts as *failed* although the manager
    resolved them as accepted when those watchers left. Both are shared between watchers on
    purpose, and ``None`` until the first entry: almost every message has neither, and two lists
    per message would be two more objects for the cyclic GC to walk while the message is in flight.

    Only the producer writes ``envelope``, ``seq``, ``forced_rejection``, ``skip_for`` and
    ``audience`` (before the yield); watchers only call :meth:`reject` / :meth:`fail`.
    """

    __slots__ = (
        "audience",
        "culprit",
        "envelope",
        "failures",
        "forced_rejection",
        "generation",
        "held_bytes",
        "rejections",
        "seq",
        "skip_for",
        "suspect",
    )

    def __init__(self, envelope: dict[str, Any], seq: int, forced_rejection: str | None = None) -> None:
        self.envelope = envelope
        self.seq = seq
        self.forced_rejection = forced_rejection
        self.rejections: list[str] | None = None
        self.failures: list[str] | None = None
        # Watcher positions (_core/positions.py): member numbers of the watchers that already have
        # this message (a lane rewound for a late watcher re-reads it); they pass it unseen.
        self.skip_for: frozenset[int] | None = None
        # A watcher failed *on* this message (not merely alongside it, in its batch).
        self.culprit = False
        # The manager force-failed a watcher (ack timeout, overflow) while it stood on this message:
        # the failure counts toward this message's poison cap, not toward the messages queued
        # behind it (_core/attempts.py, collateral failures).
        self.suspect = False
        # What the producer counted against max_in_flight_bytes for it (_core/flow.py, byte budget).
        self.held_bytes = 0
        # How many watchers must have it before it is settled (queue brokers, set at its broadcast:
        # FlowGate.audience); 0: not checked (a broker whose returning watchers replay, Kafka).
        self.audience = 0
        # The gate's registrations generation at its broadcast (FlowGate.generation): a shortfall
        # it shows is current only while no watcher registered or left since.
        self.generation = 0

    def reject(self, reason: str) -> None:
        if self.rejections is None:
            self.rejections = []
        self.rejections.append(reason)

    def fail(self, error: str, *, culprit: bool = True) -> None:
        """A watcher stopped; ``culprit``: on this very message (False: a batch-mate it never judged)."""
        if self.failures is None:
            self.failures = []
        self.failures.append(error)
        self.culprit = self.culprit or culprit

    def __repr__(self) -> str:
        return f"StreamMessage(seq={self.seq}, message_id={self.envelope.get('message_id')!r})"


class DeliveryLike(Protocol):
    """
    What the core needs of a broker payload (``advance``, batch mode): the broadcast message and
    its delivery attempt. Each producer's delivery type adds what its broker needs to settle it.
    """

    @property
    def message(self) -> StreamMessage: ...

    @property
    def delivery_attempt(self) -> int: ...


# Strict RFC 8259 JSON (msgspec, an Airflow dependency): ~5x faster than ``json.loads`` on small
# bodies, and it refuses what is not JSON although ``json.loads`` takes it (``NaN``,
# ``Infinity``, lone surrogates, numbers out of float range). Those would not survive the metadata
# DB's JSON column, so such bodies are delivered as text instead.
_decode_json = msgspec.json.Decoder().decode
# A JSON text starts with one of these (after optional whitespace). Checking first avoids paying
# for a parse error on every plain-text body.
_JSON_FIRST_CHARS: Final = frozenset('{["-0123456789tfn \t\r\n')
_JSON_FIRST_BYTES: Final = frozenset(char.encode() for char in _JSON_FIRST_CHARS)


# What msgspec raises for bytes that are not (storable) JSON: a parse error, invalid UTF-8 inside a
# JSON string (UnicodeDecodeError), or nesting deeper than it recurses (RecursionError). Found by
# the fuzz tests through the real brokers; each used to end the producer's receive loop.
_NOT_JSON: Final = (msgspec.DecodeError, UnicodeDecodeError)


def decode_body(data: bytes | str | None) -> tuple[Any, str]:
    """Decode message bytes: JSON if they parse (strictly), else UTF-8 text, else base64 (never raises)."""
    decoded, encoding, _ = _decode(data)
    return decoded, encoding


def _decode(data: bytes | str | None) -> tuple[Any, str, bool]:
    """:func:`decode_body` and whether the body was JSON nested deeper than :data:`MAX_BODY_DEPTH`."""
    if data is None:
        return None, "json", False
    too_deep = False
    if isinstance(data, str):
        if data[:1] in _JSON_FIRST_CHARS:
            try:
                value = _decode_json(data)
            except _NOT_JSON:
                pass
            except RecursionError:  # deeper than msgspec recurses from here: deeper than the cap too
                too_deep = True
            else:
                if not _deeper_than(data.count("[") + data.count("{"), value, MAX_BODY_DEPTH):
                    return value, "json", False
                too_deep = True
        return data, "text", too_deep
    if bytes(data[:1]) in _JSON_FIRST_BYTES:
        try:
            value = _decode_json(data)
        except _NOT_JSON:
            pass
        except RecursionError:
            too_deep = True
        else:
            if not _deeper_than(data.count(b"[") + data.count(b"{"), value, MAX_BODY_DEPTH):
                return value, "json", False
            too_deep = True
    try:
        return bytes(data).decode("utf-8"), "text", too_deep
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64", too_deep


def _deeper_than(openings: int, value: Any, limit: int) -> bool:
    """
    Whether a decoded JSON value nests more than ``limit`` containers deep, level by level (no
    recursion). ``openings`` (the ``[`` and ``{`` in the text, a C-speed count that strings can only
    inflate) bounds the depth: at most ``limit`` of them, the common case, needs no walk.
    """
    if openings <= limit:
        return False
    # msgspec decodes JSON to exact dict / list / scalars: ``type() is`` is enough, and one
    # comprehension per level is ~4x faster than a loop over the items (0.3 ms for 2000 containers).
    level = [value] if type(value) is list or type(value) is dict else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) is list or type(child) is dict
        ]
    return False


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


def text_attributes(items: Mapping[Any, Any] | Sequence[tuple[Any, Any]] | None) -> dict[str, str]:
    """Normalize broker headers into ``str -> str`` (bytes keys and values decoded)."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, Mapping) else items
    return {text_value(key): text_value(value) for key, value in pairs}


# What an epoch number outside a datetime's range raises (year 1-9999, the platform's time_t, NaN).
_OUT_OF_RANGE: Final = (ValueError, OverflowError, OSError)


def iso_timestamp(value: datetime | float | int | None, *, unit: Literal["s", "ms"] = "s") -> str | None:
    """
    ISO-8601 UTC text for a datetime or an epoch number (seconds or milliseconds), or None for a
    number no datetime can hold: a stamp comes from the broker or the sender (a Kafka record's
    CreateTime is any int64), and an impossible one is no reason to refuse the message.
    """
    if value is None:
        return None
    if unit == "ms" and isinstance(value, int):
        return iso_from_epoch_ms(value)
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    else:
        try:
            seconds = float(value) / 1000.0 if unit == "ms" else float(value)
            moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
        except _OUT_OF_RANGE:
            return None
    return moment.astimezone(timezone.utc).isoformat()


_second_cache: tuple[int, str] = (-1, "")
_last_stamp: tuple[int, str] = (-1, "")


def iso_from_epoch_ms(milliseconds: int) -> str | None:
    """
    ``iso_timestamp(milliseconds, unit="ms")`` without a datetime per call (Kafka and SQS stamp
    every message in epoch milliseconds; consecutive messages share their second, and messages
    of one producer batch often their millisecond: both are cached). None outside a datetime's
    range (see :func:`iso_timestamp`).

    Exact integer arithmetic, same text as ``datetime.isoformat()``: no fraction when the
    milliseconds are zero, else six digits.
    """
    global _second_cache, _last_stamp
    last_ms, last_text = _last_stamp
    if milliseconds == last_ms:
        return last_text
    seconds, millis = divmod(milliseconds, 1000)
    cached_second, prefix = _second_cache
    if seconds != cached_second:
        try:
            prefix = datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()[: -len("+00:00")]
        except _OUT_OF_RANGE:
            return None
        _second_cache = (seconds, prefix)
    text = f"{prefix}.{millis:03d}000+00:00" if millis else prefix + "+00:00"
    _last_stamp = (milliseconds, text)
    return text


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
    Build the envelope for one message and apply the size and depth caps.

    Returns ``(envelope, forced_rejection)``: ``forced_rejection`` is a reason string when the
    message is over the cap and the policy is ``dead_letter`` (every watcher must reject it).
    Never raises on what a broker can carry (any body bytes, any ``str`` attributes): a body is
    decoded without recursion limits mattering (see :data:`MAX_BODY_DEPTH`), and sizes are
    measured without ``json.dumps`` failing (see :func:`_json_size`).
    """
    decoded, encoding, too_deep = _decode(body)
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
    if too_deep:
        envelope["body_depth_exceeded"] = True
    raw_size = len(body) if body is not None else 0
    attr_size = sum(len(k) + len(v) for k, v in attributes.items()) if attributes else 0
    # Everything else that can be long (source, id, metadata such as a Kafka key or an ordering
    # key) counts too: the shortcut below must never let an over-cap envelope through.
    other_size = len(source) + len(message_id) + _text_size(metadata)
    if (raw_size + attr_size + other_size) * _JSON_WORST_CASE_GROWTH + _ENVELOPE_OVERHEAD <= max_payload_bytes:
        return envelope, None
    try:
        size = _json_size(envelope)
        if size <= max_payload_bytes:
            return envelope, None
        reason = f"payload too large: envelope is {size} bytes, max_payload_bytes={max_payload_bytes}"
        envelope["body"] = None
        envelope["body_encoding"] = "none"
        envelope["body_truncated"] = True
        envelope["body_bytes"] = raw_size
        if oversize_policy == "dead_letter":
            return envelope, reason
        if _json_size(envelope) > max_payload_bytes:
            # Even without the body the attributes/metadata are over the cap: drop attributes too
            # rather than write an unbounded row into the metadata DB.
            envelope["attributes"] = {}
            envelope["attributes_truncated"] = True
        return envelope, None
    except _UNSERIALISABLE as exc:
        # Not from a body (capped in depth, decoded to JSON types): metadata a producer built
        # that json.dumps refuses. Such an envelope would fail wherever it is stored: the
        # message is dead-lettered instead, here too for callers without the producer's guard.
        return fallback_envelope(
            broker=broker,
            source=source,
            message_id=message_id,
            body=body,
            published_at=published_at,
            delivery_attempt=delivery_attempt,
            max_payload_bytes=max_payload_bytes,
            error=exc,
        )


ENVELOPE_FAILED: Final = "envelope failed"
"""The start of the dead-letter reason of a message whose envelope could not be built."""
_REASON_DETAIL_CHARS: Final = 200


def fallback_envelope(
    *,
    broker: str,
    source: Any,
    message_id: Any,
    body: Any,
    published_at: Any,
    delivery_attempt: Any,
    max_payload_bytes: int,
    error: BaseException,
) -> tuple[dict[str, Any], str]:
    """
    The envelope of a message :func:`build_envelope` failed on, and its forced rejection
    (``envelope failed: <ExcType>: <message cut to 200 characters>``): every watcher rejects it, so
    the producer dead-letters the original message intact with that reason. Built from plain
    ``str`` / ``int`` / base64 values only, so that it cannot fail in turn: the body is the base64 of
    the raw bytes when that fits ``max_payload_bytes`` (else ``None``, ``body_encoding="none"``);
    attributes and metadata are left out (either may be what failed).
    """
    envelope: dict[str, Any] = {
        "broker": broker,
        "source": _plain_text(source),
        "message_id": _plain_text(message_id),
        "body": None,
        "body_encoding": "none",
        "attributes": {},
        "published_at": published_at if isinstance(published_at, str) else None,
        "delivery_attempt": delivery_attempt if type(delivery_attempt) is int else 1,
        "metadata": {},
        "envelope_error": True,
    }
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if isinstance(raw, bytes | bytearray | memoryview):
        raw = bytes(raw)
        # base64 is 4/3 of the bytes; the other fields are bounded by _plain_text.
        if (len(raw) + 2) // 3 * 4 + 2 * _ENVELOPE_OVERHEAD <= max_payload_bytes:
            envelope["body"] = base64.b64encode(raw).decode("ascii")
            envelope["body_encoding"] = "base64"
        else:
            envelope["body_truncated"] = True
            envelope["body_bytes"] = len(raw)
    detail = _plain_text(error, limit=_REASON_DETAIL_CHARS)
    return envelope, f"{ENVELOPE_FAILED}: {type(error).__name__}: {detail}"


def _plain_text(value: Any, *, limit: int = 1024) -> str:
    """``str(value)`` cut to ``limit`` characters, or a placeholder when rendering it fails."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a broken __str__: the value is unusable, not the message
        return f"<unprintable {type(value).__name__}>"
    return text[:limit]


def _text_size(metadata: Mapping[str, Any]) -> int:
    """
    Characters of a flat metadata dict's keys and values (nested values by their ``str``). Only
    decides whether the exact measure runs: a value that cannot be rendered counts as unbounded.
    """
    size = 0
    for key, value in metadata.items():
        if isinstance(value, str):
            size += len(key) + len(value)
        elif value is not None:
            try:
                size += len(key) + len(str(value))
            except Exception:  # deep nesting (RecursionError) or a broken __str__
                return _UNBOUNDED
    return size


_UNBOUNDED: Final = 1 << 62
# What json.dumps raises on a value it cannot write: nesting deeper than the stack allows, a
# circular reference (ValueError), a key of no JSON type (TypeError), or whatever a value's
# ``__str__`` raises (``default=str``).
_UNSERIALISABLE: Final = (Exception,)


def _json_size(envelope: Mapping[str, Any]) -> int:
    """
    Size of the envelope as JSON, non-ASCII escaped (never less than its UTF-8 bytes). Bodies are
    at most :data:`MAX_BODY_DEPTH` deep, so this does not recurse far on anything a broker sent;
    raises one of :data:`_UNSERIALISABLE` on a value the envelope must not carry.
    """
    return len(json.dumps(envelope, separators=(",", ":"), default=str))


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
