"""
The base of every broker producer: the receive loop, flow control, dispositions, counters, lifecycle.

A broker producer subclasses :class:`SharedStreamProducerBase`. The receive loop
(:meth:`SharedStreamProducerBase._messages`) is written here once, as a template method that
drives the broker's hooks and keeps the loop's rules itself; a broker writes only the hooks:

Required:

* ``source_label()``: the stream's human-readable identity.
* ``max_message_bytes`` (class attribute): the largest message the broker takes (the byte
  budget's size estimate before the first message).
* ``_connect_broker()``: connect and check the configuration (before the cohort: a bad setting fails fast).
* ``_receive(count)``: one receive of at most ``count`` raw messages (a ``list``, empty when the
  broker had none); :class:`Received` when the broker needs per-receive facts (its start, a number).
* ``_to_delivery(raw, received)``: one raw message as ``(delivery, envelope, forced rejection,
  raw body)``; the delivery's ``message`` is :data:`UNSENT` (the loop puts the message there).
* ``_apply(decided)``: what COMMIT / DEAD_LETTER / REDELIVER / HOLD mean on the broker.
* ``_close()``: release broker clients (best-effort).

Optional (the default does nothing or the usual thing):

* ``_after_cohort()``: async, once the cohort formed, before ``_receiving()``: open what must not
  be opened before it (Service Bus: the connection and its receiver).
* ``_receiving()``: start what runs beside the loop once the cohort formed (lease keeper, ack buffer).
* ``_before_receive()``: async, each turn of the loop before the credit wait: work that must not
  overlap a receive call nor wait for credit (Service Bus: the settlements and lock renewals
  queued for the receiver's one owner); it may wait, for credit or for such work.
* ``_admit(received)``: bookkeeping of a whole receive before any of it is broadcast (every receive,
  empty ones too); may drop messages (still counted as received) or raise to end the stream.
* ``_check_stream()``: raise to end the stream before the next receive (a background failure).
* ``_after_empty(received)``: after an empty receive (a pause for a server that answers at once).
* ``receive_errors`` / ``_fatal_receive_error(exc)`` / ``_receive_outage(exc, failures)`` /
  ``receive_backoff``: which receive errors are retried, which end the stream at once, the
  error once they outlast the streak, and the waits between the tries.
* ``max_receive``: the most messages one receive asks for; ``concurrent_receives``: receives in
  flight at once (0: awaited inline); ``receive_ahead``: start the next receive while a received
  batch is broadcast; ``_end_receives()``: what becomes of receives still travelling when the
  loop ends (default: cancelled).
* ``lane_of`` / ``batch_lane_of`` if the broker has ordered lanes; ``sdk_buffered_messages``
  (messages an SDK prefetches outside the credit); ``receive_copies`` (class attribute: how many
  times a receive's messages are in memory at once while it runs, measured per client; the byte
  budget counts a receive that many times, _core/flow.py).
* The poison cap and returning watchers (class attributes, explained where declared):
  ``forgives_collateral_failures``, ``forgiveness_is_durable``, ``gives_back_missed_messages``;
  ``attempt_key(delivery)`` (the id a message keeps across deliveries) and
  ``competing_consumers()`` (whether two triggerers' streams of one key take messages from
  each other: split detection).

The rules the template keeps (a broker cannot break them): the cohort forms before the first
receive; every receive asks for no more than the credit (less what receives still travelling
asked for), and for no trickle of it while the slowest watcher's queue holds it back
(:meth:`receive_floor`); a receive that comes back empty releases what ``deferred`` holds; every message a
receive brought is counted as ``received``; a message's seq is taken right before its yield
(nothing awaited in between); receive failures are retried with backoff for at most
:data:`RECEIVE_ERROR_LIMIT` in a row; receives still travelling are ended when the loop ends;
the receive and the awaited hooks run through :func:`~._core.tasks.call_keeping_cancellation`, so
a cancellation a client library loses inside them still ends the loop.

Who runs the template: SQS, Pub/Sub, Redis and Service Bus without sessions. Two receive paths
keep their own ``_messages`` (an allowed override, and the only ones):

* Kafka (``producers/kafka.py``): its delivery is the stream message itself (one object, not
  ``_to_delivery``'s pair), and each record is admitted at its yield, not per receive: whether it
  is new (``lane.admit``: in flight, done or dead-lettered after a rewind's seek-back), its
  attempt and its skip-for-late-watchers mark read the partition's lane as it is between yields,
  while ``advance`` and rewinds change it; ``received`` counts only the admitted records. Its
  credit wait also has a timeout that pauses the partitions and polls (a group member must poll).
* Service Bus with sessions (``_session_messages``): the receives run in the session receivers'
  own tasks (``servicebus_sessions.py``), each reserving its credit from a shared ``CreditPool``
  before its receive call and counting what it received; the loop only broadcasts what they
  received, with the credit reserved for it, so a credit wait there would be a second one.

An override keeps the same rules by hand: :meth:`cohort_ready` first, credit
(:meth:`wait_for_credit`, :meth:`credit`) before each receive, the seq (:meth:`stream_message` /
:meth:`take_seq`) immediately before each yield, ``self.deferred.release_all()`` on an empty
receive, ``received`` counted, and client calls awaited through ``call_keeping_cancellation``.

Everything else (batch mode, the outcome -> disposition mapping, the poison cap, the credit that
keeps watcher queues from overflowing, counters and metrics) is here, once. That includes the
returning-watchers rule of the queue brokers (``gives_back_missed_messages``, _core/cohort.py):
while a watcher the manager force-failed is away the credit is 0 (nothing is received), and a
message broadcast to fewer watchers than its ``audience`` is given back (REDELIVER, collateral:
not counted toward its poison cap) instead of settled, so the returning watcher gets it too.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Generic, TypeVar

from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamProducer

from airflow_shared_stream_provider._core.airflow_internals import require_airflow_internals
from airflow_shared_stream_provider._core.attempts import COLLATERAL_CEILING, FORGIVEN_MEMORY, MessageCounts
from airflow_shared_stream_provider._core.batching import BATCH_OVERHEAD, Batcher, MessageBatch, batched_stream
from airflow_shared_stream_provider._core.cohort import cohort_limits, cohort_record_enabled, record_key
from airflow_shared_stream_provider._core.dispositions import COMMIT_DECISION, Decision, Disposition, decide
from airflow_shared_stream_provider._core.envelope import (
    DeliveryLike,
    StreamMessage,
    build_envelope,
    fallback_envelope,
    unrecorded_only,
)
from airflow_shared_stream_provider._core.flow import FlowGate, gates
from airflow_shared_stream_provider._core.logsafe import REASON_LOG_LIMIT, log_safe
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.release import ENTRIES_PER_MESSAGE, DeferredRelease
from airflow_shared_stream_provider._core.retry import Backoff, ErrorStreak
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.split import SplitWatch, heartbeat_interval
from airflow_shared_stream_provider._core.tasks import call_keeping_cancellation, cancel_and_wait
from airflow_shared_stream_provider.brokers import BrokerName

DEFAULT_QUEUE_SIZE = 1024
DEFAULT_ACK_TIMEOUT = 300.0
# Byte budget (_core/flow.py): what one held message weighs besides its body, attributes and
# envelope body (the message and delivery objects, the envelope's other fields, the manager's
# bookkeeping), and the share of max_in_flight_bytes advanced messages may wait in ``deferred``.
HELD_OVERHEAD: Final = 1024
DEFERRED_BYTES_SHARE: Final = 8
# Receive failures the loop retries (1, 2, 4, 8 s apart) before the stream fails: the 5th in a row.
RECEIVE_ERROR_LIMIT: Final = 5
RECEIVE_BACKOFF: Final = Backoff(1.0, cap=16.0)

UNSENT: Final = StreamMessage({}, 0)
"""The ``message`` of a delivery whose message is not built yet (the receive loop puts it there)."""


class Received(list):  # type: ignore[type-arg]  # list[Any]: a broker's raw messages
    """
    One receive's raw messages, with what a broker needs to know of the receive itself: when it
    started (a lease the broker granted starts no earlier) and a number the broker gives it.
    """

    __slots__ = ("number", "started")

    def __init__(self, items: Iterable[Any] = (), *, started: float = 0.0, number: int = 0) -> None:
        super().__init__(items)
        self.started = started
        self.number = number


def body_size(body: object) -> int:
    """Bytes a raw body keeps alive: its length for bytes-like and text bodies, else 0 (unknown)."""
    if isinstance(body, bytes | bytearray | memoryview | str):
        return len(body)
    return 0


@dataclass(slots=True)
class Delivery:
    """
    The usual broker payload: the message plus what the broker needs to settle it (subclassed).

    A producer may instead yield one object as both event and payload (a :class:`StreamMessage`
    subclass whose ``message`` is itself, as Kafka does): one object less per message in flight,
    which the cyclic GC would otherwise walk on every pass until the message is advanced.
    """

    message: StreamMessage
    delivery_attempt: int


SettingsT = TypeVar("SettingsT", bound=StreamSettings)
DeliveryT = TypeVar("DeliveryT", bound=DeliveryLike)


class Decided(Generic[DeliveryT]):
    """One message's delivery and what is to be done with it (read-only by convention)."""

    __slots__ = ("decision", "delivery", "disposition", "forgiven")

    def __init__(self, delivery: DeliveryT, decision: Decision, *, forgiven: bool = False) -> None:
        self.delivery = delivery
        self.decision = decision
        self.disposition: Disposition = decision.disposition
        # REDELIVER of a collateral failure (_core/attempts.py): this delivery does not count. A
        # broker that can set its delivery count back (forgiveness_is_durable) does it in _apply.
        self.forgiven = forgiven


