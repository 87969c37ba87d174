"""
What a dead-lettered message carries besides its own data, the same on every broker: the original
attributes (headers, properties) first and never dropped, then ``x-dead-letter-*`` fields saying
why, from where and which message, as many as the broker's attribute limit leaves room for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final, TypeVar

V = TypeVar("V")

PREFIX: Final = "x-dead-letter-"
REASON: Final = PREFIX + "reason"
SOURCE: Final = PREFIX + "source"
MESSAGE_ID: Final = PREFIX + "message-id"


# Characters XML 1.0 allows, which SQS requires of message attribute values (anything else makes
# SendMessage fail for the whole batch); found by the fuzz tests with a NUL in a filter's reason.
_NOT_XML_CHAR: Final = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str) -> str:
    """``text`` with every character XML 1.0 (and so SQS) refuses replaced by U+FFFD."""
    return _NOT_XML_CHAR.sub("\ufffd", text)


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding fits ``max_bytes`` (never a cut character)."""
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", "ignore")


def dead_letter_fields(*, reason: str, source: str, message_id: str, **more: str) -> dict[str, str]:
    """
    The ``x-dead-letter-*`` fields, most important first: reason, source, message id, then ``more``
    (``delivery_attempt="3"`` becomes ``x-dead-letter-delivery-attempt: 3``).
    """
    fields = {REASON: reason, SOURCE: source, MESSAGE_ID: message_id}
    for name, value in more.items():
        fields[PREFIX + name.replace("_", "-")] = value
    return fields


def add_within_limit(attributes: dict[str, V], extra: Mapping[str, V], *, limit: int, overwrite: bool) -> dict[str, V]:
    """
    Add ``extra`` to ``attributes`` in order while fewer than ``limit`` attributes are set; the
    original attributes are never dropped. ``overwrite``: whether an extra field replaces an
    original attribute of the same name (a message dead-lettered a second time) or yields to it.
    """
    for name, value in extra.items():
        if len(attributes) >= limit:
            break
        if overwrite:
            attributes[name] = value
        else:
            attributes.setdefault(name, value)
    return attributes
