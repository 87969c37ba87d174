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
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from airflow_shared_stream_provider._core.cohort import CONFIG_SECTION
from airflow_shared_stream_provider._core.state_store import StateStore, read_quietly, write_quietly
from airflow_shared_stream_provider._core.tasks import wait_for

log = logging.getLogger(__name__)

# Member numbers are unique for the life of the process (``id()`` of a trigger can be reused by a
# later one, which would then inherit a departed watcher's thresholds and skip its messages).
_member_numbers = itertools.count(1)

DEFAULT_POSITION_INTERVAL: Final = 5.0
DEFAULT_LATE_JOIN_LOOKBACK: Final = 300.0
RECORD_VERSION: Final = 1


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


def parse_record(record: Any) -> dict[str, int] | None:
    """``{lane label: position}`` from a stored record; None for a missing or unreadable one."""
    if not isinstance(record, Mapping) or record.get("v") != RECORD_VERSION:
        return None
    positions = record.get("positions")
    if not isinstance(positions, Mapping):
        return None
    parsed: dict[str, int] = {}
    for label, value in positions.items():
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            parsed[str(label)] = value
    return parsed


@dataclass
class PositionMember:
    """One watcher of the stream in this process, as the producer sees it."""

    number: int
    identity: str
    key: str
    stores: list[tuple[str, StateStore]]
    lookup: asyncio.Task[None] | None = None
    # What its state store held when it joined (None: nothing, or no state store at all).
    stored: dict[str, int] | None = None
    # Set by the producer once it has placed the member on every lane (thresholds known).
    placed: bool = False
    written: dict[str, int] = field(default_factory=dict)

    @property
    def looked_up(self) -> bool:
        return self.lookup is None or self.lookup.done()


@dataclass
class WatcherPositions:
    """The watchers of one stream in this process and their stored positions (per :class:`FlowGate`)."""

    clock: Callable[[], float] = time.monotonic
    members: dict[int, PositionMember] = field(default_factory=dict)
    # Members that joined and are not placed yet, in join order (the producer places them).
    unplaced: list[int] = field(default_factory=list)
    # Set by the producer once it placed the stream's lanes: a member's positions now.
    positions_of: Callable[[PositionMember], dict[str, int] | None] | None = None
    _writer: asyncio.Task[None] | None = None
    _farewells: set[asyncio.Task[None]] = field(default_factory=set)
    _last_write: float = 0.0

    # -- watcher side --------------------------------------------------------------------------
    def join(self, identity: str, key: str, stores: list[tuple[str, StateStore]]) -> int:
        """
        A watcher subscribed (call before its first await); its positions are read in the
        background. Returns its member number (what :attr:`StreamMessage.skip_for` holds).
        """
        number = next(_member_numbers)
        member = PositionMember(number, identity, key, stores)
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
        if member.lookup is not None and not member.lookup.done():
            member.lookup.cancel()
        if member.placed and member.stores and self.positions_of is not None:
            positions = self.positions_of(member)
            if positions and positions != member.written:
                task = asyncio.ensure_future(self._write([(member, positions)]))
                self._farewells.add(task)
                task.add_done_callback(self._farewells.discard)

    async def _read(self, member: PositionMember) -> None:
        # Unreadable: a lost position costs duplicates (the group offset is the fallback).
        _, store = member.stores[0]
        member.stored = parse_record(
            await read_quietly(store, member.key, f"the positions {member.key} of {member.identity}")
        )

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
        pending = [m.lookup for m in self.members.values() if m.lookup is not None and not m.lookup.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def write_due(self, interval: float) -> bool:
        return self.clock() - self._last_write >= interval and (self._writer is None or self._writer.done())

    def schedule_write(self, positions_of: Callable[[PositionMember], dict[str, int] | None]) -> None:
        """Write, in the background, every placed member's positions that changed since its last write."""
        self._last_write = self.clock()
        updates: list[tuple[PositionMember, dict[str, int]]] = []
        for member in self.members.values():
            if not member.placed or not member.stores:
                continue
            positions = positions_of(member)
            if positions and positions != member.written:
                updates.append((member, positions))
        if updates:
            self._writer = asyncio.ensure_future(self._write(updates))

    async def _write(self, updates: list[tuple[PositionMember, dict[str, int]]]) -> None:
        # Concurrently: in a triggerer each write is a request to the supervisor, answered in its
        # loop; one after the other, 10 watchers' writes took seconds (the positions lagged by that).
        await asyncio.gather(*(self._write_one(member, positions) for member, positions in updates))

    async def _write_one(self, member: PositionMember, positions: dict[str, int]) -> None:
        record = {"v": RECORD_VERSION, "positions": positions}
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
        for task in [self._writer, *self._farewells, *(m.lookup for m in self.members.values())]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
