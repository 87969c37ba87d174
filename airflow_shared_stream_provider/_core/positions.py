"""
Watcher positions: how far each watcher of a log-based stream (Kafka) is, kept in its own asset's
state store, so that a watcher that joins a running stream late replays from where *it* was.

Why. A consumer group splits a topic's partitions between its members, so sibling watchers on two
triggerers (Airflow 3.3 cannot pin them together, and HA deployments run several triggerers)
would each see only part of the topic. And a late subscriber of a running stream (a triggerer that
died hands its watchers to another one, whose stream already runs) misses everything the stream
committed before it joined. Both go away when:

* every triggerer's stream reads **every** partition itself (no group-managed split), and
* each watcher's position is durable in Airflow (``self.asset_state_store``, Airflow 3.3) rather
  than only the group's committed offset: a stream starts each lane at the lowest position of its
  watchers, and when a watcher with an older position joins a running stream, the lane is rewound
  to that position. Siblings skip what they already fired (:attr:`StreamMessage.skip_for`).

The invariant of a stored position ``p`` of watcher ``w`` on lane ``L``: every message of ``L``
below ``p`` that ``w`` was to receive had its events persisted (or was dead-lettered) before ``p``
was written. The producer writes ``p = lane.position()`` (the first offset not yet terminally
handled) only once ``w``'s threshold on ``L`` is at or below it, i.e. ``w`` received every message
between them; so a position never passes a message ``w`` did not get. Positions lag (they are
written every ``position_interval`` seconds), which costs duplicates after a crash, never loss.

A watcher whose threshold is *above* ``lane.position()`` (its siblings' replay after a rewind for a
late watcher is still in flight) is at its threshold: it had everything below it. Its position is
``max(threshold, lane.position())``, never the value it wrote before the rewind (that froze a
watcher moved during a rewind at its old position, and it replayed everything again).

A watcher that leaves (its triggerer stops it, or hands it to another one) stores its position at
once, and then, while it is a *departed* member, again as the messages it had settle: in a
triggerer the persist confirmations of its events arrive in the same state sync as its
cancellation, before the producer advanced them, so the position at the instant it left can be
the whole unconfirmed backlog behind (found by the production chaos run: a supervisor that took
16 s to persist a backlog, then confirmed it and moved two watchers in one sync; they came back at
0 and replayed everything). Departed members are followed for at most :data:`DEPARTED_TRACKING`
seconds, until their position cannot improve, or until the same watcher joins again here.

A watcher that comes back **re-created** (a trigger id other than the one that wrote its record)
does not trust that position: it starts from ``earlier`` in the record, where the writer was
``late_join_lookback`` seconds before it wrote the record (or before it left, for a watcher that
left by cancellation). Why: Airflow cancels a watcher whose Dag was paused (or whose watcher was
removed) only after the dag-processor dropped the asset's reference to its trigger and the
triggerer deleted the trigger row; events the watcher fired meanwhile are "stored" by
``Trigger.submit_event`` for no asset at all (a deleted trigger, or one without assets, is skipped
without an error) and still confirmed persisted, so the position passed messages whose events
exist nowhere. A trigger row, once deleted, never comes back: the watcher returns (Dag unpaused)
as a new trigger with a new id. A watcher that only *moved* (another triggerer, a graceful
restart) keeps its trigger id and its exact position. Found by CI's production chaos run: a Dag
paused while its watcher worked off a backlog after a broker restart lost 14 orders.

Every record carries ``earlier``, not only the one written when the watcher leaves: Airflow's
triggerer starts the triggers of a state sync before it cancels the ones of the same sync, so a
Dag paused and unpaused between two syncs brings the new trigger up, reading the record, before
the old one has left and written where it was (its last periodic write, which may already pass
what it fired for no asset). Records of an earlier version of this provider carry
``before_leave`` (written only on leaving), read the same way.

Why in ``_core`` although Kafka is its only broker today: the core itself uses it (every watcher
joins it in :mod:`.trigger`, keyed by :func:`position_key` of its settings' ``position_scope()``,
a :class:`.settings.StreamSettings` hook that is None for a broker that keeps no
positions; the flow gate holds :class:`WatcherPositions` in :mod:`.flow`), so it cannot sit beside
a producer without ``_core`` importing ``producers/``. Nothing here is Kafka's: a lane is any log
with integer offsets; a broker opts in with ``position_scope()`` and a producer that writes its
lanes' positions (as ``producers/kafka.py`` does).

The positions live next to the cohort record (:mod:`.cohort`), under a key derived from the
stream's *position scope* (for Kafka: connection, topics, group), not from the whole stream key:
changing a tuning setting such as ``batch_size`` keeps the positions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

from airflow_shared_stream_provider._core.cohort import CONFIG_SECTION
from airflow_shared_stream_provider._core.state_store import StateStore, read_quietly, write_quietly
from airflow_shared_stream_provider._core.tasks import wait_for

log = logging.getLogger(__name__)

V = TypeVar("V")

# Member numbers are unique for the life of the process (``id()`` of a trigger can be reused by a
# later one, which would then inherit a departed watcher's thresholds and skip its messages).
_member_numbers = itertools.count(1)

DEFAULT_POSITION_INTERVAL: Final = 5.0
DEFAULT_LATE_JOIN_LOOKBACK: Final = 300.0
RECORD_VERSION: Final = 1
# How long a watcher that left is followed (its messages in flight settle, see the module
# docstring), and how often its position is written meanwhile.
DEPARTED_TRACKING: Final = 60.0
DEPARTED_WRITE_INTERVAL: Final = 0.5


def position_interval() -> float:
    """``[shared_stream_provider] position_interval`` (seconds between position writes, default 5)."""
    from airflow.configuration import conf

    return max(0.1, conf.getfloat(CONFIG_SECTION, "position_interval", fallback=DEFAULT_POSITION_INTERVAL))


def late_join_lookback() -> float:
    """
    ``[shared_stream_provider] late_join_lookback`` (seconds, default 300; 0: start at the read end).

    Where a watcher **without a stored position** starts when it joins a running stream: at the
    position the stream had this many seconds ago. Why not "now": such a watcher cannot be told
    apart from one whose previous stream (a triggerer killed seconds after forming it) delivered
    to it but died before its first position write landed; starting at the read end lost what
    that one had received and not persisted (docs/production.md, finding 4). Every message
    published within the lookback before the join reaches it; a brand-new watcher may fire for
    up to this much history.
    """
    from airflow.configuration import conf

    return max(0.0, conf.getfloat(CONFIG_SECTION, "late_join_lookback", fallback=DEFAULT_LATE_JOIN_LOOKBACK))


def position_key(scope: Hashable, identity: str) -> str:
    """The state-store key of one watcher's positions in one scope (short, stable across processes)."""
    scope_digest = hashlib.sha256(repr(scope).encode()).hexdigest()[:16]
    identity_digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f"shared-stream-position/{scope_digest}/{identity_digest}"


