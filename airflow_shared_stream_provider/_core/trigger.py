"""
The base of every shared-stream trigger (one per broker).

A trigger is what a Dag author writes in an ``AssetWatcher``; many of them share one producer in
the triggerer when their :class:`StreamSettings` are equal. This module imports no broker SDK: Dag
files import the trigger modules, and the SDK only loads in the triggerer, when the producer is
built.

What each watcher does with a message (``filter_shared_stream``), in order:

1. tells the flow gate it pulled the message (credit for the producer);
2. if the producer marked the message for forced rejection (oversize + ``dead_letter``), rejects;
3. runs :meth:`SharedStreamTrigger.accept` (``match`` then ``filter_function``):
   True -> yields ``TriggerEvent(envelope)``; False -> skips (the message counts as accepted by
   this watcher); :class:`RejectMessage` -> rejects with the given reason;
   any other exception -> ``on_filter_error``:

   * ``"reject"`` (default): logged with its traceback, and the message is rejected, so it is
     dead-lettered intact with the error as the reason. The watcher keeps running.
   * ``"skip"``: logged, the message is skipped for this watcher. The watcher keeps running.
   * ``"fail"``: the exception ends this watcher's trigger (Airflow's trigger failure path) and
     the message is redelivered (poison cap included). A watcher that leaves while sitting on a
     message resolves it as *accepted* in the manager (``_SharedStreamGroup.unsubscribe``), so the
     watcher first records the failure on the shared message, and the producer counts it as
     failed (:meth:`SharedStreamProducerBase.advance`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import reject_shared_stream_event

from airflow_shared_stream_provider._core.envelope import StreamMessage
from airflow_shared_stream_provider._core.errors import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider._core.filtering import (
    FILTER_ERROR_POLICIES,
    FilterErrorPolicy,
    MessageFilter,
    validate_filter_function,
    validate_match,
)
from airflow_shared_stream_provider._core.flow import gates
from airflow_shared_stream_provider._core.settings import StreamSettings

if TYPE_CHECKING:
    from airflow.triggers.shared_stream import SharedStreamProducer

log = logging.getLogger(__name__)

KEY_NAMESPACE = "airflow-shared-stream-provider"


class SharedStreamTrigger(BaseEventTrigger):
    """
    Base class: holds the producer settings and the watcher's filter; implements the shared path.

    Subclasses set :attr:`settings_class` and :attr:`producer_class_path` and define a typed
    ``__init__`` that builds the settings. Users may subclass a broker trigger and override
    :meth:`accept` or :meth:`make_event`; the subclass serializes under its own class path and,
    having the same settings, shares the stream with its siblings.
    """

    settings_class: ClassVar[type[StreamSettings]]
    producer_class_path: ClassVar[str]

    def __init__(
        self,
        *,
        settings: StreamSettings,
        match: Mapping[str, Any] | None = None,
        filter_function: str | None = None,
        on_filter_error: FilterErrorPolicy = "reject",
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if on_filter_error not in FILTER_ERROR_POLICIES:
            raise SharedStreamConfigError(
                f"on_filter_error must be one of {FILTER_ERROR_POLICIES}, got {on_filter_error!r}"
            )
        self.settings = settings
        self.match = validate_match(match)
        self.filter_function = validate_filter_function(filter_function)
        self.on_filter_error: FilterErrorPolicy = on_filter_error
        self._filter = MessageFilter(self.match, self.filter_function)

    # -- identity ------------------------------------------------------------------------------
    def serialize(self) -> tuple[str, dict[str, Any]]:
        cls = type(self)
        kwargs = self.settings.to_kwargs()
        kwargs.update(match=self.match, filter_function=self.filter_function, on_filter_error=self.on_filter_error)
        return f"{cls.__module__}.{cls.__qualname__}", kwargs

    def shared_stream_key(self) -> Hashable:
        """The stream identity plus every producer setting; never the watcher's filter."""
        return (KEY_NAMESPACE, self.settings.broker, self.settings.key())

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> SharedStreamProducer:
        trigger = cls(**kwargs)
        producer_cls = _import_producer(cls.producer_class_path)
        return producer_cls(trigger.settings, stream_key=trigger.shared_stream_key())  # type: ignore[no-any-return]

    # -- watcher side --------------------------------------------------------------------------
    def accept(self, envelope: Mapping[str, Any]) -> bool:
        """Return True to fire for this message. Override for custom filtering; may raise RejectMessage."""
        return self._filter.decide(envelope)

    def make_event(self, envelope: dict[str, Any]) -> TriggerEvent:
        """Build the TriggerEvent for an accepted message; its payload becomes the asset event extra."""
        return TriggerEvent(envelope)  # type: ignore[no-untyped-call]

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        key = self.shared_stream_key()
        # Registration happens before the first await, i.e. atomically with the manager's
        # subscribe (see _core/flow.py for why that matters).
        gate = gates.acquire(key)
        token = id(self)
        gate.register(token)
        try:
            async for message in shared_stream:
                if not isinstance(message, StreamMessage):
                    raise TypeError(f"{type(self).__name__} expects StreamMessage raw events, got {type(message)!r}")
                gate.consumed(token, message.seq)
                if message.forced_rejection is not None:
                    self._reject(message, message.forced_rejection)
                    continue
                try:
                    fire = self.accept(message.envelope)
                except RejectMessage as exc:
                    self._reject(message, exc.reason)
                    continue
                except Exception as exc:
                    if self.on_filter_error == "fail":
                        message.fail(f"filter raised {type(exc).__name__}: {exc}")
                        raise
                    log.exception(
                        "Filter raised on message %s (on_filter_error=%s)",
                        message.envelope.get("message_id"),
                        self.on_filter_error,
                    )
                    if self.on_filter_error == "reject":
                        self._reject(message, f"filter raised {type(exc).__name__}: {exc}")
                    continue
                if fire:
                    gate.fired += 1
                    yield self.make_event(message.envelope)
        finally:
            gate.unregister(token)
            gates.release(key, gate)

    def _reject(self, message: StreamMessage, reason: str) -> None:
        message.reject(reason)
        reject_shared_stream_event()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """
        Not supported: this trigger runs only through the triggerer's shared-stream manager.

        Committing safely needs the ack channel (advance only after persistence), which only the
        manager provides; ``shared_stream_key`` is never None, so the triggerer never calls this.
        """
        raise NotImplementedError(
            f"{type(self).__name__} runs only through the triggerer's shared-stream manager "
            "(Airflow >= 3.3); it has no standalone run() path"
        )
        yield  # pragma: no cover


def _import_producer(path: str) -> type:
    import importlib

    module_name, _, name = path.rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, name)  # type: ignore[no-any-return]