# A message whose only failures are UNRECORDED marks (its events were dropped by a stopping
# triggerer): handed back like one nobody saw, without counting a delivery attempt.
UNRECORDED_DECISION: Final = Decision(Disposition.HOLD, "its events were not recorded (the triggerer was stopping)")


def message_outcome(outcome: AdvanceOutcome, message: StreamMessage) -> AdvanceOutcome:
    """
    One message's outcome: the manager's counts for its raw event, corrected by what the watchers
    recorded on the message itself.

    * ``failures``: watchers that stopped on the message (``on_filter_error="fail"``). The manager
      resolved them as acked when they unsubscribed while sitting on it; they count as failed.
    * ``rejections``: watchers that rejected it. For a message broadcast alone the manager counted
      them already (``reject_shared_stream_event``), unless the watcher could not reach the binding
      window (``flush_after`` reads in a task of its own); in a batch the manager never sees a
      per-message reject (it would reject the whole batch). Either way the recorded count is the
      truth: at least that many watchers rejected, moved from acked.
    """
    rejected = len(message.rejections) if message.rejections else 0
    failed = len(message.failures) if message.failures else 0
    if not rejected and not failed:
        return outcome
    extra_rejected = max(0, rejected - outcome.rejected)
    acked = outcome.acked
    moved_rejected = min(extra_rejected, acked)
    acked -= moved_rejected
    moved_failed = min(failed, acked)
    acked -= moved_failed
    return AdvanceOutcome(
        acked=acked,
        failed=outcome.failed + moved_failed,
        rejected=outcome.rejected + moved_rejected,
    )


