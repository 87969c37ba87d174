"""
Sender-controlled text (message ids, session ids, correlation ids, reasons quoting a message) made
safe for a plain-text log line.

A sender picks these strings. Printed as they are, a CR/LF starts a forged log line ("... INFO
message 1 completed"), other control characters reach the terminal of whoever tails the log, and
a megabyte id floods it. :func:`log_safe` escapes every character that can break a line or hide
text and cuts the result to ``limit`` characters, saying how much was cut. Not for the envelope or
the broker: watchers and dead-letter copies keep the original text.
"""

from __future__ import annotations

import re
from typing import Final

DEFAULT_LIMIT: Final = 200
"""Characters of sender text a log line shows by default (escapes included)."""
REASON_LOG_LIMIT: Final = 1024
"""Characters of a reject / dead-letter reason a log line shows (a reason may quote the message)."""

# C0 and C1 controls (CR, LF, ESC, NUL, ...), DEL, Unicode line / paragraph separators and the
# bidirectional overrides and isolates (they make a log line read differently from what it holds);
# and the backslash itself, so an escape the sender typed cannot pass for one made here.
_UNSAFE: Final = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
_NAMED: Final = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def log_safe(text: object, limit: int = DEFAULT_LIMIT) -> str:
    """
    ``text`` (``str()`` of it when not a string) on one line: line breaks and other control
    characters escaped (``\\n``, ``\\x1b``, ``\\u2028``; a backslash doubled), cut to ``limit``
    characters with ``...(+N chars)`` saying how many of the escaped text were dropped.
    """
    escaped = _UNSAFE.sub(_escape, text if isinstance(text, str) else str(text))
    if len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}...(+{len(escaped) - limit} chars)"
