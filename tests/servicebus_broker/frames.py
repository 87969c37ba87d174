"""AMQP 1.0 framing and performatives (OASIS AMQP 1.0, part 2 "Transport", part 5 "SASL").

Implemented: frame header parsing/encoding, empty (heartbeat) frames, the nine transport
performatives (open, begin, attach, flow, transfer, disposition, detach, end, close), the SASL
frames a server needs (mechanisms, init, outcome), the ``error`` type, ``source`` / ``target``
and the delivery states (accepted, rejected, released, modified, received).

Performatives are decoded into small dataclasses holding the fields the broker uses; outgoing
performatives are built as ``Described(code, [fields...])`` with trailing nulls trimmed.
Not implemented: link resumption (``unsettled`` maps are ignored), transactions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .codec import DecodeError, Described, Symbol, ULong, decode_value, encode_value

if TYPE_CHECKING:
    import asyncio

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
FRAME_TYPE_AMQP = 0
FRAME_TYPE_SASL = 1

OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
ERROR = 0x1D
SASL_MECHANISMS, SASL_INIT, SASL_CHALLENGE, SASL_RESPONSE, SASL_OUTCOME = range(0x40, 0x45)
RECEIVED, ACCEPTED, REJECTED, RELEASED, MODIFIED = range(0x23, 0x28)
SOURCE, TARGET = 0x28, 0x29

PERFORMATIVE_NAMES = {
    OPEN: "open",
    BEGIN: "begin",
    ATTACH: "attach",
    FLOW: "flow",
    TRANSFER: "transfer",
    DISPOSITION: "disposition",
    DETACH: "detach",
    END: "end",
    CLOSE: "close",
    SASL_MECHANISMS: "sasl-mechanisms",
    SASL_INIT: "sasl-init",
    SASL_OUTCOME: "sasl-outcome",
}

ROLE_SENDER = False
ROLE_RECEIVER = True
SND_UNSETTLED, SND_SETTLED, SND_MIXED = 0, 1, 2
RCV_FIRST, RCV_SECOND = 0, 1


class FramingError(Exception):
    """The peer violated AMQP framing; the connection must be closed."""


@dataclass
class RawFrame:
    """One frame off the wire; ``code`` is ``None`` for an empty (heartbeat) frame."""

    frame_type: int
    channel: int
    code: int | None
    fields: list[Any]
    payload: bytes


async def read_frame(reader: asyncio.StreamReader, max_frame_size: int) -> RawFrame:
    """Read and decode one frame (raises ``asyncio.IncompleteReadError`` on EOF)."""
    header = await reader.readexactly(8)
    size, doff, frame_type, channel = struct.unpack(">IBBH", header)
    if size < 8 or size > max_frame_size or doff < 2:
        raise FramingError(f"bad frame header size={size} doff={doff}")
    body = await reader.readexactly(size - 8)
    body = body[doff * 4 - 8 :]
    if not body:
        return RawFrame(frame_type, channel, None, [], b"")
    try:
        performative, end = decode_value(body, 0)
    except DecodeError as exc:
        raise FramingError(f"undecodable performative: {exc}") from exc
    if not isinstance(performative, Described) or not isinstance(performative.value, list):
        raise FramingError(f"frame body is not a performative: {performative!r}")
    return RawFrame(frame_type, channel, int(performative.descriptor), performative.value, body[end:])


def encode_frame(
    channel: int, code: int, fields: list[Any], payload: bytes = b"", frame_type: int = FRAME_TYPE_AMQP
) -> bytes:
    """Encode a performative frame; trailing ``None`` fields are dropped."""
    trimmed = list(fields)
    while trimmed and trimmed[-1] is None:
        trimmed.pop()
    body = encode_value(Described(ULong(code), trimmed))
    return struct.pack(">IBBH", 8 + len(body) + len(payload), 2, frame_type, channel) + body + payload


def empty_frame() -> bytes:
    """A heartbeat frame."""
    return struct.pack(">IBBH", 8, 2, FRAME_TYPE_AMQP, 0)


def transfer_overhead(fields: list[Any]) -> int:
    """Bytes taken by a transfer frame with no payload (used to split large deliveries)."""
    return len(encode_frame(0, TRANSFER, fields))


def get(fields: list[Any], index: int, default: Any = None) -> Any:
    """Field ``index`` of a decoded performative, or ``default`` when absent or null."""
    if index < len(fields) and fields[index] is not None:
        return fields[index]
    return default


def amqp_error(condition: str, description: str | None = None, info: dict[Any, Any] | None = None) -> Described:
    """The AMQP ``error`` type."""
    fields: list[Any] = [Symbol(condition), description, info]
    while fields and fields[-1] is None:
        fields.pop()
    return Described(ULong(ERROR), fields)


@dataclass
class ErrorInfo:
    """A decoded ``error``."""

    condition: str
    description: str | None
    info: dict[Any, Any]

    @classmethod
    def from_value(cls, value: Any) -> ErrorInfo | None:
        if not isinstance(value, Described) or not isinstance(value.value, list):
            return None
        fields = value.value
        info = get(fields, 2, {})
        return cls(str(get(fields, 0, "")), get(fields, 1), info if isinstance(info, dict) else {})


@dataclass
class Terminus:
    """A decoded ``source`` or ``target`` (only what the broker needs)."""

    address: str | None
    filters: dict[Any, Any]
    raw: Described

    @classmethod
    def from_value(cls, value: Any) -> Terminus | None:
        if not isinstance(value, Described) or not isinstance(value.value, list):
            return None
        fields = value.value
        address = get(fields, 0)
        filters = get(fields, 7, {}) if int(value.descriptor) == SOURCE else {}
        return cls(None if address is None else str(address), filters if isinstance(filters, dict) else {}, value)


@dataclass
class Open:
    container_id: str
    max_frame_size: int
    channel_max: int
    idle_timeout_ms: int | None

    @classmethod
    def from_fields(cls, f: list[Any]) -> Open:
        return cls(str(get(f, 0, "")), int(get(f, 2, 0xFFFFFFFF)), int(get(f, 3, 0xFFFF)), get(f, 4))


@dataclass
class Begin:
    remote_channel: int | None
    next_outgoing_id: int
    incoming_window: int
    outgoing_window: int
    handle_max: int

    @classmethod
    def from_fields(cls, f: list[Any]) -> Begin:
        return cls(get(f, 0), int(get(f, 1, 0)), int(get(f, 2, 0)), int(get(f, 3, 0)), int(get(f, 4, 0xFFFFFFFF)))


@dataclass
class Attach:
    name: str
    handle: int
    role: bool
    snd_settle_mode: int
    rcv_settle_mode: int
    source: Terminus | None
    target: Terminus | None
    initial_delivery_count: int | None
    properties: dict[Any, Any]

    @classmethod
    def from_fields(cls, f: list[Any]) -> Attach:
        properties = get(f, 13, {})
        return cls(
            name=str(get(f, 0, "")),
            handle=int(get(f, 1, 0)),
            role=bool(get(f, 2, False)),
            snd_settle_mode=int(get(f, 3, SND_MIXED)),
            rcv_settle_mode=int(get(f, 4, RCV_FIRST)),
            source=Terminus.from_value(get(f, 5)),
            target=Terminus.from_value(get(f, 6)),
            initial_delivery_count=get(f, 9),
            properties=properties if isinstance(properties, dict) else {},
        )


@dataclass
class Flow:
    next_incoming_id: int | None
    incoming_window: int
    next_outgoing_id: int
    outgoing_window: int
    handle: int | None
    delivery_count: int | None
    link_credit: int | None
    available: int | None
    drain: bool
    echo: bool

    @classmethod
    def from_fields(cls, f: list[Any]) -> Flow:
        return cls(
            get(f, 0),
            int(get(f, 1, 0)),
            int(get(f, 2, 0)),
            int(get(f, 3, 0)),
            get(f, 4),
            get(f, 5),
            get(f, 6),
            get(f, 7),
            bool(get(f, 8, False)),
            bool(get(f, 9, False)),
        )


@dataclass
class Transfer:
    handle: int
    delivery_id: int | None
    delivery_tag: bytes | None
    message_format: int | None
    settled: bool | None
    more: bool
    aborted: bool

    @classmethod
    def from_fields(cls, f: list[Any]) -> Transfer:
        return cls(
            int(get(f, 0, 0)),
            get(f, 1),
            get(f, 2),
            get(f, 3),
            get(f, 4),
            bool(get(f, 5, False)),
            bool(get(f, 9, False)),
        )


@dataclass
class Disposition:
    role: bool
    first: int
    last: int
    settled: bool
    state: Described | None

    @classmethod
    def from_fields(cls, f: list[Any]) -> Disposition:
        first = int(get(f, 1, 0))
        state = get(f, 4)
        return cls(
            bool(get(f, 0, False)),
            first,
            int(get(f, 2, first)),
            bool(get(f, 3, False)),
            state if isinstance(state, Described) else None,
        )


@dataclass
class Detach:
    handle: int
    closed: bool
    error: ErrorInfo | None

    @classmethod
    def from_fields(cls, f: list[Any]) -> Detach:
        return cls(int(get(f, 0, 0)), bool(get(f, 1, False)), ErrorInfo.from_value(get(f, 2)))


def outcome_code(state: Described | None) -> int | None:
    """The descriptor code of a delivery state, or ``None``."""
    if state is None:
        return None
    descriptor = state.descriptor
    if isinstance(descriptor, int):
        return int(descriptor)
    names = {"amqp:accepted:list": ACCEPTED, "amqp:rejected:list": REJECTED, "amqp:released:list": RELEASED}
    names["amqp:modified:list"] = MODIFIED
    return names.get(str(descriptor))