def with_missed_watchers(outcome: AdvanceOutcome, missed: int) -> AdvanceOutcome:
    """
    The outcome with the ``missed`` watchers of the message's audience the manager did not
    broadcast it to (force-failed before its broadcast, or away) counted as failed: none of them
    has the message, so it goes back to the broker. Their failure is collateral (no ``culprit``,
    no ``suspect``: the message did nothing), so it does not count toward its poison cap.
    """
    return AdvanceOutcome(acked=outcome.acked, failed=outcome.failed + missed, rejected=outcome.rejected)


def expand_batches(batch: Sequence[AdvanceItem]) -> list[AdvanceItem]:
    """Per-message items of an advance batch (batch mode): each message gets its raw event's outcome."""
    items: list[AdvanceItem] = []
    for item in batch:
        payload = item.broker_payload
        if isinstance(payload, MessageBatch):
            outcome = item.outcome
            items.extend(AdvanceItem(broker_payload=delivery, outcome=outcome) for delivery in payload.deliveries)
        else:
            items.append(item)
    return items


def triggerer_limits() -> tuple[int, float]:
    """``(shared_stream_subscriber_queue_size, shared_stream_ack_timeout)`` from Airflow config."""
    from airflow.configuration import conf

    queue_size = conf.getint("triggerer", "shared_stream_subscriber_queue_size", fallback=DEFAULT_QUEUE_SIZE)
    ack_timeout = conf.getfloat("triggerer", "shared_stream_ack_timeout", fallback=DEFAULT_ACK_TIMEOUT)
    return queue_size, ack_timeout


