"""AMQP 1.0 messages as the broker stores them (OASIS AMQP 1.0, part 3 "Messaging").

A received message is split into its sections. Sections the broker never changes (properties,
body, footer) are kept as the exact bytes the sender produced; the header is decoded so its
``delivery-count`` can be rewritten; message annotations and application properties are kept as
raw key/value encodings so entries can be added or replaced without re-encoding the others.
Delivery annotations are per-hop and are dropped. An application-properties section that is not a
map (a list, say: what a non-Azure AMQP encoder may write) is kept as its exact bytes, for tests of
what a receiver makes of it; a property the broker sets (a dead-letter reason) replaces it with a map.

Batches (message-format ``0x80013700``) are split into their inner messages by ``split_batch``.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .codec import (
    DecodeError,
    Described,
    Symbol,
    Timestamp,
    UInt,
    ULong,
    decode_value,
    encode_value,
    skip_value,
)

if TYPE_CHECKING:
    import uuid

BATCH_FORMAT = 0x80013700
HEADER, DELIVERY_ANNOTATIONS, MESSAGE_ANNOTATIONS, PROPERTIES, APP_PROPERTIES = 0x70, 0x71, 0x72, 0x73, 0x74
DATA, AMQP_SEQUENCE, AMQP_VALUE, FOOTER = 0x75, 0x76, 0x77, 0x78

RawMap = dict[Any, tuple[bytes, bytes]]
RAW_MAP_CONSTRUCTORS = (0x40, 0xC1, 0xD1)
"""null, map8, map32: the constructors :func:`parse_raw_map` reads (told by one byte, nothing decoded)."""


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch (what AMQP timestamps carry)."""
    return int(time.time() * 1000)


def _section_code(buf: bytes, pos: int) -> int:
    if buf[pos] != 0x00:
        raise DecodeError("message section is not a described type")
    descriptor, _ = decode_value(buf, pos + 1)
    if isinstance(descriptor, int):
        return int(descriptor)
    names = {
        "amqp:header:list": HEADER,
        "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
        "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
        "amqp:properties:list": PROPERTIES,
        "amqp:application-properties:map": APP_PROPERTIES,
        "amqp:data:binary": DATA,
        "amqp:amqp-sequence:list": AMQP_SEQUENCE,
        "amqp:amqp-value:*": AMQP_VALUE,
        "amqp:footer:map": FOOTER,
    }
    if str(descriptor) not in names:
        raise DecodeError(f"unknown message section {descriptor!r}")
    return names[str(descriptor)]


def _section_value_start(buf: bytes, pos: int) -> int:
    return skip_value(buf, pos + 1)  # past 0x00 and the descriptor