def _parse_positions(positions: Any) -> dict[str, int] | None:
    if not isinstance(positions, Mapping):
        return None
    parsed: dict[str, int] = {}
    for label, value in positions.items():
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            parsed[str(label)] = value
    return parsed


# The record's field with where its writer was a lookback earlier; the second name is what
# records of an earlier version of this provider carry (written only when the watcher left).
EARLIER_FIELDS: Final = ("earlier", "before_leave")


def _earlier_field(record: Mapping[str, Any]) -> str | None:
    return next((name for name in EARLIER_FIELDS if name in record), None)


def recreated(record: Any, trigger_id: int | None) -> bool:
    """Whether ``record`` was written by another trigger of the same watcher (its row was deleted)."""
    if trigger_id is None or not isinstance(record, Mapping) or _earlier_field(record) is None:
        return False
    writer = record.get("trigger")
    return isinstance(writer, int) and not isinstance(writer, bool) and writer != trigger_id


def parse_record(record: Any, *, trigger_id: int | None = None) -> dict[str, int] | None:
    """
    ``{lane label: position}`` from a stored record for the watcher with ``trigger_id``; None for
    a missing or unreadable one, and for a re-created watcher whose previous trigger had no
    position a lookback earlier (it starts as a watcher without one).

    A record written by another trigger id gives ``earlier``: the watcher was re-created (see
    the module docstring). A record without it (a record of a version of this provider older
    than both fields) is taken as it is; so is any record when either id is unknown.
    """
    if not isinstance(record, Mapping) or record.get("v") != RECORD_VERSION:
        return None
    if recreated(record, trigger_id):
        earlier = _parse_positions(record.get(_earlier_field(record) or ""))
        return earlier or None
    return _parse_positions(record.get("positions"))