def flow_window(queue_size: int) -> int:
    """Most messages a watcher may have queued: the queue size less a 1/16 margin."""
    return max(1, queue_size - max(1, queue_size // 16))


def held_release_limit(queue_size: int, max_in_flight: int) -> int:
    """
    Most entries :class:`DeferredRelease` holds: ``min(max_in_flight, 2 flow windows)`` messages.

    Not lower: one advance batch can be a whole persistence round of messages (50 ms at 25k msgs/s
    is 1250, more than a window), and what a batch brings over the limit is freed in one burst
    (measured at N=1: one window 323-326 young collections per 20k messages, two or four 290-309).
    Not higher: held messages add to the memory of those in flight; with large messages their
    bytes are capped besides (a share of ``max_in_flight_bytes``, :meth:`_defer_release`).
    """
    return ENTRIES_PER_MESSAGE * min(max_in_flight, 2 * flow_window(queue_size))


class SharedStreamProducerBase(SharedStreamProducer, abc.ABC, Generic[SettingsT, DeliveryT]):
    # The largest message the broker takes: the size the byte budget assumes for a stream's first
    # receive, before it has seen a message (_core/flow.py).
    max_message_bytes: ClassVar[int]
    # How many copies of a receive's messages exist at its peak (the client's buffer and parse
    # beside ours). 1: our copy only, the byte budget counts each message once and may overshoot
    # by one. Above 1: a receive is sized so that held + copies x its bytes fits the budget.
    receive_copies: ClassVar[int] = 1
    # Collateral failures (_core/attempts.py) are forgiven by the base from the broker's delivery
    # count. False for a broker that counts attempts itself and already counts only suspects
    # (Kafka: the culprit or the lowest failed offset of its partition, kafka_lanes).
    forgives_collateral_failures: ClassVar[bool] = True
    # The broker's delivery count is set back for each forgiven delivery by the broker's _apply
    # (Decided.forgiven; Redis: XCLAIM RETRYCOUNT), so forgiveness survives a restart. The base
    # then counts the broker's number as it is and remembers the forgiven ones only for the ceiling.
    forgiveness_is_durable: ClassVar[bool] = False
    # A message is settled only once every watcher of its audience has it (StreamMessage.audience:
    # the watchers registered at its broadcast, plus those force-failed out and not back yet); a
    # message the manager broadcast without one of them is given back (_core/cohort.py, returning
    # members). False for a broker whose returning watcher replays what it missed from its stored
    # position (Kafka, _core/positions.py).
    gives_back_missed_messages: ClassVar[bool] = True

    def __init__(self, settings: SettingsT, *, stream_key: Hashable) -> None:
        self.settings = settings
        # Declared once, by the settings class (the registry test checks it is the broker's
        # registry name): the envelope's ``broker`` and the metrics' prefix.
        self.broker: BrokerName = settings.broker
        self.stream_key = stream_key
        self.log = logging.getLogger(f"{type(self).__module__}.{type(self).__name__}")
        self.counters = StreamCounters(self.broker, self.source_label())
        self.queue_size, self.ack_timeout = triggerer_limits()
        self._gate: FlowGate | None = None
        self._in_flight = 0
        self._fired_reported = 0
        self._closed = False
        # Advanced batches, freed one message per message read (see _core/release.py).
        self.deferred = DeferredRelease(limit=held_release_limit(self.queue_size, settings.max_in_flight))
        # Batch mode (see _core/batching.py): the gate counts batches; messages taken by the
        # receive loop but not yet broadcast in a batch are ``_unbatched``.
        self.batch_size = settings.batch_size
        self.batching = settings.batch_size > 1
        # The cap one envelope is built against: in batch mode a batch of that one envelope alone
        # ({"messages": [...]}) must still fit max_payload_bytes.
        self.max_envelope_bytes = settings.max_payload_bytes - (BATCH_OVERHEAD if self.batching else 0)
        self._unbatched = 0
        self._batches_in_flight = 0
        # Byte budget (_core/flow.py): what this producer counted on the gate and not yet gave back,
        # and an upper bound of what ``deferred`` holds (advanced messages freed gradually), which
        # stays within ``max_in_flight_bytes / DEFERRED_BYTES_SHARE``.
        self._held_bytes = 0
        self._deferred_bytes = 0
        self._deferred_bytes_limit = settings.max_in_flight_bytes // DEFERRED_BYTES_SHARE
        # Split detection (see _core/split.py), started once the cohort formed.
        self.split_watch: SplitWatch | None = None
        self._split_task: asyncio.Future[None] | None = None
        # Receives travelling (concurrent_receives > 0) and how many messages each asked for.
        self._receives: dict[asyncio.Future[list[Any]], int] = {}
        # attempt_key -> deliveries the poison cap does not count (collateral failures, _core/attempts.py).
        self._forgiven: MessageCounts[Hashable] | None = (
            MessageCounts(FORGIVEN_MEMORY) if self.forgives_collateral_failures else None
        )

    # -- for subclasses ------------------------------------------------------------------------
    @abc.abstractmethod
    def source_label(self) -> str:
        """Human-readable stream identity (topic list, queue URL, subscription path)."""

    # -- the receive loop: written once here, driving the broker's hooks below ------------------
    async def _messages(self) -> AsyncIterator[tuple[StreamMessage, Any]]:
        """
        Open, wait for the cohort, then receive forever: for each message yield ``(stream
        message, delivery)``. The template every broker runs but Kafka and Service Bus with
        sessions (see the module docstring, which has its rules).
        """
        await self._connect_broker()
        await self.cohort_ready()  # before the first receive: see _core/cohort.py
        await self._after_cohort()
        self._receiving()
        errors = ErrorStreak(self.receive_backoff, limit=RECEIVE_ERROR_LIMIT)
        # The hooks below call client libraries on this task: a cancellation one loses still ends
        # the loop (see _core/tasks.py), as for the receive itself.
        where = self.source_label()
        try:
            while True:
                self._check_stream()
                await call_keeping_cancellation(self._before_receive(), where)
                # Receives are handed out in the order they were started.
                for received in await self._next_receives():
                    if isinstance(received, BaseException):
                        await self._receive_failed(received, errors)
                        continue
                    errors.reset()
                    size = len(received)
                    messages = await call_keeping_cancellation(self._admit(received), where)
                    if not size:
                        self.deferred.release_all()  # a quiet stream: hold nothing (see _core/release.py)
                        await call_keeping_cancellation(self._after_empty(received), where)
                        continue
                    self.counters.add("received", size)
                    if self.receive_ahead:
                        self._receive_ahead(size)
                    # Popped, so that a yielded message's raw bytes are referenced only by its
                    # delivery (the receive's list and the generator frame would keep them).
                    messages.reverse()
                    while messages:
                        delivery, envelope, forced, body = self._to_delivery(messages.pop(), received)
                        # The seq is taken here, right before the yield, with nothing awaited between.
                        delivery.message = message = self.stream_message(envelope, forced, body)
                        yield message, delivery
        finally:
            await self._end_receives()

    async def _next_receives(self) -> list[list[Any] | BaseException]:
        """
        The next receives to hand out, in the order they were started: their messages, or the
        error (one of :attr:`receive_errors`) they failed with. Never asks for more than the credit.
        """
        floor = self.receive_floor()
        if not self.concurrent_receives:
            credit = await self.wait_for_credit(floor)
            try:
                # A cancellation the client loses ends the loop all the same (see _core/tasks.py).
                receive = self._receive(min(credit, self.max_receive))
                return [await call_keeping_cancellation(receive, self.source_label())]
            except self.receive_errors as exc:
                return [exc]
        receives = self._receives
        # Up to concurrent_receives in flight, together never asking for more than the credit.
        asked = sum(receives.values())
        available = self.credit() - asked
        while len(receives) < self.concurrent_receives and self._worth_receiving(available, asked, floor):
            count = min(self.max_receive, available)
            self._start_receive(count)
            available -= count
            asked += count
        if not receives:
            await self.wait_for_credit(floor)
            return []
        # Not cancelled with the loop: _end_receives decides what becomes of a receive travelling.
        done, _ = await asyncio.wait(receives, return_when=asyncio.FIRST_COMPLETED)
        results: list[list[Any] | BaseException] = []
        for task in [task for task in receives if task in done]:
            del receives[task]
            try:
                results.append(task.result())
            except self.receive_errors as exc:
                results.append(exc)
        return results

    def _start_receive(self, count: int) -> None:
        # _receive runs its synchronous part now (Pub/Sub numbers its pulls there), the rest in a task.
        task = asyncio.ensure_future(self._receive(count))
        task.set_name(f"{self.broker}-receive[{self.source_label()}]")
        self._receives[task] = count

    def _receive_ahead(self, size: int) -> None:
        """Start the next receive while ``size`` messages just received are broadcast (their credit taken)."""
        if len(self._receives) < self.concurrent_receives:
            asked = size + sum(self._receives.values())
            more = self.credit() - asked
            if self._worth_receiving(more, asked, self.receive_floor()):
                self._start_receive(min(self.max_receive, more))

    def receive_floor(self) -> int:
        """
        The fewest messages a receive should ask for while the slowest watcher's queue is what
        holds the credit back: ``min(max_receive, window / 2)`` (1 in batch mode, where the credit
        counts batches). That queue frees its room a message at a time as the watcher works
        through it; receiving each trickle made a broker call for a few messages (Pub/Sub at 10
        watchers: 247 pulls of ~8 messages for 2,000, against 26 with one watcher; Redis 0.145
        calls a message at 10 watchers, 0.026 with this floor). The slowest watcher has at least
        half a window queued meanwhile, so waiting costs no watcher anything.
        """
        if self.batching:
            return 1
        return max(1, min(self.max_receive, self.gate.window // 2))

    def _worth_receiving(self, available: int, asked: int, floor: int) -> bool:
        """
        Whether to start a receive for ``available`` messages of credit (``asked``: messages
        received and not yet yielded, or asked for by receives travelling): some credit, and not
        a trickle that only the slowest watcher's queue holds below ``floor``.
        """
        return available > 0 and not self.gate.is_trickle(available, floor, asked)

    async def _receive_failed(self, exc: BaseException, errors: ErrorStreak) -> None:
        """A failed receive: end the stream (a setting, or an outage past the streak), or wait and retry."""
        fatal = self._fatal_receive_error(exc)
        if fatal is not None:
            raise fatal from exc
        delay = errors.failed()
        if delay is None:
            raise self._receive_outage(exc, errors.count) from exc
        self.log.warning(
            "%s receive on %s failed (%s); retrying in %.0f s", self.broker, self.source_label(), exc, delay
        )
        await asyncio.sleep(delay)

    # -- receive hooks: required (unless _messages is overridden) ------------------------------
    async def _connect_broker(self) -> None:
        """Connect and check the configuration; runs before the cohort forms."""
        raise NotImplementedError(f"{type(self).__name__} overrides neither _connect_broker nor _messages")

    def _receive(self, count: int) -> Awaitable[list[Any]]:
        """
        One receive of at most ``count`` raw messages (``count`` >= 1, within the credit and
        :attr:`max_receive`); empty when the broker had none. Return a :class:`Received` to keep
        facts of the receive for :meth:`_admit` / :meth:`_to_delivery`. Raising one of
        :attr:`receive_errors` is a failed receive (retried, see :meth:`_fatal_receive_error`).
        """
        raise NotImplementedError(f"{type(self).__name__} overrides neither _receive nor _messages")

    def _to_delivery(self, raw: Any, received: list[Any]) -> tuple[Delivery, dict[str, Any], str | None, object]:
        """
        One raw message of ``received``: ``(delivery, envelope, forced rejection, raw body)``, the
        envelope and rejection from :meth:`envelope`, the delivery's ``message`` :data:`UNSENT`.
        Synchronous: the loop takes the message's seq right after it and yields.
        """
        raise NotImplementedError(f"{type(self).__name__} overrides neither _to_delivery nor _messages")

    # -- receive hooks: optional ---------------------------------------------------------------
    # The most messages one receive asks for (the broker's own limit; the credit may ask fewer).
    max_receive: int = 1
    # Receives in flight at once, each a task; 0: each receive is awaited in the loop itself.
    concurrent_receives: int = 0
    # Start the next receive (within the credit) while the messages of one are broadcast.
    receive_ahead: ClassVar[bool] = False
    # The errors a failed receive raises (retried unless _fatal_receive_error says otherwise);
    # any other error of a receive ends the stream.
    receive_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    # The waits between failed receives (read at each streak's start: tests shorten it per class).
    receive_backoff: ClassVar[Backoff] = RECEIVE_BACKOFF

    async def _after_cohort(self) -> None:
        """
        The cohort formed, before :meth:`_receiving` and the first receive: open what must not be
        opened earlier (Service Bus reads its connection and opens its receiver only now).
        """

    def _receiving(self) -> None:
        """The cohort formed, receives start: start what runs beside the loop (lease keeper, acks)."""

    async def _before_receive(self) -> None:
        """
        Each turn of the loop, after :meth:`_check_stream`, before the credit wait and the receive:
        work that must not overlap a receive call and must not wait for credit either (Service
        Bus: the settlements and lock renewals queued for the receiver's one owner). May wait
        itself, for credit or for such work; the loop then waits for credit as always.
        """

    def _check_stream(self) -> None:
        """Before each receive: raise to end the stream (a failure found in the background)."""

    async def _admit(self, received: list[Any]) -> list[Any]:
        """
        Bookkeeping of a whole receive before any of it is broadcast (called for every receive,
        empty ones too): the messages to broadcast (the dropped ones still count as received).
        May raise to end the stream instead.
        """
        return received

    async def _after_empty(self, received: list[Any]) -> None:
        """After an empty receive (a broker that answers empty at once is polled with a pause)."""

    def _fatal_receive_error(self, exc: BaseException) -> Exception | None:
        """The error to end the stream with at once (a setting, not an outage), or None: retry."""
        return None

    def _receive_outage(self, exc: BaseException, failures: int) -> Exception:
        """The error ending the stream after ``failures`` failed receives in a row (an outage)."""
        return RuntimeError(f"{self.source_label()}: {failures} receives failed in a row ({type(exc).__name__}: {exc})")

    async def _end_receives(self) -> None:
        """The loop ends (or the producer closes): receives still travelling are cancelled."""
        tasks = list(self._receives)
        self._receives.clear()
        await cancel_and_wait(*tasks)

    def sdk_buffered_messages(self) -> int:
        """
        Messages the broker's SDK buffers by count ahead of a receive, outside the credit (Service
        Bus ``prefetch_count``): the byte budget reserves room for them at the size estimate.
        """
        return 0

    def lane_of(self, broker_payload: Any) -> Hashable:
        """The ordered lane of one delivery (partition, message group, session); None = one lane."""
        return None

    def batch_lane_of(self, broker_payload: Any) -> Hashable:
        """
        Which messages may share a batch (batch mode): those of one *ordered* lane. Brokers that
        give each unordered message a lane of its own (so a slow one never holds back another)
        override this to put all unordered messages in one batch lane.
        """
        return self.lane_of(broker_payload)

    @abc.abstractmethod
    async def _apply(self, decided: Sequence[Decided[DeliveryT]]) -> Sequence[Decided[DeliveryT]] | None:
        """
        Carry out the dispositions of one lane's batch on the broker, in order.

        Return what was actually done when it differs from ``decided`` (e.g. a lost lease turned a
        delete into a redelivery), same length and order; ``None`` means "as decided". Counters
        and metrics follow the returned list.
        """

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release broker clients (best-effort)."""

    @property
    def gate(self) -> FlowGate:
        if self._gate is None:
            gate = gates.acquire(self.stream_key)
            gate.window = flow_window(self.queue_size)
            # In batch mode the gate counts batches (what the watchers' queues hold).
            gate.max_in_flight = -(-self.settings.max_in_flight // self.batch_size)
            gate.count_batches(self.settings.max_payload_bytes if self.batching else 0, self.batch_size)
            gate.max_in_flight_bytes = self.settings.max_in_flight_bytes
            gate.receive_copies = self.receive_copies
            # An SDK that buffers by count ahead of a receive (Service Bus prefetch_count, per
            # session receiver) holds that many more messages outside our credit: reserved at the
            # size estimate.
            gate.buffered_messages = self.sdk_buffered_messages()
            if not gate.buffered_messages:
                # The first receive assumes maximum-size messages. Not with a prefetching SDK: it
                # buffers its prefetch whatever that receive asks for, so a smaller first receive
                # would bound nothing and only change the order receives take messages in.
                largest = self.max_message_bytes
                gate.expect_size(largest + min(largest, self.max_envelope_bytes) + HELD_OVERHEAD)
            gate.unfreeze()  # a new group: a stop seen by the previous one is over
            gate.begin_slow_start()
            self._fired_reported = gate.fired  # the gate may outlive an earlier producer
            self._gate = gate
        return self._gate

    async def cohort_ready(self) -> None:
        """
        Wait, before the first receive, until every watcher of this stream has subscribed (see
        _core/cohort.py): a message read earlier would be committed without the late ones.
        """
        cohort = self.gate.cohort
        if cohort.formed:
            return
        settle, max_wait = cohort_limits()
        await cohort.wait_ready(settle=settle, max_wait=max_wait, stream=self.source_label())
        cohort.schedule_write(record_key(self.stream_key))
        interval = heartbeat_interval()
        if interval > 0 and cohort_record_enabled() and self._split_task is None:
            self.split_watch = SplitWatch(
                cohort,
                stream_key=self.stream_key,
                stream=self.source_label(),
                competing=self.competing_consumers(),
                interval=interval,
                on_split=lambda count: self.counters.gauge("split_triggerers", count),
            )
            self._split_task = asyncio.ensure_future(self.split_watch.run())

    def competing_consumers(self) -> bool:
        """
        Whether two streams of this stream's key on two triggerers take messages from each other
        (queues, one subscription): then a split across triggerers loses messages for watchers
        (see _core/split.py). Kafka with watcher positions overrides this.
        """
        return True

    def credit(self) -> int:
        """How many messages may be received now (the gate's credit; in batch mode, batches of them)."""
        if not self.batching:
            return self.gate.credit()
        gate = self.gate
        return max(0, min(gate.credit() * self.batch_size - self._unbatched, gate.byte_credit()))

    async def wait_for_credit(self, minimum: int = 1) -> int:
        """
        Wait until at least one message may be received; return how many may be (``minimum``:
        see :meth:`FlowGate.wait_for_credit`, per-message mode only).
        """
        if not self.batching:
            return await self.gate.wait_for_credit(minimum)
        while True:
            await self.gate.wait_for_credit()
            available = self.credit()
            if available > 0:
                return available
            # Credit for whole batches, all taken by messages still forming batches: they are
            # broadcast within batch_timeout, and the gate's credit moves only when batches are.
            await asyncio.sleep(min(0.05, self.settings.batch_timeout or 0.05))

    def envelope(
        self,
        *,
        source: str,
        message_id: str,
        body: bytes | str | None,
        attributes: dict[str, str],
        published_at: str | None,
        delivery_attempt: int,
        metadata: dict[str, Any],
        unreadable: BaseException | None = None,
    ) -> tuple[dict[str, Any], str | None]:
        """
        The envelope of one message and its forced rejection (see :func:`build_envelope`).

        The envelope stage guard: this runs in the receive loop, where an exception would end the
        stream (every watcher fails) and the message would come back to fail again on every
        restart. Whatever building the envelope raises, the message is forced-rejected instead
        (``envelope failed: <ExcType>: ...``, see :func:`fallback_envelope`), so every watcher
        rejects it and it is dead-lettered intact with that reason. ``unreadable``: the error a
        broker's own conversion of the message (an AMQP value body, say) already met; the message
        takes the same path without a try.
        """
        if unreadable is None:
            try:
                return build_envelope(
                    broker=self.broker,
                    source=source,
                    message_id=message_id,
                    body=body,
                    attributes=attributes,
                    published_at=published_at,
                    delivery_attempt=delivery_attempt,
                    metadata=metadata,
                    max_payload_bytes=self.max_envelope_bytes,
                    oversize_policy=self.settings.oversize_policy,
                )
            except Exception as exc:
                unreadable = exc
        return self.failed_envelope(
            source=source,
            message_id=message_id,
            body=body,
            published_at=published_at,
            delivery_attempt=delivery_attempt,
            error=unreadable,
        )

    def failed_envelope(
        self,
        *,
        source: str,
        message_id: str,
        body: bytes | str | None,
        published_at: str | None,
        delivery_attempt: int,
        error: BaseException,
    ) -> tuple[dict[str, Any], str]:
        """
        The fallback envelope and forced rejection of a message whose envelope could not be built
        (:func:`fallback_envelope`), logged once. For producers that call :func:`build_envelope`
        themselves on their hot path (Kafka) and must not let its exception reach the group.
        """
        envelope, reason = fallback_envelope(
            broker=self.broker,
            source=source,
            message_id=message_id,
            body=body,
            published_at=published_at,
            delivery_attempt=delivery_attempt,
            max_payload_bytes=self.max_envelope_bytes,
            error=error,
        )
        # Both quote sender-controlled text (an id, the exception's message): one log line each.
        self.log.error(
            "%s: message %s has no envelope, dead-lettering it: %s",
            self.source_label(),
            log_safe(envelope["message_id"]),
            log_safe(reason, REASON_LOG_LIMIT),
        )
        return envelope, reason

    def stream_message(
        self, envelope: dict[str, Any], forced_rejection: str | None, body: object = None
    ) -> StreamMessage:
        """
        Wrap an envelope for broadcast. Call immediately before ``yield`` (no await in between):
        the seq taken here must reach the watchers' queues in the same step. ``body``: the raw
        body the delivery keeps (for the dead-letter path), counted with the envelope against
        ``max_in_flight_bytes`` (:meth:`hold`).
        """
        return self.hold(StreamMessage(envelope, self.take_seq(), forced_rejection), body)

    def hold(self, message: StreamMessage, body: object) -> StreamMessage:
        """
        Count ``message`` against the byte budget until it is advanced (or abandoned on close):
        its raw ``body``, its attributes twice (the delivery's and the envelope's) and its
        envelope (the body again unless dropped for size, plus a fixed overhead). An estimate of
        what the message keeps alive, computed without serializing anything. Producers that build
        their own :class:`StreamMessage` call it right after :meth:`take_seq`, before the yield.
        """
        envelope = message.envelope
        # Runs once per message: the usual bytes body without the generic check's union isinstance.
        raw = len(body) if type(body) is bytes else body_size(body)
        nbytes = raw + HELD_OVERHEAD
        if raw and envelope.get("body_encoding") != "none":
            cap = self.max_envelope_bytes
            nbytes += raw if raw < cap else cap
        attributes = envelope.get("attributes")
        if attributes:
            nbytes += 2 * sum(len(k) + len(v) for k, v in attributes.items())
        message.held_bytes = nbytes
        self._held_bytes += nbytes
        gate = self._gate or self.gate
        gate.hold_bytes(nbytes)
        if self.gives_back_missed_messages and not self.batching:
            message.audience = gate.audience  # broadcast right after this (batch mode: _on_batch)
            message.generation = gate.generation
        return message

    def take_seq(self) -> int:
        """
        Count one more message in flight and return its flow-control sequence number; for
        producers that build their own :class:`StreamMessage` subclass (same rule as
        :meth:`stream_message`: call it immediately before the ``yield``).
        """
        self._in_flight += 1
        self.deferred.release_some()
        if self.batching:
            self._unbatched += 1
            return 0  # the batch takes the seq when it is broadcast (_on_batch)
        return self.gate.next_seq()

    # -- the stream ----------------------------------------------------------------------------
    def open_stream(self) -> AsyncIterator[tuple[Any, Any]]:
        """The broker's messages, one raw event each, or in batches when ``batch_size > 1``."""
        require_airflow_internals()  # before anything is read: see _core/airflow_internals.py
        if not self.batching:
            return self._messages()
        batcher = Batcher(
            batch_size=self.batch_size,
            batch_timeout=self.settings.batch_timeout,
            max_payload_bytes=self.settings.max_payload_bytes,
            lane_of=self.batch_lane_of,
        )
        return batched_stream(self._messages(), batcher, on_batch=self._on_batch)

    def _on_batch(self, batch: MessageBatch) -> None:
        """A batch is broadcast now (called right before its yield): it takes one seq of the gate."""
        self._unbatched -= len(batch)
        self._batches_in_flight += 1
        gate = self.gate
        batch.seq = gate.next_seq()
        if self.gives_back_missed_messages:
            audience, generation = gate.audience, gate.generation
            for message in batch.messages:
                message.audience = audience
                message.generation = generation
        self.counters.add("batches")

    def attempt_key(self, delivery: DeliveryT) -> Hashable:
        """The id a message keeps across its deliveries (forgiven collateral failures are kept by it)."""
        return delivery.message.envelope.get("message_id")

    def get_advance_lane(self, broker_payload: Any) -> Hashable:
        if isinstance(broker_payload, MessageBatch):
            return broker_payload.lane
        return self.lane_of(broker_payload)

    # -- SharedStreamProducer ------------------------------------------------------------------
    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        raw_events = len(batch)
        if self.batching:
            batch = expand_batches(batch)
        max_attempts = self.settings.max_delivery_attempts
        decided: list[Decided[DeliveryT]] = []
        clean = 0
        held_bytes = 0
        for item in batch:
            delivery: DeliveryT = item.broker_payload
            message = delivery.message
            held_bytes += message.held_bytes
            outcome = item.outcome
            # Fast path, almost every message: every watcher of its audience acked it and none
            # recorded a failure. Same result as decide() (tests/unit/test_dispositions.py),
            # without its calls per message.
            if (
                outcome.acked >= message.audience
                and outcome.acked
                and not outcome.failed
                and not outcome.rejected
                and message.failures is None
                and message.rejections is None
            ):
                decided.append(Decided(delivery, COMMIT_DECISION))
                clean += 1
                continue
            reached = outcome.acked + outcome.failed + outcome.rejected
            # Reached none: held back already, like a broadcast nobody saw (decide). Reached fewer
            # than its audience: broadcast without a force-failed watcher still registered: hold
            # the intake until it leaves (_core/flow.py, shortfall); the message goes back.
            if reached and reached < message.audience:
                missed = message.audience - reached
                self.gate.shortfall(missed, message.generation, self.source_label())
                outcome = with_missed_watchers(outcome, missed)
            if not outcome.failed and not outcome.rejected and not message.rejections and unrecorded_only(message):
                # Its events were never recorded (a triggerer stopping): nothing judged the message,
                # so it goes back without counting a delivery attempt, like one nobody saw.
                decided.append(Decided(delivery, UNRECORDED_DECISION))
                continue
            decided.append(self._decide(delivery, message_outcome(outcome, message), max_attempts))
        try:
            applied = await self._apply(decided)
        finally:
            # Whatever _apply did, these messages left the manager: give the credit back.
            self._in_flight -= len(batch)
            if self.batching:
                self._batches_in_flight -= raw_events
            self._held_bytes -= held_bytes
            self.gate.release_bytes(held_bytes)
            self.gate.advanced(raw_events)
        if applied is not None and len(applied) != len(decided):
            raise RuntimeError(f"{type(self).__name__}._apply returned {len(applied)} results for {len(decided)}")
        if applied is None and clean == len(decided):
            self._count_commits(len(decided))
        else:
            self._count(batch, applied if applied is not None else decided)
        self._defer_release(batch, decided, held_bytes)

    def _decide(self, delivery: DeliveryT, outcome: AdvanceOutcome, max_attempts: int | None) -> Decided[DeliveryT]:
        """
        :func:`decide` for a message that is not simply committed, on its *counted* attempts: the
        broker's delivery count less the collateral failures forgiven so far (``_core/attempts.py``).
        A failure is collateral when the manager failed the message only because it failed a
        watcher that stood on another one: no watcher failed on it (``culprit``), none stood on it
        (``suspect``), none rejected it.
        """
        message = delivery.message
        forgiven = self._forgiven
        if forgiven is None:
            decision = decide(
                outcome,
                delivery_attempt=delivery.delivery_attempt,
                max_delivery_attempts=max_attempts,
                rejections=message.rejections,
            )
            return Decided(delivery, decision)
        key = self.attempt_key(delivery)
        earlier = forgiven.get(key)
        # Durable: the broker's count was set back for the earlier ones already.
        counted = delivery.delivery_attempt - (0 if self.forgiveness_is_durable else earlier)
        delivered = delivery.delivery_attempt + (earlier if self.forgiveness_is_durable else 0)
        collateral = bool(outcome.failed) and not outcome.rejected and not message.culprit and not message.suspect
        decision = decide(
            outcome,
            delivery_attempt=counted - 1 if collateral else counted,  # this delivery is not its failure either
            max_delivery_attempts=max_attempts,
            rejections=message.rejections,
        )
        if decision.disposition is Disposition.REDELIVER and collateral:
            if max_attempts is not None and delivered >= max_attempts * COLLATERAL_CEILING:
                forgiven.forget(key)
                return Decided(
                    delivery,
                    Decision(
                        Disposition.DEAD_LETTER,
                        f"poison message: delivered {delivered} times, each failed beside another message's "
                        f"failure (ack timeouts or overflows; the ceiling is {COLLATERAL_CEILING} x "
                        f"max_delivery_attempts={max_attempts})",
                    ),
                )
            forgiven.increment(key)
            return Decided(delivery, decision, forgiven=True)
        if decision.disposition in (Disposition.COMMIT, Disposition.DEAD_LETTER):
            forgiven.forget(key)
        return Decided(delivery, decision)

    def _defer_release(
        self, batch: Sequence[AdvanceItem], decided: Sequence[Decided[DeliveryT]], held_bytes: int
    ) -> None:
        """
        Hand an advanced batch to :attr:`deferred`, unless the messages it holds would pass
        :attr:`_deferred_bytes_limit`: what ``deferred`` holds counts against no credit, and with
        large messages the GC smoothing it buys is worth less than their memory. ``_deferred_bytes``
        only grows between full releases here, so it is an upper bound of what is held.
        """
        if self._deferred_bytes + held_bytes > self._deferred_bytes_limit:
            self.deferred.release_all()
            self._deferred_bytes = 0
            if held_bytes > self._deferred_bytes_limit:
                return  # freed now, with the manager's references
        self._deferred_bytes += held_bytes
        self.deferred.hold(batch)
        self.deferred.hold(decided)

    def _count_commits(self, count: int) -> None:
        """:meth:`_count` for a batch committed as decided (the usual one): no per-message pass."""
        counters = self.counters
        counters.add("advanced", count)
        counters.add("committed", count)
        self._count_fired_and_outstanding()

    def _count(self, batch: Sequence[AdvanceItem], decided: Sequence[Decided[DeliveryT]]) -> None:
        committed = dead_lettered = redelivered = held = rejected = poison = 0
        for item, entry in zip(batch, decided, strict=True):
            disposition = entry.disposition
            if disposition is Disposition.COMMIT:
                committed += 1
                continue
            was_rejected = item.outcome.rejected or entry.delivery.message.rejections
            if was_rejected:
                rejected += 1
            if disposition is Disposition.DEAD_LETTER:
                dead_lettered += 1
                if not was_rejected:
                    poison += 1
            elif disposition is Disposition.REDELIVER:
                redelivered += 1
            else:
                held += 1
        counters = self.counters
        counters.add("advanced", len(decided))
        counters.add("committed", committed)
        counters.add("dead_lettered", dead_lettered)
        counters.add("redelivered", redelivered)
        counters.add("held", held)
        counters.add("rejected", rejected)
        counters.add("poison", poison)
        self._count_fired_and_outstanding()

    def _count_fired_and_outstanding(self) -> None:
        counters = self.counters
        gate = self.gate
        counters.add("fired", gate.fired - self._fired_reported)
        self._fired_reported = gate.fired
        counters.gauge("outstanding", self._in_flight)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.deferred.release_all()
        await cancel_and_wait(self._split_task)
        try:
            await self._close()
        finally:
            gate, self._gate = self._gate, None
            if gate is not None:
                # Messages still in flight are abandoned to broker redelivery; discharge them so
                # a later producer on the same gate starts with full credit.
                gate.release_bytes(self._held_bytes)
                gate.advanced(self._batches_in_flight if self.batching else self._in_flight)
                self._in_flight = self._batches_in_flight = self._unbatched = self._held_bytes = 0
                gates.release(self.stream_key, gate)
