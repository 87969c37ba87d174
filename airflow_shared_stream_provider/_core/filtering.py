"""
Per-watcher, serializable message filters.

Trigger kwargs live in the metadata DB, so filters are data, not callables:

* ``match``: ``{"body.region": "eu", "attributes.type": ["order", "refund"]}``. Keys are dotted
  paths into the envelope (an integer segment indexes a list); a scalar value means equality, a
  list means "any of". All keys must match. A missing path never matches.
* ``filter_function``: ``"package.module.function"``, imported in the triggerer, called with the
  envelope; returns truthy to fire, falsy to skip, or raises
  :class:`~airflow_shared_stream_provider.RejectMessage` to dead-letter the message.

``match`` runs first (it is cheap), the function only on messages that matched.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

FilterErrorPolicy = Literal["reject", "skip", "fail"]
FILTER_ERROR_POLICIES: Final = ("reject", "skip", "fail")
_SCALARS = (str, int, float, bool, type(None))
_MISSING: Final = object()

EnvelopePredicate = Callable[[Mapping[str, Any]], Any]


class _Clause:
    """One compiled ``match`` entry: a path split once, and the allowed values as a set or list."""

    __slots__ = ("allowed", "allowed_list", "path", "segments")

    def __init__(self, path: str, expected: Any) -> None:
        self.path = path
        self.segments: tuple[str | int, ...] = tuple(int(part) if part.isdigit() else part for part in path.split("."))
        values = list(expected) if isinstance(expected, list | tuple) else [expected]
        # Hashable values go in a set for O(1) membership; 1 == True in Python, so bools are kept
        # apart from ints by pairing each value with its type.
        self.allowed: frozenset[tuple[type, Any]] = frozenset((type(v), v) for v in values)
        self.allowed_list = values

    def matches(self, envelope: Mapping[str, Any]) -> bool:
        node: Any = envelope
        for segment in self.segments:
            if isinstance(segment, int) and isinstance(node, list):
                if segment >= len(node):
                    return False
                node = node[segment]
            elif isinstance(node, Mapping):
                node = node.get(segment if isinstance(segment, str) else str(segment), _MISSING)
                if node is _MISSING:
                    return False
            else:
                return False
        if isinstance(node, _SCALARS):
            kind = float if isinstance(node, int) and not isinstance(node, bool) else type(node)
            if (type(node), node) in self.allowed:
                return True
            # 3 == 3.0 for JSON numbers: compare ints and floats by value.
            return kind is float and any(
                isinstance(v, int | float) and not isinstance(v, bool) and v == node for v in self.allowed_list
            )
        return False


def validate_match(match: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check a ``match`` spec at Dag parse time and return it as a plain JSON-safe dict."""
    if match is None:
        return None
    if not isinstance(match, Mapping):
        raise SharedStreamConfigError(f"match must be a dict of dotted path -> value(s), got {type(match).__name__}")
    cleaned: dict[str, Any] = {}
    for path, expected in match.items():
        if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
            raise SharedStreamConfigError(f"match key {path!r} must be a dotted path like 'body.region'")
        values = expected if isinstance(expected, list | tuple) else [expected]
        for value in values:
            if not isinstance(value, _SCALARS):
                raise SharedStreamConfigError(
                    f"match[{path!r}] values must be str/int/float/bool/None (or a list of them), "
                    f"got {type(value).__name__}"
                )
        if isinstance(expected, list | tuple) and not expected:
            raise SharedStreamConfigError(f"match[{path!r}] is an empty list: it could never match")
        cleaned[path] = list(expected) if isinstance(expected, list | tuple) else expected
    return cleaned


def validate_filter_function(path: str | None) -> str | None:
    """Check the shape of a ``filter_function`` dotted path (importing happens in the triggerer)."""
    if path is None:
        return None
    if not isinstance(path, str) or "." not in path or any(not part.isidentifier() for part in path.split(".")):
        raise SharedStreamConfigError(f"filter_function must be a dotted path 'package.module.function', got {path!r}")
    return path


def import_callable(path: str) -> EnvelopePredicate:
    """Import ``package.module.function``; a clear error names what could not be found."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SharedStreamConfigError(f"filter_function {path!r}: cannot import module {module_name!r}: {exc}") from exc
    func = getattr(module, attr, None)
    if func is None or not callable(func):
        raise SharedStreamConfigError(f"filter_function {path!r}: {module_name!r} has no callable {attr!r}")
    return func  # type: ignore[no-any-return]


class MessageFilter:
    """A compiled ``match`` + ``filter_function`` pair. ``decide`` may raise what the function raises."""

    __slots__ = ("_clauses", "_function", "_function_path")

    def __init__(self, match: Mapping[str, Any] | None, filter_function: str | None) -> None:
        spec = validate_match(match) or {}
        self._clauses: Sequence[_Clause] = tuple(_Clause(path, expected) for path, expected in spec.items())
        self._function_path = validate_filter_function(filter_function)
        self._function: EnvelopePredicate | None = None

    def matches(self, envelope: Mapping[str, Any]) -> bool:
        # A plain loop, not all(<generator>): this runs per message per watcher.
        for clause in self._clauses:  # noqa: SIM110
            if not clause.matches(envelope):
                return False
        return True

    def decide(self, envelope: Mapping[str, Any]) -> bool:
        """True to fire. Raises whatever ``filter_function`` raises (RejectMessage included)."""
        if self._clauses and not self.matches(envelope):
            return False
        if self._function_path is None:
            return True
        if self._function is None:
            self._function = import_callable(self._function_path)
        return bool(self._function(envelope))