def _cancelled() -> bool:
    """
    Whether the watcher leaving now was cancelled (Airflow stops it, or moves it to another
    triggerer): ``leave`` runs in its ``finally``, where the exception in flight tells. Only such a
    watcher is followed after it left. One that ends on an error is not: the manager may have
    excluded it from its broadcasts before (a queue overflow or an ack timeout fails a subscriber
    at once, and it raises only when it next pulls), so messages read before it left may never
    have reached it, and only the position it had then is safe.
    """
    exc = sys.exc_info()[1]
    return isinstance(exc, asyncio.CancelledError | GeneratorExit)


@dataclass
class RecentValues(Generic[V]):
    """
    A value over time: ``(clock, value)`` at each change within the last ``keep`` seconds, plus the
    last one before them, so that :meth:`as_of` answers for any moment in that span (bounded: one
    entry per change). Used for a watcher's positions here and for a Kafka lane's position
    (``producers/kafka_placement.py``, the late-join lookback).
    """

    entries: deque[tuple[float, V]] = field(default_factory=deque)

    def note(self, now: float, value: V, keep: float) -> None:
        entries = self.entries
        if not entries or entries[-1][1] != value:
            entries.append((now, value))
        while len(entries) >= 2 and entries[1][0] <= now - keep:
            entries.popleft()

    def as_of(self, moment: float) -> V | None:
        """The value noted last at or before ``moment`` (None: nothing that old)."""
        return next((value for noted_at, value in reversed(self.entries) if noted_at <= moment), None)

    def values(self) -> Iterator[V]:
        return (value for _, value in self.entries)


@dataclass
class PositionMember:
    """One watcher of the stream in this process, as the producer sees it."""

    number: int
    identity: str
    key: str
    stores: list[tuple[str, StateStore]]
    # The Airflow trigger id of this watcher (None: not run by a triggerer, e.g. a test runner).
    trigger_id: int | None = None
    lookup: asyncio.Task[None] | None = None
    # When it subscribed (wall clock, seconds): a watcher without a stored position receives
    # every message written since then, whatever another stream committed meanwhile.
    joined_at: float = field(default_factory=time.time)
    # What its state store held when it joined (None: nothing, or no state store at all), and
    # when that was read (:meth:`WatcherPositions.refresh` reads it again when it is old).
    stored: dict[str, int] | None = None
    read_at: float | None = None
    reread: asyncio.Task[None] | None = None
    # Set by the producer once it has placed the member on every lane (thresholds known).
    placed: bool = False
    written: dict[str, int] = field(default_factory=dict)
    # Departed members only: until when they are followed, and their write at leave.
    departed_until: float | None = None
    farewell: asyncio.Task[None] | None = None
    # Its positions within ``recreated_lookback``: where it was a while ago (``earlier``, see
    # the module docstring).
    history: RecentValues[dict[str, int]] = field(default_factory=RecentValues)
    # Set when it leaves by cancellation: the ``earlier`` of every later record of it ({}: it had
    # no position that long ago; a re-created watcher then starts as one without a position).
    before_leave: dict[str, int] | None = None

    def positions_before(self, moment: float) -> dict[str, int]:
        """
        Its positions as of ``moment``: the last noted at or before it, else what its record held
        when it joined (nothing confirmed since then is in it), else none ({}).
        """
        older = self.history.as_of(moment)
        if older is not None:
            return dict(older)
        return dict(self.stored) if self.stored else {}

    @property
    def looked_up(self) -> bool:
        return self.lookup is None or self.lookup.done()


class Departures(Protocol):
    """The producer's side of departed members (it knows the lanes)."""

    def depart(self, member: PositionMember) -> bool:
        """The member left: follow it (False: its position cannot improve, do not follow)."""

    def settled(self, member: PositionMember) -> bool:
        """Its position can improve no more."""

    def forget_departed(self, member: PositionMember) -> None:
        """Stop following it."""