def parse_raw_map(buf: bytes, pos: int) -> RawMap:
    """Split an encoded map (or null) at ``pos`` into ``{decoded key: (raw key, raw value)}``."""
    code = buf[pos]
    if code == 0x40:
        return {}
    if code == 0xC1:
        count, pos = buf[pos + 2], pos + 3
    elif code == 0xD1:
        count = struct.unpack_from(">I", buf, pos + 5)[0]
        pos += 9
    else:
        raise DecodeError(f"expected a map, got constructor 0x{code:02x}")
    result: RawMap = {}
    for _ in range(count // 2):
        key_end = skip_value(buf, pos)
        value_end = skip_value(buf, key_end)
        key, _ = decode_value(buf, pos)
        result[key] = (buf[pos:key_end], buf[key_end:value_end])
        pos = value_end
    return result


def encode_raw_map(descriptor: int, entries: RawMap) -> bytes:
    """Encode a described map section from raw key/value encodings."""
    body = b"".join(key + value for key, value in entries.values())
    return (
        b"\x00" + encode_value(ULong(descriptor)) + b"\xd1" + struct.pack(">II", len(body) + 4, 2 * len(entries)) + body
    )


def raw_entry(key: Any, value: Any) -> tuple[Any, tuple[bytes, bytes]]:
    """A map entry for ``RawMap`` built from Python/AMQP values."""
    return key, (encode_value(key), encode_value(value))


@dataclass
class StoredMessage:
    """One message held by an entity, plus the broker-side state the service would track."""

    header: list[Any]
    annotations: RawMap
    properties_raw: bytes
    properties: list[Any]
    app_properties: RawMap
    body_raw: bytes
    sequence_number: int = 0
    enqueued_time_ms: int = 0
    delivery_count: int = 0
    state: str = "available"  # available | locked | deferred
    lock_token: uuid.UUID | None = None
    locked_until_ms: int = 0
    dead_letter_source: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # An application-properties section of another AMQP type than a map, as the sender wrote it.
    app_properties_raw: bytes | None = None

    # -- decoded views for tests ---------------------------------------------------------
    @property
    def message_id(self) -> Any:
        return self.properties[0] if self.properties else None

    @property
    def session_id(self) -> str | None:
        value = self.properties[10] if len(self.properties) > 10 else None
        return None if value is None else str(value)

    @property
    def application_properties(self) -> dict[Any, Any]:
        return {key: decode_value(raw_value)[0] for key, (_, raw_value) in self.app_properties.items()}

    @property
    def body(self) -> bytes | Any:
        """Concatenated ``data`` sections, or the ``amqp-value`` / ``amqp-sequence`` value."""
        pos, chunks, value = 0, [], None
        buf = self.body_raw
        while pos < len(buf):
            code = _section_code(buf, pos)
            start = _section_value_start(buf, pos)
            end = skip_value(buf, start)
            if code == DATA:
                chunks.append(decode_value(buf, start)[0])
            elif code in (AMQP_VALUE, AMQP_SEQUENCE):
                value = decode_value(buf, start)[0]
            pos = end
        return b"".join(chunks) if chunks else value

    def copy_for(self) -> StoredMessage:
        """A fresh copy (used when a topic fans a message out to its subscriptions)."""
        return StoredMessage(
            header=list(self.header),
            annotations=dict(self.annotations),
            properties_raw=self.properties_raw,
            properties=list(self.properties),
            app_properties=dict(self.app_properties),
            body_raw=self.body_raw,
            app_properties_raw=self.app_properties_raw,
        )

    def set_annotation(self, key: str, value: Any) -> None:
        k, entry = raw_entry(Symbol(key), value)
        self.annotations[k] = entry

    def set_app_property(self, key: str, value: Any) -> None:
        self.app_properties_raw = None  # a section that is no map cannot take an entry: a map replaces it
        k, entry = raw_entry(key, value)
        self.app_properties[k] = entry

    # -- encoding ------------------------------------------------------------------------
    def encode(self, *, lock_token: uuid.UUID | None = None, locked_until_ms: int | None = None) -> bytes:
        """The message as delivered: header with delivery-count, broker annotations added."""
        header = list(self.header) + [None] * (5 - len(self.header))
        header[4] = UInt(self.delivery_count)
        while header and header[-1] is None:
            header.pop()
        annotations = dict(self.annotations)
        for key, value in (
            ("x-opt-sequence-number", self.sequence_number),
            ("x-opt-enqueued-time", Timestamp(self.enqueued_time_ms)),
        ):
            k, entry = raw_entry(Symbol(key), value)
            annotations[k] = entry
        if lock_token is not None:
            k, entry = raw_entry(Symbol("x-opt-lock-token"), lock_token)
            annotations[k] = entry
        if locked_until_ms is not None:
            k, entry = raw_entry(Symbol("x-opt-locked-until"), Timestamp(locked_until_ms))
            annotations[k] = entry
        parts = [
            encode_value(Described(ULong(HEADER), header)),
            encode_raw_map(MESSAGE_ANNOTATIONS, annotations),
            self.properties_raw,
        ]
        if self.app_properties_raw is not None:
            parts.append(self.app_properties_raw)
        elif self.app_properties:
            parts.append(encode_raw_map(APP_PROPERTIES, self.app_properties))
        parts.append(self.body_raw)
        return b"".join(parts)


def parse_message(payload: bytes) -> StoredMessage:
    """Split an encoded message into sections (raises ``DecodeError`` if malformed)."""
    pos = 0
    header: list[Any] = []
    annotations: RawMap = {}
    properties_raw = b""
    properties: list[Any] = []
    app_properties: RawMap = {}
    app_properties_raw: bytes | None = None
    body_start: int | None = None
    while pos < len(payload):
        code = _section_code(payload, pos)
        start = _section_value_start(payload, pos)
        end = skip_value(payload, start)
        if code in (DATA, AMQP_SEQUENCE, AMQP_VALUE, FOOTER):
            body_start = pos
            break
        if code == HEADER:
            value, _ = decode_value(payload, start)
            header = list(value) if isinstance(value, list) else []
        elif code == MESSAGE_ANNOTATIONS:
            annotations = parse_raw_map(payload, start)
        elif code == PROPERTIES:
            properties_raw = payload[pos:end]
            value, _ = decode_value(payload, start)
            properties = list(value) if isinstance(value, list) else []
        elif code == APP_PROPERTIES and payload[start] not in RAW_MAP_CONSTRUCTORS:
            app_properties_raw = payload[pos:end]
        elif code == APP_PROPERTIES:
            app_properties = parse_raw_map(payload, start)
        elif code != DELIVERY_ANNOTATIONS:
            raise DecodeError(f"unexpected message section 0x{code:02x}")
        pos = end
    body_raw = b"" if body_start is None else payload[body_start:]
    # validate the body sections fully
    check = 0
    while check < len(body_raw):
        _section_code(body_raw, check)
        check = skip_value(body_raw, _section_value_start(body_raw, check))
    return StoredMessage(
        header, annotations, properties_raw, properties, app_properties, body_raw, app_properties_raw=app_properties_raw
    )


def split_batch(payload: bytes) -> list[bytes]:
    """The inner messages of a batch: every ``data`` section holds one complete message."""
    pos = 0
    inner: list[bytes] = []
    while pos < len(payload):
        code = _section_code(payload, pos)
        start = _section_value_start(payload, pos)
        end = skip_value(payload, start)
        if code == DATA:
            value, _ = decode_value(payload, start)
            inner.append(bytes(value))
        pos = end
    return inner


def decode_body_value(payload: bytes) -> Any:
    """The ``amqp-value`` body of a request message (management / cbs), or ``None``."""
    pos = 0
    while pos < len(payload):
        code = _section_code(payload, pos)
        start = _section_value_start(payload, pos)
        end = skip_value(payload, start)
        if code == AMQP_VALUE:
            return decode_value(payload, start)[0]
        pos = end
    return None
