"""AMQP 1.0 type system: encoder and decoder (OASIS AMQP 1.0, part 1 "Types").

Implemented: every primitive type of the specification (null, boolean, the signed and unsigned
integers, float, double, decimal32/64/128 as opaque bytes, char, timestamp, uuid, binary, string,
symbol, list, map, array) and described types.

Python representation (used for both directions, so decoded values re-encode to the same type):

* ``None``, ``bool``, ``str`` (string), ``bytes`` (binary), ``float`` (double), ``uuid.UUID``,
  ``list``, ``dict`` map their natural AMQP type; plain ``int`` encodes as ``long``.
* Width-specific integers and other AMQP types use the ``int`` / ``str`` / ``float`` subclasses
  below (``UInt``, ``ULong``, ``Symbol``, ``Timestamp`` ...); the decoder always returns them.
* ``Described(descriptor, value)`` for described types, ``Array(code, items)`` for arrays,
  ``Opaque(code, raw)`` for decimals (never interpreted by the broker).

``skip_value`` returns where an encoded value ends without decoding it, so callers can copy raw
encodings byte for byte (the broker stores message sections it does not modify verbatim).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, field
from typing import Any


class Symbol(str):
    """AMQP ``symbol`` (ASCII)."""


class Char(str):
    """AMQP ``char`` (one UTF-32 code point)."""


class UByte(int):
    """AMQP ``ubyte``."""


class UShort(int):
    """AMQP ``ushort``."""


class UInt(int):
    """AMQP ``uint``."""


class ULong(int):
    """AMQP ``ulong``."""


class Byte(int):
    """AMQP ``byte``."""


class Short(int):
    """AMQP ``short``."""


class Int(int):
    """AMQP ``int``."""


class Long(int):
    """AMQP ``long`` (plain ``int`` encodes the same way)."""


class Timestamp(int):
    """AMQP ``timestamp``: milliseconds since the Unix epoch."""


class Float(float):
    """AMQP ``float`` (32 bit); plain ``float`` encodes as ``double``."""


@dataclass(frozen=True)
class Described:
    """A described type: ``descriptor`` is usually a ``ULong`` code or a ``Symbol``."""

    descriptor: Any
    value: Any


@dataclass
class Array:
    """AMQP ``array``: ``code`` is the element constructor (e.g. ``0xA3`` for symbols)."""

    code: int
    items: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Opaque:
    """A value the broker does not interpret (decimals), kept as constructor + raw bytes."""

    code: int
    raw: bytes


class DecodeError(ValueError):
    """Raised on malformed AMQP encodings."""


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

_FIXED_WIDTH = {
    0x40: 0, 0x41: 0, 0x42: 0, 0x43: 0, 0x44: 0, 0x45: 0,
    0x50: 1, 0x51: 1, 0x52: 1, 0x53: 1, 0x54: 1, 0x55: 1, 0x56: 1,
    0x60: 2, 0x61: 2,
    0x70: 4, 0x71: 4, 0x72: 4, 0x73: 4, 0x74: 4,
    0x80: 8, 0x81: 8, 0x82: 8, 0x83: 8, 0x84: 8,
    0x94: 16, 0x98: 16,
}  # fmt: skip


def _check(buf: bytes | memoryview, end: int) -> None:
    if end > len(buf):
        raise DecodeError(f"truncated AMQP value: need {end} bytes, have {len(buf)}")


def skip_value(buf: bytes | memoryview, pos: int) -> int:
    """Return the offset just past the encoded value starting at ``pos``."""
    _check(buf, pos + 1)
    code = buf[pos]
    pos += 1
    if code == 0x00:
        pos = skip_value(buf, pos)  # descriptor
        return skip_value(buf, pos)
    if code in _FIXED_WIDTH:
        end = pos + _FIXED_WIDTH[code]
        _check(buf, end)
        return end
    width = code >> 4
    if width in (0xA, 0xC, 0xE):
        _check(buf, pos + 1)
        end = pos + 1 + buf[pos]
    elif width in (0xB, 0xD, 0xF):
        _check(buf, pos + 4)
        end = pos + 4 + struct.unpack_from(">I", buf, pos)[0]
    else:
        raise DecodeError(f"unknown AMQP constructor 0x{code:02x}")
    _check(buf, end)
    return end


def decode_value(buf: bytes | memoryview, pos: int = 0) -> tuple[Any, int]:
    """Decode one value at ``pos``; return ``(value, offset after it)``."""
    _check(buf, pos + 1)
    code = buf[pos]
    pos += 1
    if code == 0x00:
        descriptor, pos = decode_value(buf, pos)
        value, pos = decode_value(buf, pos)
        return Described(descriptor, value), pos
    return _decode_body(buf, code, pos)


def _decode_body(buf: bytes | memoryview, code: int, pos: int) -> tuple[Any, int]:
    if code in _FIXED_WIDTH:
        end = pos + _FIXED_WIDTH[code]
        _check(buf, end)
        if code == 0x40:
            return None, end
        if code == 0x41:
            return True, end
        if code == 0x42:
            return False, end
        if code == 0x56:
            return buf[pos] != 0, end
        if code == 0x43:
            return UInt(0), end
        if code == 0x44:
            return ULong(0), end
        if code == 0x45:
            return [], end
        if code == 0x50:
            return UByte(buf[pos]), end
        if code == 0x51:
            return Byte(struct.unpack_from(">b", buf, pos)[0]), end
        if code == 0x52:
            return UInt(buf[pos]), end
        if code == 0x53:
            return ULong(buf[pos]), end
        if code == 0x54:
            return Int(struct.unpack_from(">b", buf, pos)[0]), end
        if code == 0x55:
            return Long(struct.unpack_from(">b", buf, pos)[0]), end
        if code == 0x60:
            return UShort(struct.unpack_from(">H", buf, pos)[0]), end
        if code == 0x61:
            return Short(struct.unpack_from(">h", buf, pos)[0]), end
        if code == 0x70:
            return UInt(struct.unpack_from(">I", buf, pos)[0]), end
        if code == 0x71:
            return Int(struct.unpack_from(">i", buf, pos)[0]), end
        if code == 0x72:
            return Float(struct.unpack_from(">f", buf, pos)[0]), end
        if code == 0x73:
            return Char(chr(struct.unpack_from(">I", buf, pos)[0])), end
        if code == 0x80:
            return ULong(struct.unpack_from(">Q", buf, pos)[0]), end
        if code == 0x81:
            return Long(struct.unpack_from(">q", buf, pos)[0]), end
        if code == 0x82:
            return struct.unpack_from(">d", buf, pos)[0], end
        if code == 0x83:
            return Timestamp(struct.unpack_from(">q", buf, pos)[0]), end
        if code == 0x98:
            return uuid.UUID(bytes=bytes(buf[pos:end])), end
        return Opaque(code, bytes(buf[pos:end])), end  # decimal32/64/128
    if code in (0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xB3):
        if code < 0xB0:
            _check(buf, pos + 1)
            size, pos = buf[pos], pos + 1
        else:
            _check(buf, pos + 4)
            size, pos = struct.unpack_from(">I", buf, pos)[0], pos + 4
        end = pos + size
        _check(buf, end)
        raw = bytes(buf[pos:end])
        if code in (0xA0, 0xB0):
            return raw, end
        if code in (0xA1, 0xB1):
            return raw.decode("utf-8"), end
        return Symbol(raw.decode("ascii")), end
    if code in (0xC0, 0xC1, 0xD0, 0xD1):
        if code < 0xD0:
            _check(buf, pos + 2)
            size, count, pos = buf[pos], buf[pos + 1], pos + 2
            end = pos - 1 + size
        else:
            _check(buf, pos + 8)
            size, count = struct.unpack_from(">II", buf, pos)
            pos += 8
            end = pos - 4 + size
        _check(buf, end)
        items = []
        for _ in range(count):
            item, pos = decode_value(buf, pos)
            items.append(item)
        if pos != end:
            raise DecodeError("compound size does not match its content")
        if code in (0xC0, 0xD0):
            return items, end
        if count % 2:
            raise DecodeError("map with an odd number of elements")
        return {items[i]: items[i + 1] for i in range(0, count, 2)}, end
    if code in (0xE0, 0xF0):
        if code == 0xE0:
            _check(buf, pos + 2)
            size, count, pos = buf[pos], buf[pos + 1], pos + 2
            end = pos - 1 + size
        else:
            _check(buf, pos + 8)
            size, count = struct.unpack_from(">II", buf, pos)
            pos += 8
            end = pos - 4 + size
        _check(buf, end + 0)
        descriptor: Any = None
        described = buf[pos] == 0x00
        if described:
            descriptor, pos = decode_value(buf, pos + 1)
        element_code = buf[pos]
        pos += 1
        elements: list[Any] = []
        for _ in range(count):
            element, pos = _decode_body(buf, element_code, pos)
            elements.append(Described(descriptor, element) if described else element)
        if pos != end:
            raise DecodeError("array size does not match its content")
        return Array(element_code, elements), end
    raise DecodeError(f"unknown AMQP constructor 0x{code:02x}")


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def encode_value(value: Any) -> bytes:
    """Encode one Python value (see module docstring for the mapping)."""
    out = bytearray()
    _encode(out, value)
    return bytes(out)


def _vbin(out: bytearray, small: int, large: int, raw: bytes) -> None:
    if len(raw) <= 255:
        out.append(small)
        out.append(len(raw))
    else:
        out.append(large)
        out += struct.pack(">I", len(raw))
    out += raw


def _compound(out: bytearray, small: int, large: int, items: list[Any]) -> None:
    body = bytearray()
    for item in items:
        _encode(body, item)
    if len(body) + 1 <= 255 and len(items) <= 255:
        out.append(small)
        out.append(len(body) + 1)
        out.append(len(items))
    else:
        out.append(large)
        out += struct.pack(">II", len(body) + 4, len(items))
    out += body


def _encode(out: bytearray, value: Any) -> None:
    if value is None:
        out.append(0x40)
    elif isinstance(value, bool):
        out.append(0x41 if value else 0x42)
    elif isinstance(value, int):
        _encode_int(out, value)
    elif isinstance(value, Float):
        out.append(0x72)
        out += struct.pack(">f", value)
    elif isinstance(value, float):
        out.append(0x82)
        out += struct.pack(">d", value)
    elif isinstance(value, Symbol):
        _vbin(out, 0xA3, 0xB3, value.encode("ascii"))
    elif isinstance(value, Char):
        out.append(0x73)
        out += struct.pack(">I", ord(value))
    elif isinstance(value, str):
        _vbin(out, 0xA1, 0xB1, value.encode("utf-8"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _vbin(out, 0xA0, 0xB0, bytes(value))
    elif isinstance(value, uuid.UUID):
        out.append(0x98)
        out += value.bytes
    elif isinstance(value, Described):
        out.append(0x00)
        _encode(out, value.descriptor)
        _encode(out, value.value)
    elif isinstance(value, list):
        if not value:
            out.append(0x45)
        else:
            _compound(out, 0xC0, 0xD0, value)
    elif isinstance(value, dict):
        flat: list[Any] = []
        for key, item in value.items():
            flat.append(key)
            flat.append(item)
        _compound(out, 0xC1, 0xD1, flat)
    elif isinstance(value, Array):
        _encode_array(out, value)
    elif isinstance(value, Opaque):
        out.append(value.code)
        out += value.raw
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as AMQP")


def _encode_int(out: bytearray, value: int) -> None:
    if isinstance(value, UByte):
        out += struct.pack(">BB", 0x50, value)
    elif isinstance(value, UShort):
        out += struct.pack(">BH", 0x60, value)
    elif isinstance(value, UInt):
        if value == 0:
            out.append(0x43)
        elif value <= 255:
            out += struct.pack(">BB", 0x52, value)
        else:
            out += struct.pack(">BI", 0x70, value)
    elif isinstance(value, ULong):
        if value == 0:
            out.append(0x44)
        elif value <= 255:
            out += struct.pack(">BB", 0x53, value)
        else:
            out += struct.pack(">BQ", 0x80, value)
    elif isinstance(value, Byte):
        out += struct.pack(">Bb", 0x51, value)
    elif isinstance(value, Short):
        out += struct.pack(">Bh", 0x61, value)
    elif isinstance(value, Int):
        if -128 <= value <= 127:
            out += struct.pack(">Bb", 0x54, value)
        else:
            out += struct.pack(">Bi", 0x71, value)
    elif isinstance(value, Timestamp):
        out += struct.pack(">Bq", 0x83, value)
    elif -128 <= value <= 127:
        out += struct.pack(">Bb", 0x55, value)
    else:
        out += struct.pack(">Bq", 0x81, value)


_ARRAY_ELEMENT_FORMAT = {
    0x50: ">B", 0x51: ">b", 0x56: ">B", 0x60: ">H", 0x61: ">h", 0x70: ">I", 0x71: ">i",
    0x72: ">f", 0x80: ">Q", 0x81: ">q", 0x82: ">d", 0x83: ">q",
}  # fmt: skip


def _encode_array(out: bytearray, array: Array) -> None:
    """Encode an array; variable-width elements always use their 32-bit width constructor."""
    code = array.code
    body = bytearray()
    if code in (0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xB3):
        code = code | 0x10  # str32 / sym32 / vbin32
        body.append(code)
        for item in array.items:
            raw = item.encode("ascii" if code == 0xB3 else "utf-8") if isinstance(item, str) else bytes(item)
            body += struct.pack(">I", len(raw)) + raw
    elif code == 0x98:
        body.append(code)
        for item in array.items:
            body += item.bytes
    elif code in _ARRAY_ELEMENT_FORMAT:
        body.append(code)
        for item in array.items:
            body += struct.pack(_ARRAY_ELEMENT_FORMAT[code], item)
    elif code in (0xC0, 0xC1, 0xD0, 0xD1):
        code = 0xD0 if code in (0xC0, 0xD0) else 0xD1
        body.append(code)
        for item in array.items:
            flat = _flatten(item)
            encoded = bytearray()
            for element in flat:
                _encode(encoded, element)
            body += struct.pack(">II", len(encoded) + 4, len(flat)) + encoded
    else:
        raise TypeError(f"unsupported array element constructor 0x{code:02x}")
    out.append(0xF0)
    out += struct.pack(">II", len(body) + 4, len(array.items))
    out += body


def _flatten(item: Any) -> list[Any]:
    if isinstance(item, dict):
        flat: list[Any] = []
        for key, value in item.items():
            flat.extend((key, value))
        return flat
    return list(item)


def symbol_array(*names: str) -> Array:
    """Convenience: an array of symbols."""
    return Array(0xA3, [Symbol(name) for name in names])
