"""
What a dead-lettered message carries besides its own data, the same on every broker: the original
attributes (headers, properties) first and never dropped, then ``x-dead-letter-*`` fields saying
why, from where and which message, as many as the broker's attribute limit leaves room for.

The ``x-dead-letter-*`` names belong to the provider: on a dead-letter copy they are only ever the
provider's own fields. A sender's attribute under such a name (a forged reason, or the fields of an
earlier dead-lettering when a DLQ is replayed) is kept but renamed ``x-original-<name>``
(:func:`disown_dead_letter_names`), so a DLQ consumer can trust what the names say.
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
ORIGINAL_PREFIX: Final = "x-original-"
"""Put in front of a sender's ``x-dead-letter-*`` attribute name on a dead-letter copy."""


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


def disown_dead_letter_names(attributes: Mapping[str, V], *, max_name_bytes: int) -> dict[str, V]:
    """
    ``attributes`` (in order) with every name that starts with ``x-dead-letter-`` (any case)
    renamed ``x-original-<name>``, prefixed again while that name is taken, so none is lost to a
    collision. A renamed name longer than ``max_name_bytes`` in UTF-8 (the broker's limit) is
    dropped: sending it would fail the whole batch, and it is a claim of the sender's, not data.
    """
    renamed: dict[str, V] = {}
    for name, value in attributes.items():
        if name.lower().startswith(PREFIX):
            new_name = ORIGINAL_PREFIX + name
            while new_name in attributes or new_name in renamed:
                new_name = ORIGINAL_PREFIX + new_name
            if len(new_name.encode("utf-8", "surrogatepass")) > max_name_bytes:
                continue
            renamed[new_name] = value
        else:
            renamed[name] = value
    return renamed


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
