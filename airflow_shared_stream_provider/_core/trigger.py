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

   The reason recorded for a filter exception (:func:`_describe_filter_error`) is at most
   :data:`MAX_FILTER_ERROR_CHARS` characters with no control characters: it becomes a
   dead-letter header or attribute on every broker, and a log line.

Before the first message, the watcher imports its ``filter_function`` in a worker thread: an
import on the event loop would stall every trigger of the triggerer, and a wrong path raises
:class:`SharedStreamConfigError` (naming the path and the import error) that ends this watcher
once; the messages it had not pulled are redelivered (the manager resolves them as failed).
With ``filter_mode="thread"`` the decision itself runs off the loop too (see ``_core/filtering.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypedDict

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import reject_shared_stream_event

from airflow_shared_stream_provider._core.airflow_internals import force_failures
from airflow_shared_stream_provider._core.batching import MessageBatch
from airflow_shared_stream_provider._core.binding import current_window, was_bound
from airflow_shared_stream_provider._core.cohort import cohort_record_enabled, identity_of, record_key, stores_of
from airflow_shared_stream_provider._core.envelope import UNRECORDED, OversizePolicy, StreamMessage
from airflow_shared_stream_provider._core.errors import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider._core.events import StreamTriggerEvent
from airflow_shared_stream_provider._core.filtering import (
    FILTER_ERROR_POLICIES,
    FILTER_MODES,
    FilterErrorPolicy,
    FilterMode,
    FilterStuckError,
    MessageFilter,
    ThreadedDecider,
    validate_filter_function,
    validate_match,
)
from airflow_shared_stream_provider._core.flow import FlowGate, gates
from airflow_shared_stream_provider._core.positions import position_key
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider.brokers import find_broker

if TYPE_CHECKING:
    from airflow.triggers.shared_stream import SharedStreamProducer

log = logging.getLogger(__name__)

KEY_NAMESPACE = "airflow-shared-stream-provider"
FLUSH_MARKER: Final = "flush"
# Markers per quiet period (after F, 3F and 7F seconds of quiet; see _with_flush_markers).
FLUSH_MARKERS: Final = 3
# Longest reason made from a filter exception: a dead-letter header must stay small on every
# broker (Service Bus application properties, SQS attributes count against the message size).
MAX_FILTER_ERROR_CHARS: Final = 500


class SharedStreamOptions(TypedDict, total=False):
    """
    The options every broker trigger takes besides its own (typed once, here).

    Watcher side (not in the stream key; siblings may differ):

    * ``match``: filter on envelope paths, e.g. ``{"body.region": ["eu", "uk"]}``.
    * ``filter_function``: dotted path of ``f(envelope) -> bool`` (may raise ``RejectMessage``).
    * ``on_filter_error``: what a filter exception does: ``reject`` (default), ``skip``, ``fail``.
    * ``filter_mode``: where ``accept`` (``filter_function``, or an override) runs: ``"loop"``
      (default: inline on the triggerer's event loop; the filter must be fast and never block)
      or ``"thread"`` (in this watcher's own thread, one message at a time, in order; the other
      triggers keep running while it works). See docs/filters.md.
    * ``filter_timeout``: seconds (``filter_mode="thread"`` only; default None = no limit); a call
      that takes longer is treated per ``on_filter_error``, and runs on in its thread.
    * ``flush_after``: seconds; emit a ``{"marker": "flush"}`` event once this watcher has fired
      and then stayed quiet that long, again after 3x and 7x (Airflow 3.3's stranded tail;
      default None = off).

    Producer side (part of ``shared_stream_key``: siblings that differ get separate streams):

    * ``max_payload_bytes``: cap of one event payload stored in the metadata DB (default 65536).
    * ``oversize_policy``: ``dead_letter`` (default) or ``truncate`` for larger messages.
    * ``max_delivery_attempts``: poison cap (default 5, None = off): failed deliveries counted; a
      failure that was only collateral (queued behind the message a force-failed watcher stood on)
      is not (``_core/attempts.py``).
    * ``max_in_flight``: most messages received but not yet advanced (default 10000).
    * ``max_in_flight_bytes``: most bytes those messages hold (bodies, attributes, envelopes;
      default 64 MiB; one message larger still flows, alone; see docs/reliability.md, Memory).
    * ``batch_size``: most messages in one asset event (default 1: one envelope per event; more:
      payload ``{"messages": [...]}``, see docs/envelope.md).
    * ``batch_timeout``: seconds a partly filled batch waits for more messages (default 0.5).
    """

    match: Mapping[str, Any] | None
    filter_function: str | None
    on_filter_error: FilterErrorPolicy
    filter_mode: FilterMode
    filter_timeout: float | None
    flush_after: float | None
    max_payload_bytes: int
    oversize_policy: OversizePolicy
    max_delivery_attempts: int | None
    max_in_flight: int
    max_in_flight_bytes: int
    batch_size: int
    batch_timeout: float


# The options every broker takes (``**options``), not a broker's own arguments.
_COMMON_FIELDS: Final = frozenset(field.name for field in dataclasses.fields(StreamSettings))


def settings_arguments(settings_class: type[StreamSettings], namespace: Mapping[str, Any]) -> dict[str, Any]:
    """
    What a broker trigger's ``__init__`` passes on to :class:`SharedStreamTrigger`: from its
    ``locals()``, the values of its settings' own fields (as the body may have normalised them)
    and the common options of ``**options``.

    Reading the settings' fields, not the signature, leaves out ``self``, ``__class__`` and the
    body's own temporaries; ``tests/unit/test_settings_once.py`` holds every registry trigger's
    parameters to exactly those fields, so none is dropped here.
    """
    common = _COMMON_FIELDS
    arguments = {
        field.name: namespace[field.name]
        for field in dataclasses.fields(settings_class)
        if field.name not in common and field.name in namespace
    }
    arguments.update(namespace.get("options", {}))
    return arguments


class SharedStreamTrigger(BaseEventTrigger):
    """
    Base class: holds the producer settings and the watcher's filter; implements the shared path.

    Subclasses set :attr:`settings_class` and :attr:`producer_class_path` and define a typed
    ``__init__`` taking their broker's own arguments plus ``**options:
    Unpack[SharedStreamOptions]``, and pass everything on to this one with
    ``super().__init__(**settings_arguments(self.settings_class, locals()))`` (each argument is
    named once, in the signature): the arguments that are fields of :attr:`settings_class` build
    the settings, the rest are the watcher's. Users may
    subclass a broker trigger and override :meth:`accept`, :meth:`make_event` or
    :meth:`make_batch_event`; the subclass serializes under its own class path and, having the same
    settings, shares the stream with its siblings.
    """

    settings_class: ClassVar[type[StreamSettings]]
    producer_class_path: ClassVar[str]

    def __init__(
        self,
        *,
        match: Mapping[str, Any] | None = None,
        filter_function: str | None = None,
        on_filter_error: FilterErrorPolicy = "reject",
        filter_mode: FilterMode = "loop",
        filter_timeout: float | None = None,
        flush_after: float | None = None,
        **settings_fields: Any,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if on_filter_error not in FILTER_ERROR_POLICIES:
            raise SharedStreamConfigError(
                f"on_filter_error must be one of {FILTER_ERROR_POLICIES}, got {on_filter_error!r}"
            )
        if filter_mode not in FILTER_MODES:
            raise SharedStreamConfigError(f"filter_mode must be one of {FILTER_MODES}, got {filter_mode!r}")
        if filter_timeout is not None:
            if filter_mode != "thread":
                # A call on the event loop cannot be interrupted: a timeout there would be a lie.
                raise SharedStreamConfigError("filter_timeout needs filter_mode='thread'")
            StreamSettings.require_number("filter_timeout", filter_timeout, minimum=0.001, maximum=86_400)
        if flush_after is not None:
            StreamSettings.require_number("flush_after", flush_after, minimum=0.1, maximum=86_400)
        try:
            self.settings = self.settings_class(**settings_fields)
        except TypeError as exc:  # an unknown keyword: say which trigger refused it
            raise TypeError(f"{type(self).__name__}: {exc}") from exc
        self.match = validate_match(match)
        self.filter_function = validate_filter_function(filter_function)
        self.on_filter_error: FilterErrorPolicy = on_filter_error
        self.filter_mode: FilterMode = filter_mode
        self.filter_timeout = filter_timeout
        self.flush_after = flush_after
        self._filter = MessageFilter(self.match, self.filter_function)
        # filter_mode="thread": the running watcher's decider (set when it starts, closed when it ends).
        self._threaded: ThreadedDecider | None = None
        # flush_after: when this watcher last fired (monotonic) and on which message; None = no
        # marker is due (never fired, or the marker for the last burst was emitted).
        self._last_fired_at: float | None = None
        self._last_fired_id: str | None = None

    # -- identity ------------------------------------------------------------------------------
    def serialize(self) -> tuple[str, dict[str, Any]]:
        cls = type(self)
        kwargs = self.settings.to_kwargs()
        kwargs.update(match=self.match, filter_function=self.filter_function, on_filter_error=self.on_filter_error)
        if self.flush_after is not None:  # omitted when off: older serialized kwargs stay equal
            kwargs["flush_after"] = self.flush_after
        # Per watcher, like the filter, and omitted at their defaults for the same reason.
        if self.filter_mode != "loop":
            kwargs["filter_mode"] = self.filter_mode
        if self.filter_timeout is not None:
            kwargs["filter_timeout"] = self.filter_timeout
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
        return StreamTriggerEvent(envelope)

    def make_batch_event(self, envelopes: list[dict[str, Any]]) -> TriggerEvent:
        """Build the one TriggerEvent of a batch (batch mode): the accepted envelopes, in lane order."""
        return StreamTriggerEvent({"messages": envelopes})

    def make_flush_marker(self, last_message_id: str | None) -> TriggerEvent:
        """The ``flush_after`` marker: no message, only what a consumer needs to recognise and skip it."""
        return StreamTriggerEvent(
            {
                "marker": FLUSH_MARKER,
                "broker": self.settings.broker,
                "after_message_id": last_message_id,
                "quiet_seconds": self.flush_after,
            }
        )

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        key = self.shared_stream_key()
        # First, as it may raise (AirflowInternalsError): nothing is acquired yet that would leak.
        stores = stores_of(self.asset_state_store)
        # Registration happens before the first await, i.e. atomically with the manager's
        # subscribe (see _core/flow.py for why that matters).
        gate = gates.acquire(key)
        token = id(self)
        gate.register(token)
        identity = identity_of([name for name, _ in stores], self._watcher_spec())
        # Airflow's own lines name a trigger only by its id ("trigger ID 21 starting", "Trigger
        # fired event ... name='ID 21'"): this one says which watcher that is.
        log.info("Watcher %s runs as trigger %s on a %s shared stream", identity, self.trigger_id, self.settings.broker)
        gate.cohort.join(token, identity, stores if cohort_record_enabled() else [], record_key(key))
        scope = self.settings.position_scope()
        # -1: no position kept, never in a message's skip_for.
        member = (
            gate.positions.join(identity, position_key(scope, identity), stores, trigger_id=self.trigger_id)
            if scope is not None
            else -1
        )
        # What this watcher stands on: the suspect if the manager force-fails it (the except below).
        standing_on: StreamMessage | MessageBatch | None = None
        force_failed = False
        try:
            # Inside the try: registration above must stay before the first await (see flow.py),
            # and the finally must undo it when the filter cannot be imported.
            threaded = self._threaded = await self._prepare_filter()
            raw_events = shared_stream if self.flush_after is None else self._with_flush_markers(shared_stream)
            notes_fired = self.flush_after is not None
            async for raw in raw_events:
                if isinstance(raw, StreamMessage):
                    standing_on = raw
                    # The per-message path, inline: it runs once per message per watcher.
                    gate.consumed(token, raw.seq)
                    if raw.skip_for is not None and member in raw.skip_for:
                        continue  # replayed for a late sibling; this watcher had it already
                    if raw.forced_rejection is not None:
                        self._reject(raw, raw.forced_rejection)
                        continue
                    try:
                        fire = self.accept(raw.envelope) if threaded is None else await threaded(raw.envelope)
                    except RejectMessage as exc:
                        self._reject(raw, exc.reason)
                        continue
                    except Exception as exc:
                        if self._on_filter_exception(raw, exc):
                            self._reject(raw, _describe_filter_error(exc))
                        continue
                    if fire:
                        gate.fired += 1
                        event = self.make_event(raw.envelope)
                        # Until the runner asks for the next item its hand-over of this event is
                        # unfinished (see _unrecorded): marked failed meanwhile.
                        raw.fail(UNRECORDED, culprit=False)
                        window = current_window()
                        yield self._note_fired(event) if notes_fired else event
                        if was_bound(window):
                            _recorded(raw)
                        else:  # keep the mark and stop the intake: see _core/binding.py
                            _stopping(gate, key)
                elif isinstance(raw, MessageBatch):
                    standing_on = raw
                    gate.consumed(token, raw.seq)
                    batch_event = await self._filter_batch(raw, member, threaded)
                    if batch_event is not None:
                        gate.fired += 1
                        # The messages of the batch carry the mark (the batch's deliveries are
                        # decided per message).
                        for message in raw.messages:
                            message.fail(UNRECORDED, culprit=False)
                        window = current_window()
                        yield self._note_fired(batch_event) if notes_fired else batch_event
                        if was_bound(window):
                            for message in raw.messages:
                                _recorded(message)
                        else:  # keep the marks and stop the intake: see _core/binding.py
                            _stopping(gate, key)
                elif isinstance(raw, TriggerEvent):  # a flush marker from _with_flush_markers
                    yield raw
                else:
                    raise TypeError(f"{type(self).__name__} expects StreamMessage raw events, got {type(raw)!r}")
        except force_failures():
            # The manager gave up on this watcher (ack timeout, full queue) and fails every message
            # it still had outstanding. The one it stood on is the suspect; the others only queued
            # behind it, and their failures are collateral (_core/attempts.py): they do not count
            # toward their poison caps.
            if standing_on is not None:
                for message in standing_on.messages if isinstance(standing_on, MessageBatch) else (standing_on,):
                    message.suspect = True
            # The triggerer re-creates this watcher; until then the stream must not settle what it
            # misses: on a stream without watcher positions it waits for it (_core/cohort.py).
            force_failed = scope is None
            raise
        finally:
            if self._threaded is not None:
                self._threaded.close()
                self._threaded = None
            if member != -1:
                gate.positions.leave(member)
            gate.cohort.leave(token, failed=force_failed)
            gate.unregister(token)
            gates.release(key, gate)

    def _watcher_spec(self) -> dict[str, Any]:
        """What tells two watchers of one stream apart, besides their assets (cohort identity)."""
        cls = type(self)
        return {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "match": self.match,
            "filter_function": self.filter_function,
            "on_filter_error": self.on_filter_error,
            "flush_after": self.flush_after,
        }

    async def _prepare_filter(self) -> ThreadedDecider | None:
        """
        Import ``filter_function`` in a worker thread (once per watcher start; a wrong path raises
        :class:`SharedStreamConfigError` here, ending this watcher), and for ``filter_mode="thread"``
        build the decider that runs ``accept`` off the loop. None: decide inline, on the loop.
        """
        if self._filter.needs_import:
            await asyncio.to_thread(self._filter.resolve)
        if self.filter_mode != "thread":
            return None
        if type(self).accept is SharedStreamTrigger.accept:
            function = self._filter.resolve()  # imported above: no import here
            if function is None:
                return None  # ``match`` alone is cheap: it stays on the loop
            return ThreadedDecider(
                function,
                label=str(self.filter_function),
                prefilter=self._filter.matches if self._filter.has_clauses else None,
                timeout=self.filter_timeout,
            )
        # An overridden accept may do anything: all of it runs in the thread.
        cls = type(self)
        return ThreadedDecider(
            self.accept, label=f"{cls.__module__}.{cls.__qualname__}.accept", timeout=self.filter_timeout
        )

    async def _filter_batch(
        self, batch: MessageBatch, member: int, threaded: ThreadedDecider | None
    ) -> TriggerEvent | None:
        """
        A batch: each message decided on its own and the decision recorded on it; no call to
        ``reject_shared_stream_event`` (it would reject the whole batch): the producer reads the
        rejections off each message. ``member``: this watcher's position member number (-1: none).
        ``threaded``: the ``filter_mode="thread"`` decider, or None to decide inline.
        """
        accepted: list[dict[str, Any]] = []
        messages = batch.messages
        for index, message in enumerate(messages):
            if message.skip_for is not None and member in message.skip_for:
                continue
            if message.forced_rejection is not None:
                message.reject(message.forced_rejection)
                continue
            try:
                fire = self.accept(message.envelope) if threaded is None else await threaded(message.envelope)
            except RejectMessage as exc:
                message.reject(exc.reason)
                continue
            except Exception as exc:
                if self.on_filter_error == "fail" or isinstance(exc, FilterStuckError):
                    # This watcher leaves now: the events of the messages it accepted before are
                    # never yielded, and it never sees the ones after. All must come back.
                    error = _describe_filter_error(exc)
                    for other in messages[:index] + messages[index + 1 :]:
                        other.fail(
                            f"watcher stopped on {message.envelope.get('message_id')!r} in the same batch",
                            culprit=False,
                        )
                    message.fail(error)
                    raise
                if self._on_filter_exception(message, exc):
                    message.reject(_describe_filter_error(exc))
                continue
            if fire:
                accepted.append(message.envelope)
        return self.make_batch_event(accepted) if accepted else None

    def _on_filter_exception(self, message: StreamMessage, exc: Exception) -> bool:
        """
        Apply ``on_filter_error`` to a filter exception; True means: reject the message.
        :class:`FilterStuckError` (no thread left for the filter) always ends the watcher.
        """
        if self.on_filter_error == "fail" or isinstance(exc, FilterStuckError):
            message.fail(_describe_filter_error(exc))
            raise exc
        log.exception(
            "Filter raised on message %s (on_filter_error=%s)",
            message.envelope.get("message_id"),
            self.on_filter_error,
        )
        return self.on_filter_error == "reject"

    def _reject(self, message: StreamMessage, reason: str) -> None:
        message.reject(reason)
        if self.flush_after is None:
            # With flush_after the binding window is opened in another task (see
            # _with_flush_markers), where this call cannot see it; the producer reads the
            # rejection off the message either way.
            reject_shared_stream_event()

    async def _with_flush_markers(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """
        The raw events, plus flush markers (:class:`TriggerEvent` s) once this watcher has fired and
        then fired nothing for ``flush_after`` seconds: the first after ``flush_after``, and at most
        :data:`FLUSH_MARKERS` in all, each after twice the previous wait (F, 3F, 7F after the last
        event). Why more than one: a marker that arrives while the consumer Dag's next run is still
        waiting to be created is stranded with the tail it was meant to flush (Airflow 3.3); a
        later one arrives after that run was created and queues the run that takes the tail. Each
        costs at most one extra run; the watcher's next event starts the count again.

        The next raw event is awaited in a task of its own, left pending across a timeout (never
        cancelled: cancelling would end the manager's stream). So the manager opens a raw event's
        binding window in that task's context, where ``reject_shared_stream_event`` cannot see it;
        that is fine, because the producer decides every message from the rejections recorded on
        it (see ``SharedStreamProducerBase.advance``), not from the manager's counts alone.
        """
        assert self.flush_after is not None
        quiet = self.flush_after
        iterator = aiter(shared_stream)
        pending: asyncio.Future[Any] | None = None
        markers = 0  # markers emitted since this watcher last fired
        last_fired_at: float | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(iterator))
                if self._last_fired_at != last_fired_at:  # fired since: a new quiet period
                    last_fired_at, markers = self._last_fired_at, 0
                timeout: float | None = None
                if last_fired_at is not None and markers < FLUSH_MARKERS:
                    due = last_fired_at + quiet * (2 ** (markers + 1) - 1)
                    timeout = max(0.0, due - time.monotonic())
                done, _ = await asyncio.wait({pending}, timeout=timeout)
                if not done:
                    markers += 1
                    yield self.make_flush_marker(self._last_fired_id)
                    continue
                task, pending = pending, None
                try:
                    raw = task.result()
                except StopAsyncIteration:
                    return
                yield raw
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _note_fired(self, event: TriggerEvent) -> TriggerEvent:
        """``flush_after``: when this watcher last fired, and on which message (the marker names it)."""
        self._last_fired_at = time.monotonic()
        payload = event.payload
        if isinstance(payload, Mapping):
            messages = payload.get("messages")
            last = messages[-1] if isinstance(messages, list) and messages else payload
            self._last_fired_id = last.get("message_id") if isinstance(last, Mapping) else None
        return event

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


# A watcher that yielded an event and was stopped before the triggerer recorded it. In Airflow 3.3.2
# the runner logs each event (``await log.ainfo``, a thread hop) *before* binding it to its raw
# event; a trigger cancelled during that hop (a graceful triggerer stop cancels every trigger) drops
# the event, and the manager resolves the raw event as accepted for this watcher, as if the event
# had been persisted: the broker would settle a message whose event exists nowhere (found by the
# soak, bench/soak.py: SQS and Pub/Sub lost what fired in the seconds after a SIGTERM). So the mark
# is put on the message before the yield and removed when the runner asks for the next item, which
# it does only after binding the event; a watcher stopped in between leaves the mark, and the
# producer counts it as a failure (``message_outcome``): the message is redelivered. The mark also
# stays when the runner took the event but bound it to nothing (a group stopping in the runner's
# shutdown, ``_core/binding.py``).
# (UNRECORDED itself lives in _core/envelope.py, next to the producer's use of it.)


def _stopping(gate: FlowGate, key: Hashable) -> None:
    """The runner took an event and bound it to nothing: its manager is stopping this stream."""
    if not gate.frozen:
        log.warning(
            "Shared stream %s is being stopped by the triggerer while it still delivers: no further "
            "messages are read, and those whose events were not recorded are handed back to the broker",
            _stream_name(key),
        )
        gate.freeze()


def _stream_name(key: Hashable) -> str:
    """
    ``kafka ['orders']`` for a key of ours (namespace, broker, settings pairs); else the key itself.
    The settings naming the source are the broker's ``source_fields`` in the registry (a test
    broker, in no registry, is shown by its key).
    """
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[2], tuple):
        spec = find_broker(key[1]) if isinstance(key[1], str) else None
        fields = dict(pair for pair in key[2] if isinstance(pair, tuple) and len(pair) == 2)
        source = next((fields[name] for name in spec.source_fields if fields.get(name)), None) if spec else None
        if source is not None:
            return f"{key[1]} {source!r}"
    return repr(key)


def _recorded(message: StreamMessage) -> None:
    """
    Take back the mark of :data:`UNRECORDED` (the runner bound the event, it is in its queue).
    Not called when the event bound to nothing (``_core/binding.py``): the message is redelivered.
    """
    failures = message.failures
    if failures is not None:
        failures.remove(UNRECORDED)
        if not failures:
            message.failures = None  # keeps the producer's fast path for this message


# What a dead-letter header or a log line must not carry: C0/C1 controls (CR, LF, NUL among them:
# header injection, truncated C strings, split log records), Unicode line separators, lone
# surrogates (not encodable as UTF-8) and the two non-characters XML refuses (SQS attributes).
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]+")


def _describe_filter_error(exc: BaseException) -> str:
    """
    ``filter raised KeyError: 'customer'``; never raises, even for an exception whose ``str`` does.

    The filter's text is user data headed for dead-letter headers on every broker and for logs:
    each run of unsafe characters becomes one space and the whole is cut to
    :data:`MAX_FILTER_ERROR_CHARS` (ending in ``...`` when cut), here at the source.
    """
    try:
        text = str(exc)
    except Exception as render_error:  # a broken __str__ must not lose the message (fuzz-found)
        text = f"<unprintable: str() raised {type(render_error).__name__}>"
    # Cut before the substitution too, so a huge str(exc) costs no more than a bounded scan.
    reason = _UNSAFE_TEXT.sub(" ", f"filter raised {type(exc).__name__}: {text[: MAX_FILTER_ERROR_CHARS + 1]}")
    if len(reason) > MAX_FILTER_ERROR_CHARS:
        reason = reason[: MAX_FILTER_ERROR_CHARS - 3] + "..."
    return reason


def _import_producer(path: str) -> type:
    from airflow.sdk.module_loading import import_string  # type: ignore[attr-defined]  # see filtering.py

    return import_string(path)  # type: ignore[no-any-return]
