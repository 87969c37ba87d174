"""
What a dead-lettered message carries besides its own data, the same on every broker: the original
attributes (headers, properties) first and never dropped, then ``x-dead-letter-*`` fields saying
why, from where and which message, as many as the broker's attribute limit leaves room for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

V = TypeVar("V")

PREFIX: Final = "x-dead-letter-"
REASON: Final = PREFIX + "reason"
SOURCE: Final = PREFIX + "source"
MESSAGE_ID: Final = PREFIX + "message-id"


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
