"""
Producer-side flow control, so that a backlog never overflows a healthy watcher.

The manager has no back-pressure: it pulls from ``open_stream`` without waiting and force-fails a
watcher whose queue (``[triggerer] shared_stream_subscriber_queue_size``) is full. A producer that
reads a backlog at broker speed therefore overflows every watcher whose filter is slower than a
batch fetch (the real triggerer logs every event through a thread executor).

Invariant kept here: for every registered watcher ``w``, ``produced - consumed[w] <= window``,
where ``consumed[w]`` is the ``seq`` of the last message ``w`` pulled. Every message a watcher has
not pulled yet sits in its queue, so its queue never holds more than ``window`` messages, and
``window`` is below the configured queue size.

Registration is atomic with the manager's ``subscribe``: the runner calls ``subscribe`` and then
starts ``filter_shared_stream`` with no ``await`` in between, and our filter registers before its
first ``await``. So no watcher can receive a message the gate did not count.

The window also shrinks with the number of watchers: every queued message costs the manager one
binding per watcher (plus the event objects of the watchers that fired), and those objects are what
the cyclic GC walks over and over. With two or more watchers the gate keeps ``queued messages x
watchers`` within :data:`BINDING_BUDGET` (never below :data:`MIN_WINDOW` messages, never above the
configured window): 10 watchers queue at most 204 messages each instead of 960, 32 and more 64.
Measured with Kafka at N=10: +20-30% msgs/s; a lone watcher gains nothing from a smaller window
(its in-flight messages are bounded by the persistence round, not its queue). Shrinking only
tightens the invariant above, so it holds through (un)registering.

A second, independent bound caps messages in flight (yielded but not yet advanced), which bounds
memory and the number of leases a producer keeps alive. In batch mode it counts batches, and it
also shrinks with the number of watchers: every watcher's event of a batch is a copy of up to
``max_payload_bytes`` once it leaves the trigger runner (the runner dumps each event's payload for
the supervisor, which decodes and keeps each until it is persisted), so unpersisted events of
``b`` batches weigh up to ``b x watchers x max_payload_bytes``, several times that as Python
objects, in both triggerer processes. The gate keeps that within :data:`EVENT_BYTES_BUDGET` (never
below :data:`MIN_BATCHES_IN_FLIGHT`). Measured at N=100, 64 KiB batches: 20 batches in flight
peaked the triggerer at 2.1 GB RSS; the supervisor persists ~0.7 batch a second for 100 watchers,
so 5 batches keep it as busy.

Slow start: a new producer does not take the whole in-flight bound at once. Its limit starts at
:data:`SLOW_START_EVENTS` events (messages x watchers, at least :data:`MIN_START_IN_FLIGHT`
messages) and grows by one for every message advanced, so it doubles with every persistence round
until it reaches the bound above. Batch mode needs none: the byte budget above already bounds its
events in flight to ``EVENT_BYTES_BUDGET / max_payload_bytes`` (512 at the default 64 KiB). Why: after a
restart the stream finds the backlog the outage left, and the triggerer's supervisor confirms the
events it stores only after storing all it received (one DB session per event), so a stream that
fanned out thousands of messages at once commits nothing until all of their events are stored. A
triggerer killed more often than that made no commit progress at all (docs/reliability.md, Kill
loops: Kafka re-read a growing backlog for 13 triggerer lives). Costs a few persistence rounds of
throughput at start, nothing after.

Memory is bounded in bytes too, not only in messages: every message in flight keeps its raw body
(for the dead-letter path) and its envelope, and a backlog of maximum-size messages (Pub/Sub 10 MB,
Service Bus Premium 100 MB) at ``max_in_flight`` messages would run the shared triggerer out of
memory. The producer reports what each message it holds weighs (:meth:`FlowGate.hold_bytes`, an
estimate: raw body, attributes, envelope) and gives it back when the message is advanced or
abandoned (:meth:`FlowGate.release_bytes`). Invariant: a receive starts only while the held bytes
are below ``max_in_flight_bytes``, and asks for at most ``remaining / size estimate`` messages
(:meth:`FlowGate.byte_credit`), the estimate being a decaying maximum of the recent message sizes,
and before the first message the broker's maximum message size (:meth:`FlowGate.expect_size`): a
restart that finds a backlog of maximum-size messages must not fetch a whole receive's worth of them
before it knows their size (that first receive asks for at least :data:`MIN_START_IN_FLIGHT`
messages, though: it may overshoot by that many). So with messages of one size the stream holds at
most the budget plus one message; a message larger than the budget still flows, alone (at least one
message may always be in flight: an empty stream always has credit for one), and is then bounded by
the broker's own maximum. Messages larger than the estimate overshoot by at most what one receive
call brings. What an SDK buffers by count ahead of a receive (Service Bus ``prefetch_count``) is
reserved at the estimate (:attr:`FlowGate.buffered_messages`), up to half the budget. A client
that holds a receive's messages several times while the call runs (:attr:`FlowGate.receive_copies`;
Pub/Sub: gRPC's buffer, the parsed protobuf, our copy) has each of them counted that many times:
a receive asks only for what fits the budget with its copies, and none while not one fits and
something is held, so held bytes plus the receive's copies stay within the budget at its peak.

A **shortfall** (queue brokers, _core/cohort.py "returning members"): the manager stops
broadcasting to a watcher the moment it force-fails it, but the watcher leaves the gate only when
it next pulls from its queue, which can be much later (a filter still running, in a thread). The
producer sees it first, as a message whose outcome reached fewer watchers than its audience, and
reports it (:meth:`FlowGate.shortfall`): no credit until the registered watchers change (the
failed one leaves, and the cohort's hold for it takes over), at most ``cohort_max_wait`` seconds;
after that the audience leaves the missing watchers out until the registered watchers change.
Without this hold every message read meanwhile went round between the broker and the one healthy
watcher until the failed one left (measured: 4 deliveries each in a 7 s stall,
tests/e2e/test_returning_watcher_e2e.py), and a longer stall would have reached the collateral
ceiling and dead-lettered valid messages.

One :class:`FlowGate` exists per shared-stream key per process, shared by the producer and the
watchers through :data:`gates` (the manager gives neither side a handle on the other).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable
from typing import Final

from airflow_shared_stream_provider._core.cohort import Cohort
from airflow_shared_stream_provider._core.positions import WatcherPositions
from airflow_shared_stream_provider._core.tasks import wait_for

log = logging.getLogger(__name__)

# Queued (not yet pulled) messages x watchers the gate allows; see the module docstring.
BINDING_BUDGET: Final = 2_048
MIN_WINDOW: Final = 64
# Batch payload bytes of all watchers' unpersisted events (see the module docstring).
EVENT_BYTES_BUDGET: Final = 32 * 1024 * 1024
MIN_BATCHES_IN_FLIGHT: Final = 2
# Slow start (see the module docstring): the events a new producer's first round may fan out.
SLOW_START_EVENTS: Final = 512
MIN_START_IN_FLIGHT: Final = 16
# Bytes of held messages a stream may have in flight by default (see _core/settings.py).
DEFAULT_MAX_IN_FLIGHT_BYTES: Final = 64 * 1024 * 1024
# The size estimate decays by 1/2**SIZE_ESTIMATE_DECAY_SHIFT per message smaller than it: a single
# 10 MB message among 1 KB ones stops limiting the credit after ~150 messages.
SIZE_ESTIMATE_DECAY_SHIFT: Final = 4


def scaled_window(configured: int, watchers: int) -> int:
    """The per-watcher window for ``watchers`` watchers: within the binding budget, at most ``configured``."""
    if watchers <= 1:
        return configured
    return min(configured, max(MIN_WINDOW, BINDING_BUDGET // watchers))


def scaled_in_flight(configured: int, batch_bytes: int, watchers: int) -> int:
    """
    Most batches (``batch_bytes`` > 0: at most that many bytes per watcher event) or messages
    (``batch_bytes`` == 0) in flight for ``watchers`` watchers: at most ``configured``.
    """
    if batch_bytes <= 0 or watchers <= 0:
        return configured
    return min(configured, max(MIN_BATCHES_IN_FLIGHT, EVENT_BYTES_BUDGET // (watchers * batch_bytes)))


class FlowGate:
    """Credit between one producer and the watchers of its shared stream."""

    def __init__(self) -> None:
        self._configured_window = 1024
        self._window = 1024
        self._configured_in_flight = 10_000
        self._max_in_flight = 10_000
        self._batch_bytes = 0
        # Messages per unit the gate counts (batch_size in batch mode, else 1).
        self._unit = 1
        # Byte budget (see the module docstring): bytes the producer holds now, the budget, the
        # decaying maximum of recent message sizes, and messages an SDK buffers by count.
        self.held_bytes = 0
        self.max_in_flight_bytes = DEFAULT_MAX_IN_FLIGHT_BYTES
        self._size_estimate = 0
        self._size_seen = False
        self.buffered_messages = 0
        # Bytes a receive costs while it runs, per byte it brings (1: only our copy). See
        # byte_credit; set by the producer (SharedStreamProducerBase.receive_copies).
        self.receive_copies = 1
        # Slow start: the in-flight limit while it ramps up (None: ramped up; -1: starts at the
        # first credit, once the cohort of watchers is known).
        self._ramp: int | None = None
        # Set when a watcher finds the manager stopping this stream (``_core/binding.py``): no
        # credit until the next producer binds the gate.
        self.frozen = False
        self._produced = 0
        self._advanced = 0
        self._consumed: dict[int, int] = {}
        # Cached minimum of ``_consumed`` (or ``_produced`` with no watcher); recomputed only when
        # the cheap check fails, so the per-message cost is O(1) and not O(watchers).
        self._floor = 0
        self._wakeup: asyncio.Event | None = None
        self._blocked = False
        # While blocked, a watcher's pull wakes the producer only once it brings that watcher's
        # lag down to half a window: N watchers then cost N wake-ups per half window, not one
        # wake-up (and an O(N) minimum) per watcher per message.
        self._resume_seq = 0
        self.refs = 0
        # Events fired by all watchers of the stream: a plain counter bumped per event (cheap);
        # the producer reports its growth to Stats once per advance batch.
        self.fired = 0
        # Which watchers the producer waits for before its first receive, and for which returning
        # ones it stops reading (see _core/cohort.py): their joins wake a producer waiting here.
        self.cohort = Cohort()
        self.cohort.on_change = self._wake
        # A shortfall (module docstring): the registrations' generation it was seen at (-1: none;
        # every register / unregister starts a new one), until when it holds the credit, and how
        # many watchers the audience leaves out after that.
        self._generation = 0
        self._short_at = -1
        self._short_until = 0.0
        self._short_missed = 0
        self._discount = 0
        # Each watcher's stored position, for brokers that keep them (see _core/positions.py).
        self.positions = WatcherPositions()

    # -- producer side -------------------------------------------------------------------------
    @property
    def window(self) -> int:
        """The per-watcher window now: the configured one, scaled down for many watchers."""
        return self._window

    @window.setter
    def window(self, configured: int) -> None:
        self._configured_window = configured
        self._rescale()

    @property
    def max_in_flight(self) -> int:
        """Most messages (batches in batch mode) in flight now: the configured number, scaled."""
        return self._max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, configured: int) -> None:
        self._configured_in_flight = configured
        self._rescale()

    def count_batches(self, batch_bytes: int, batch_size: int = 1) -> None:
        """
        Batch mode: the gate counts batches of up to ``batch_size`` messages whose watcher events
        carry up to ``batch_bytes`` each.
        """
        self._batch_bytes = batch_bytes
        self._unit = max(1, batch_size) if batch_bytes > 0 else 1
        self._rescale()

    # -- byte budget ---------------------------------------------------------------------------
    @property
    def size_estimate(self) -> int:
        """The decaying maximum of recent message sizes (0 before the first message)."""
        return self._size_estimate

    def expect_size(self, nbytes: int) -> None:
        """Until the first message is held, estimate its size as ``nbytes`` (the broker's maximum)."""
        if not self._size_seen:
            self._size_estimate = nbytes

    def hold_bytes(self, nbytes: int) -> None:
        """The producer holds one more message of ``nbytes`` (until :meth:`release_bytes`)."""
        self.held_bytes += nbytes
        if not self._size_seen:
            self._size_seen = True
            self._size_estimate = nbytes  # the first message replaces the prior
            return
        estimate = self._size_estimate
        self._size_estimate = nbytes if nbytes >= estimate else estimate - (estimate >> SIZE_ESTIMATE_DECAY_SHIFT)

    def release_bytes(self, nbytes: int) -> None:
        """Held messages of ``nbytes`` in all left flight (the caller then calls :meth:`advanced`)."""
        self.held_bytes -= nbytes

    def byte_credit(self) -> int:
        """
        How many messages the byte budget lets a receive ask for now: none while the held bytes
        (plus the SDK's buffered messages, at the estimate) reach the budget, except one when
        nothing is held; else the remaining bytes at the size estimate, at least one.
        """
        held = self.held_bytes
        estimate = self._size_estimate
        budget = self.max_in_flight_bytes
        # At most half the budget: an SDK buffer larger than that is over the budget whatever we
        # receive, and shrinking our share further would only cost throughput (one message per
        # persistence round) without bounding it; the docs say to lower prefetch_count instead.
        remaining = budget - held - min(self.buffered_messages * estimate, budget // 2)
        if remaining <= 0:
            return 0 if held > 0 else 1
        if estimate <= 0:
            return remaining  # nothing seen yet: the message bounds decide (one receive may overshoot)
        if not self._size_seen:
            # The first receive, sized at the broker's maximum, but not below slow start's first
            # round: a smaller one would change how every stream starts, not only those of large
            # messages (Pub/Sub hands out an ordering key's next messages only once the earlier
            # ones are acked, so a first pull of a few would leave the rest waiting a round).
            return max(MIN_START_IN_FLIGHT, remaining // estimate)
        copies = self.receive_copies
        if copies <= 1:
            return max(1, remaining // estimate)
        # A client that holds each message several times while a receive runs (its buffer, its
        # parse, our copy): the receive's messages count that many times, so that what is held
        # plus what the receive brings stays within the budget at its peak. None while even one
        # does not fit (what is held leaves first), one when nothing is held (progress).
        fits = remaining // (estimate * copies)
        if fits > 0:
            return fits
        return 0 if held > 0 else 1

    @property
    def produced(self) -> int:
        return self._produced

    @property
    def in_flight(self) -> int:
        return self._produced - self._advanced

    def lag(self) -> int:
        """How far the slowest registered watcher is behind the producer."""
        return self._produced - self._recompute_floor()

    def next_seq(self) -> int:
        """Account for one message about to be yielded; returns its ``seq``."""
        self._produced += 1
        return self._produced

    def freeze(self) -> None:
        """No more credit: the stream is being stopped (what is read now would only come back)."""
        self.frozen = True

    def unfreeze(self) -> None:
        self.frozen = False

    def begin_slow_start(self) -> None:
        """A new producer: its in-flight limit ramps up from a first round (see the module docstring)."""
        self._ramp = -1

    @property
    def in_flight_limit(self) -> int:
        """The in-flight bound now: :attr:`max_in_flight`, or less while slow start ramps up."""
        ramp = self._ramp
        if ramp is None:
            return self._max_in_flight
        if ramp < 0:
            if self._batch_bytes > 0:
                self._ramp = None  # bounded by bytes already (see the module docstring)
                return self._max_in_flight
            ramp = max(MIN_START_IN_FLIGHT, SLOW_START_EVENTS // max(1, len(self._consumed)))
            self._ramp = ramp
        if ramp >= self._max_in_flight:
            self._ramp = None
            return self._max_in_flight
        return ramp

    @property
    def audience(self) -> int:
        """
        How many watchers a message broadcast now must reach before it may be settled: those
        registered, plus those force-failed out of the stream and not back yet (_core/cohort.py).
        """
        away = self.cohort.away_total
        return len(self._consumed) + (self.cohort.away_count() if away else 0) - self._discount

    @property
    def generation(self) -> int:
        """Grows with every register and unregister: which watchers a message was broadcast to."""
        return self._generation

    def shortfall(self, missed: int, generation: int, stream: str) -> None:
        """
        A message broadcast at ``generation`` reached ``missed`` fewer watchers than its audience:
        one the manager force-failed is still registered here. Hold the credit until the
        registered watchers change, at most ``cohort_max_wait`` (see the module docstring).
        """
        if generation != self._generation:
            return  # the watchers changed since its broadcast: a later message tells if it still holds
        if self._short_at == self._generation or self._discount:
            return  # known already (or given up on: the audience leaves it out now)
        self._short_at = self._generation
        self._short_missed = missed
        self._short_until = self.cohort.clock() + self.cohort.max_wait
        log.warning(
            "Shared stream %s reads nothing until the watcher(s) the triggerer force-failed leave: "
            "%d watcher(s) did not get a message; it goes back to the broker (at most %.0f s)",
            stream,
            missed,
            self.cohort.max_wait,
        )
        self._wake()

    def _shortfall_hold(self) -> float:
        """Seconds the credit is still held for a shortfall (0: none, or over)."""
        if self._short_at < 0:
            return 0.0
        if self._short_at != self._generation:
            self._short_at = -1  # the registered watchers changed: over
            return 0.0
        remaining = self._short_until - self.cohort.clock()
        if remaining > 0:
            return remaining
        log.warning(
            "A shared stream reads again after %.0f s although %d force-failed watcher(s) never left: "
            "messages are settled without them until the stream's watchers change",
            self.cohort.max_wait,
            self._short_missed,
        )
        self._short_at = -1
        self._discount = self._short_missed
        return 0.0

    def credit(self) -> int:
        """How many messages may be yielded now without waiting (0 when blocked, frozen or holding)."""
        if self.frozen:
            return 0
        if self.cohort.away_total and self.cohort.hold_remaining() > 0:
            return 0  # a watcher the triggerer force-failed is not back yet (_core/cohort.py)
        if self._short_at >= 0 and self._shortfall_hold() > 0:
            return 0  # a watcher the triggerer force-failed has not left yet (module docstring)
        window = self._window
        by_lag = window - (self._produced - self._floor)
        if by_lag <= 0:
            by_lag = window - (self._produced - self._recompute_floor())
        by_flight = self.in_flight_limit - self.in_flight
        by_bytes = self.byte_credit()
        if by_bytes <= 0:
            return 0
        unit = self._unit
        if unit > 1:
            by_bytes = -(-by_bytes // unit)  # batches; the producer caps the messages (credit())
        return max(0, min(by_lag, by_flight, by_bytes))

    def lag_credit(self) -> int:
        """What the slowest watcher's queue alone allows (its window less what it has queued)."""
        return self._window - self.lag()

    def is_trickle(self, available: int, minimum: int, asked: int = 0) -> bool:
        """
        Whether ``available`` credit is a trickle: below ``minimum`` only because the slowest
        watcher's queue holds it back (``asked``: credit already asked for by receives travelling
        or taken by messages not yet yielded). See :meth:`wait_for_credit`.
        """
        return available < minimum and self.lag_credit() - asked < minimum

    async def wait_for_credit(self, minimum: int = 1) -> int:
        """
        Wait until at least one message may be yielded; return the available credit.

        ``minimum`` (> 1): while the slowest watcher's queue is what holds the credit below it,
        wait until that queue has room for ``minimum`` (a producer's smallest receive worth its
        call, see :meth:`SharedStreamProducerBase.receive_floor`): that queue frees its room a
        message at a time, and receiving each trickle costs a broker call for a few messages.
        Credit held back by anything else (in flight, bytes) is returned as it is.
        """
        while True:
            available = self.credit()
            if available > 0 and not self.is_trickle(available, minimum):
                return available
            if self._wakeup is None:
                self._wakeup = asyncio.Event()
            self._wakeup.clear()
            # Woken when a watcher passed this seq (consumed()): for a short credit, once the
            # slowest one has room for ``minimum``; for none, once half a window is free.
            self._resume_seq = self._produced - (self._window - minimum if available > 0 else self._window // 2)
            self._blocked = True
            # Holding for an away watcher or a shortfall: also wake when the hold ends.
            holding = max(
                self.cohort.hold_remaining() if self.cohort.away_total else 0.0,
                self._shortfall_hold() if self._short_at >= 0 else 0.0,
            )
            try:
                if holding > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await wait_for(self._wakeup.wait(), holding)
                else:
                    await self._wakeup.wait()
            finally:
                self._blocked = False

    def advanced(self, count: int) -> None:
        """``count`` messages left flight (advanced on the broker, or abandoned)."""
        self._advanced += count
        if self._ramp is not None and self._ramp >= 0:
            self._ramp += count  # one more per message advanced: doubles every round
        self._wake()

    # -- watcher side --------------------------------------------------------------------------
    def register(self, token: int) -> None:
        """A watcher joins: it will receive messages produced from now on."""
        self._consumed[token] = self._produced
        self._generation += 1
        self._discount = 0  # the watchers changed: a shortfall given up on is over
        self._rescale()
        self._wake()

    def unregister(self, token: int) -> None:
        if self._consumed.pop(token, None) is not None:
            self._generation += 1
            self._discount = 0
            self._rescale()
            self._wake()

    def consumed(self, token: int, seq: int) -> None:
        """A watcher pulled message ``seq`` from its queue."""
        before = self._consumed.get(token, seq)
        self._consumed[token] = seq
        # Woken as a watcher *crosses* the resume seq (the slowest one's crossing is the one that
        # frees the credit); watchers already past it do not wake the producer for every message.
        if self._blocked and before < self._resume_seq <= seq:
            self._wake()

    # -- internals -----------------------------------------------------------------------------
    def _rescale(self) -> None:
        watchers = len(self._consumed)
        self._window = scaled_window(self._configured_window, watchers)
        self._max_in_flight = scaled_in_flight(self._configured_in_flight, self._batch_bytes, watchers)

    def _recompute_floor(self) -> int:
        self._floor = min(self._consumed.values()) if self._consumed else self._produced
        return self._floor

    def _wake(self) -> None:
        if self._blocked and self._wakeup is not None:
            self._wakeup.set()


class _GateRegistry:
    """Process-wide ``shared_stream_key -> FlowGate``, reference counted."""

    def __init__(self) -> None:
        self._gates: dict[Hashable, FlowGate] = {}

    def acquire(self, key: Hashable) -> FlowGate:
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = FlowGate()
        gate.refs += 1
        return gate

    def release(self, key: Hashable, gate: FlowGate) -> None:
        gate.refs -= 1
        if gate.refs <= 0 and self._gates.get(key) is gate:
            del self._gates[key]

    def peek(self, key: Hashable) -> FlowGate | None:
        return self._gates.get(key)


gates = _GateRegistry()