@dataclass
class WatcherPositions:
    """The watchers of one stream in this process and their stored positions (per :class:`FlowGate`)."""

    clock: Callable[[], float] = time.monotonic
    # How far before it left a re-created watcher starts (late_join_lookback; see the module docstring).
    recreated_lookback: float = DEFAULT_LATE_JOIN_LOOKBACK
    members: dict[int, PositionMember] = field(default_factory=dict)
    # Members that joined and are not placed yet, in join order (the producer places them).
    unplaced: list[int] = field(default_factory=list)
    # Set by the producer once it placed the stream's lanes: a member's positions now.
    positions_of: Callable[[PositionMember], dict[str, int] | None] | None = None
    # Set by a producer that can follow departed members (see the module docstring).
    departures: Departures | None = None
    departed: dict[int, PositionMember] = field(default_factory=dict)
    _writer: asyncio.Task[None] | None = None
    _farewells: set[asyncio.Task[None]] = field(default_factory=set)
    _last_write: float = 0.0
    _last_departed_write: float = 0.0

    # -- watcher side --------------------------------------------------------------------------
    def join(
        self, identity: str, key: str, stores: list[tuple[str, StateStore]], *, trigger_id: int | None = None
    ) -> int:
        """
        A watcher subscribed (call before its first await); its positions are read in the
        background. Returns its member number (what :attr:`StreamMessage.skip_for` holds).
        ``trigger_id``: its Airflow trigger id (a re-created watcher is told by it).
        """
        number = next(_member_numbers)
        for gone in [m for m in self.departed.values() if m.key == key]:
            self._forget(gone)  # the same watcher is back: its own writes take over
        member = PositionMember(number, identity, key, stores, trigger_id=trigger_id)
        self.members[number] = member
        self.unplaced.append(number)
        if stores:
            member.lookup = asyncio.ensure_future(self._read(member))
        return number

    def leave(self, number: int) -> None:
        """
        A watcher left (its trigger ended, the triggerer stops). Its positions are taken *now*:
        ``lane.position()`` is still below every message it holds unacknowledged (the manager
        resolves those as acked when it leaves, and the lane moves past them without it), so the
        stored position brings them back when it returns. Written in the background, best effort.
        """
        member = self.members.pop(number, None)
        with contextlib.suppress(ValueError):
            self.unplaced.remove(number)
        if member is None:
            return
        for task in (member.lookup, member.reread):
            if task is not None and not task.done():
                task.cancel()
        if any(other.key == member.key for other in self.members.values()):
            # The same watcher runs here again already (a re-created trigger started in the sync
            # that cancels this one): its own writes take over, as in :meth:`join`. A write of
            # this one now would put a record of the old trigger over the new one's.
            log.info(
                "Watcher %s (trigger %s) leaves the stream after the same watcher joined it again: it writes "
                "no position",
                member.identity,
                member.trigger_id,
            )
            return
        if member.placed and member.stores and self.positions_of is not None:
            cancelled = _cancelled()
            if cancelled:
                # Before anything confirmed in the syncs that cancelled it (see the module docstring).
                member.before_leave = member.positions_before(self.clock() - self.recreated_lookback)
            if self.departures is not None and cancelled and self.departures.depart(member):
                member.departed_until = self.clock() + DEPARTED_TRACKING
                self.departed[number] = member
            positions = self.positions_of(member)
            # Once per departure: the evidence a lost message is looked for with.
            log.info(
                "Watcher %s (trigger %s) leaves the stream (%s): position %s; %.0f s before it left: %s",
                member.identity,
                member.trigger_id,
                "cancelled" if cancelled else "ended",
                positions or "none",
                self.recreated_lookback,
                member.before_leave if cancelled else "not kept (it did not leave by cancellation)",
            )
            if positions and (positions != member.written or member.before_leave is not None):
                task = asyncio.ensure_future(self._write([(member, positions)]))
                member.farewell = task
                self._farewells.add(task)
                task.add_done_callback(self._farewells.discard)

    def _forget(self, member: PositionMember) -> None:
        self.departed.pop(member.number, None)
        if self.departures is not None:
            self.departures.forget_departed(member)

    async def _read(self, member: PositionMember, *, again: bool = False) -> None:
        # Unreadable: a lost position costs duplicates (the group offset is the fallback). Read
        # again: an unreadable record keeps what the first read found.
        _, store = member.stores[0]
        record = await read_quietly(store, member.key, f"the positions {member.key} of {member.identity}")
        stored = parse_record(record, trigger_id=member.trigger_id)
        if not again and recreated(record, member.trigger_id):
            log.info(
                "Watcher %s comes back as trigger %s (its positions were stored by trigger %s, which Airflow "
                "deleted): it starts where it was late_join_lookback seconds before it left, %s",
                member.identity,
                member.trigger_id,
                record.get("trigger"),
                stored or "without a position",
            )
        if stored is not None or not again:
            member.stored = stored
        member.read_at = self.clock()

    def refresh(self, *, older_than: float) -> None:
        """
        Read again, in the background, the stored positions of the members read more than
        ``older_than`` seconds ago (a stream places its watchers after the cohort wait, up to
        ``cohort_max_wait`` after they joined: meanwhile the same watcher may still have run on
        another triggerer and stored a newer position, e.g. when leaving it). Any stored value is
        a valid position (the invariant above); the newest costs the fewest duplicates.
        """
        now = self.clock()
        for member in self.members.values():
            if member.stores and member.looked_up and member.read_at is not None and now - member.read_at >= older_than:
                member.reread = asyncio.ensure_future(self._read(member, again=True))

    # -- producer side -------------------------------------------------------------------------
    def has_unplaced(self) -> bool:
        """Cheap check, once per receive loop turn."""
        return bool(self.unplaced)

    def take_placeable(self, *, everyone: bool = False) -> list[PositionMember]:
        """
        Unplaced members whose stored positions are known (``everyone``: placed ones too, for a
        producer that starts while watchers of an earlier one are still here); they leave the
        unplaced list.
        """
        numbers = list(self.members) if everyone else self.unplaced
        ready = [self.members[n] for n in numbers if n in self.members and self.members[n].looked_up]
        if ready:
            taken = {m.number for m in ready}
            self.unplaced = [t for t in self.unplaced if t not in taken]
        return ready

    async def wait_lookups(self, timeout: float) -> None:
        """Wait (bounded) until every member's stored positions were read."""
        pending = [
            task for m in self.members.values() for task in (m.lookup, m.reread) if task is not None and not task.done()
        ]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def write_due(self, interval: float) -> bool:
        return self.clock() - self._last_write >= interval and (self._writer is None or self._writer.done())

    def departed_write_due(self) -> bool:
        """Departed members are written more often than the others (every DEPARTED_WRITE_INTERVAL)."""
        return (
            bool(self.departed)
            and self.clock() - self._last_departed_write >= DEPARTED_WRITE_INTERVAL
            and (self._writer is None or self._writer.done())
        )

    def schedule_write(
        self, positions_of: Callable[[PositionMember], dict[str, int] | None], *, departed_only: bool = False
    ) -> None:
        """
        Write, in the background, every placed member's positions that changed since its last write
        (``departed_only``: the departed members' only).
        """
        now = self._last_departed_write = self.clock()
        if not departed_only:
            self._last_write = now
        updates: list[tuple[PositionMember, dict[str, int]]] = []
        for member in () if departed_only else self.members.values():
            if not member.placed or not member.stores:
                continue
            positions = positions_of(member)
            if positions:
                member.history.note(now, dict(positions), self.recreated_lookback)
            if positions and positions != member.written:
                updates.append((member, positions))
        for member in list(self.departed.values()):
            if member.farewell is not None and not member.farewell.done():
                continue  # one write at a time per member: a later one must not land first
            settled = self.departures is None or self.departures.settled(member)
            positions = positions_of(member)
            if positions and positions != member.written:
                updates.append((member, positions))
            if settled or (member.departed_until is not None and now >= member.departed_until):
                self._forget(member)
        if updates:
            self._writer = asyncio.ensure_future(self._write(updates))

    async def _write(self, updates: list[tuple[PositionMember, dict[str, int]]]) -> None:
        # Concurrently: in a triggerer each write is a request to the supervisor, answered in its
        # loop; one after the other, 10 watchers' writes took seconds (the positions lagged by that).
        await asyncio.gather(*(self._write_one(member, positions) for member, positions in updates))

    async def _write_one(self, member: PositionMember, positions: dict[str, int]) -> None:
        record: dict[str, Any] = {"v": RECORD_VERSION, "positions": positions}
        if member.trigger_id is not None:
            record["trigger"] = member.trigger_id
            # Where a re-created watcher starts (see the module docstring): a watcher that left
            # keeps the value from before it left; a running one, a lookback before now.
            record["earlier"] = (
                member.before_leave
                if member.before_leave is not None
                else member.positions_before(self.clock() - self.recreated_lookback)
            )
        _, store = member.stores[0]  # where _read looks (the first of its assets, by name)
        if await write_quietly(store, member.key, record, f"the positions {member.key} of {member.identity}"):
            member.written = positions

    async def flush(self, positions_of: Callable[[PositionMember], dict[str, int] | None], timeout: float) -> None:
        """A last write (the stream closes): bounded, best effort."""
        if self._writer is not None and not self._writer.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await wait_for(asyncio.shield(self._writer), timeout)
        self.schedule_write(positions_of)
        if self._writer is not None and not self._writer.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await wait_for(self._writer, timeout)

    async def close(self) -> None:
        self.positions_of = None
        self.departures = None
        self.departed.clear()
        tasks = [self._writer, *self._farewells, *(t for m in self.members.values() for t in (m.lookup, m.reread))]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
