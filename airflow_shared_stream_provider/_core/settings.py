"""
Producer settings: the single source of a shared stream's key.

Each broker declares one frozen dataclass holding **every** value its producer reads. The trigger
builds it from its arguments, ``shared_stream_key()`` is derived from it field by field, and the
producer is constructed from it and nothing else. So the key covers every producer setting by
construction: siblings that differ in any of them get distinct keys (and distinct producers),
never a silent "first subscriber wins". Watcher-side fields (``match``, ``filter_function``,
``on_filter_error``) live on the trigger, not here, so a subclass that only filters shares the
stream with its siblings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any, ClassVar, final

from airflow_shared_stream_provider._core.batching import DEFAULT_BATCH_TIMEOUT, MAX_BATCH_SIZE
from airflow_shared_stream_provider._core.dispositions import DEFAULT_MAX_DELIVERY_ATTEMPTS
from airflow_shared_stream_provider._core.envelope import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    OVERSIZE_POLICIES,
    OversizePolicy,
)
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.flow import DEFAULT_MAX_IN_FLIGHT_BYTES
from airflow_shared_stream_provider.brokers import BrokerName

# Below this a budget would hold about one message at a time even for small messages.
MIN_IN_FLIGHT_BYTES = 64 * 1024

# A settings field's type -> whether None is allowed. Every field typed ``str`` or ``str | None``
# is text that must not be empty: the type says so once, and the base checks it (a broker's class
# writes no check of its own). Both forms: the annotation is a string under ``from __future__
# import annotations``, a type without it.
_TEXT_TYPES: dict[Any, bool] = {"str": False, str: False, "str | None": True, str | None: True}


def _freeze(value: Any) -> Hashable:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSettings:
    """Settings every broker's producer reads."""

    broker: ClassVar[BrokerName]

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    oversize_policy: OversizePolicy = "dead_letter"
    max_delivery_attempts: int | None = DEFAULT_MAX_DELIVERY_ATTEMPTS
    max_in_flight: int = 10_000
    # Bytes of messages in flight (raw bodies, attributes and envelopes, estimated; see
    # _core/flow.py). 64 MiB: six maximum-size Pub/Sub messages (10 MB), one Service Bus Premium
    # message (100 MB) at a time, while messages up to ~2.8 KB still reach max_in_flight first.
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES
    # Batch mode (see _core/batching.py): a producer setting, because the batch is the raw event
    # every watcher's event is bound to; 1 keeps one envelope per asset event.
    batch_size: int = 1
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT

    @final  # a broker's settings class writes check() (below) instead
    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            allow_none = _TEXT_TYPES.get(f.type)
            if allow_none is not None:
                self.require_text(f.name, getattr(self, f.name), allow_none=allow_none)
        if not isinstance(self.max_payload_bytes, int) or self.max_payload_bytes < 1024:
            raise SharedStreamConfigError(f"max_payload_bytes must be an int >= 1024, got {self.max_payload_bytes!r}")
        if self.oversize_policy not in OVERSIZE_POLICIES:
            raise SharedStreamConfigError(
                f"oversize_policy must be one of {OVERSIZE_POLICIES}, got {self.oversize_policy!r}"
            )
        if self.max_delivery_attempts is not None and (
            not isinstance(self.max_delivery_attempts, int) or self.max_delivery_attempts < 1
        ):
            raise SharedStreamConfigError(
                f"max_delivery_attempts must be a positive int or None, got {self.max_delivery_attempts!r}"
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise SharedStreamConfigError(f"max_in_flight must be a positive int, got {self.max_in_flight!r}")
        if isinstance(self.max_in_flight_bytes, bool) or not isinstance(self.max_in_flight_bytes, int):
            raise SharedStreamConfigError(f"max_in_flight_bytes must be an int, got {self.max_in_flight_bytes!r}")
        self.require_number("max_in_flight_bytes", self.max_in_flight_bytes, minimum=MIN_IN_FLIGHT_BYTES)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise SharedStreamConfigError(f"batch_size must be an int, got {self.batch_size!r}")
        self.require_number("batch_size", self.batch_size, minimum=1, maximum=MAX_BATCH_SIZE)
        self.require_number("batch_timeout", self.batch_timeout, minimum=0, maximum=60)
        self.check()

    def check(self) -> None:
        """
        The broker's own checks, run after the ones above (every broker's settings, and every
        text field by its type). A broker overrides this, not ``__post_init__``: the common checks
        then cannot be skipped by a subclass that forgets to call them.
        """

    def position_scope(self) -> Hashable | None:
        """
        What a watcher's stored position is relative to (see _core/positions.py), or None when this
        stream keeps no watcher positions (queues: the broker tracks each message itself).
        """
        return None

    def key(self) -> tuple[Hashable, ...]:
        """Every field, in declaration order, as a hashable tuple of ``(name, value)``."""
        return tuple((f.name, _freeze(getattr(self, f.name))) for f in dataclasses.fields(self))

    def to_kwargs(self) -> dict[str, Any]:
        """JSON-safe kwargs (lists, not tuples) for ``serialize()``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @staticmethod
    def require_text(name: str, value: Any, *, allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        if not isinstance(value, str) or not value.strip():
            raise SharedStreamConfigError(f"{name} must be a non-empty string, got {value!r}")

    @staticmethod
    def require_number(name: str, value: Any, *, minimum: float, maximum: float | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise SharedStreamConfigError(f"{name} must be a number >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise SharedStreamConfigError(f"{name} must be <= {maximum}, got {value!r}")
