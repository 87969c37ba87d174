"""
Kafka watcher positions, the producer's side (``position_store="watchers"``; the watcher side and the
invariant are in _core/positions.py): where each partition starts, where a watcher that joins the
running stream starts, the rewind for one that is behind, and what each watcher's stored position is.

Pure of the Kafka client at run time (the consumer is passed in; its types are for the checker
only), on the producer's own lanes: :class:`WatcherPlacement` reads and replaces entries of the
producer's ``lanes`` dict, never rebinds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.positions import PositionMember, RecentValues, WatcherPositions
from airflow_shared_stream_provider.producers.kafka_lanes import Lane, next_epoch

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, TopicPartition

# How long the stream waits at start for the watchers' stored positions, and how long a rewind
# waits for in-flight messages to settle.
POSITION_LOOKUP_TIMEOUT = 10.0
REWIND_DRAIN_TIMEOUT = 15.0
# How often a lane's position is sampled for the late-join lookback (see lookback_start).
POSITION_SAMPLE_INTERVAL = 1.0
# Seconds before a watcher's subscription a stream forming reads from for it, when it has no stored
# position (offsets_since): the clocks of the producers that stamp the records may lag ours.
SUBSCRIBE_CLOCK_SLACK = 2.0
# Stored positions read longer ago than this when the stream places its watchers are read again.
POSITION_REREAD_AGE = 1.0


def lane_label(tp: TopicPartition) -> str:
    """A partition as the stored positions name it: ``topic/partition``."""
    return f"{tp.topic}/{tp.partition}"


@dataclass(eq=False, kw_only=True)
class WatcherPlacement:
    """
    The watcher positions of one Kafka stream (one producer), on its lanes; also the positions'
    :class:`~airflow_shared_stream_provider._core.positions.Departures`: watchers that left are
    followed on the lanes until the messages they had settle (see _core/positions.py).
    """

    lanes: dict[TopicPartition, Lane]
    positions: WatcherPositions
    counters: StreamCounters
    log: logging.Logger
    source_label: str
    in_flight: Callable[[], int]
    lookback: float
    batching: bool
    # Per lane, (monotonic time, lane.position()) at each change within the late-join lookback,
    # plus the last sample before it: where the lane was ``lookback`` seconds ago.
    _history: dict[TopicPartition, RecentValues[int]] = field(default_factory=dict, init=False)
    last_sample: float = field(default=0.0, init=False)

    def forget(self, tp: TopicPartition) -> None:
        """The partition is no longer this stream's (revoked)."""
        self._history.pop(tp, None)

    def sample_due(self, now: float) -> bool:
        return now - self.last_sample >= POSITION_SAMPLE_INTERVAL

    async def place_at_start(self, consumer: AIOKafkaConsumer) -> None:
        """
        Start every lane at the lowest stored position of the watchers present (for a watcher
        without one: the committed offset, but no later than the first record written since it
        subscribed, :meth:`offsets_since`), and give each watcher its threshold: it skips what is
        below its own position (it fired those already).
        """
        positions = self.positions
        positions.refresh(older_than=POSITION_REREAD_AGE)  # read before a long cohort wait: maybe stale
        await positions.wait_lookups(timeout=POSITION_LOOKUP_TIMEOUT)
        members = positions.take_placeable(everyone=True)
        tps = list(self.lanes)
        committed_map = await consumer._coordinator.fetch_committed_offsets(tps)
        ends = await consumer.end_offsets(tps)
        committed: dict[TopicPartition, int | None] = {}
        usable: dict[TopicPartition, dict[int, int]] = {}
        for tp in tps:
            entry = committed_map.get(tp)
            committed[tp] = entry.offset if entry is not None and entry.offset >= 0 else None
            stored = usable[tp] = self.usable_positions(tp, members, end=ends.get(tp))
            if not stored:
                continue  # nobody has a position here: the committed offset (or auto.offset.reset)
            start = min(stored.values())
            fallback = committed[tp]
            if fallback is not None and len(stored) < len(members):
                start = min(start, fallback)  # a watcher without a position starts there
            consumer.seek(tp, start)
        # Where a watcher without a stored position starts: the committed offset, but no later than
        # where the partition was when it subscribed (see offsets_since).
        unrecorded = [tp for tp in tps if len(usable[tp]) < len(members)]
        joined = min((m.joined_at for m in members if not m.stored), default=time.time())
        recent = await self.offsets_since(consumer, unrecorded, ends, since=joined - SUBSCRIBE_CLOCK_SLACK)
        for tp in tps:
            offset = await consumer.position(tp)  # resolves committed offset / auto.offset.reset
            stored = usable[tp]
            known = committed[tp]
            default: int = known if known is not None else offset
            back = recent.get(tp)
            if back is not None and back < default:
                default = back
            if tp in recent and default < offset:
                consumer.seek(tp, default)
                offset = default
            lane = Lane.placed(
                next_epoch(),
                offset,
                attempts={},
                thresholds={m.number: max(offset, stored.get(m.number, default)) for m in members},
            )
            entry = committed_map.get(tp)
            if entry is not None:
                lane.restore_attempts(entry.metadata)  # attempt counts of held messages (kafka_lanes)
            self.lanes[tp] = lane
        for member in members:
            member.placed = True
        positions.positions_of = self.positions_of
        positions.departures = self
        self.sample_positions(time.monotonic())  # a stream younger than the lookback: its start
        self.log.info(
            "Kafka shared stream %s placed %d watcher(s): %s; each watcher's first offset where it is "
            "past the lane's start: %s",
            self.source_label,
            len(members),
            {lane_label(tp): (lane.next_read(), lane.floor) for tp, lane in self.lanes.items()},
            {m.identity: ahead for m in members if (ahead := self.firsts(m, ahead_only=True))} or "none",
        )

    async def place_late(self, consumer: AIOKafkaConsumer) -> None:
        """
        Watchers that joined the running stream (a triggerer that died handed them over, a Dag was
        added, the cohort wait timed out). One whose stored position is behind a lane makes that
        lane rewind to it: the lane is re-read from there, and every other watcher skips what it
        had already (its threshold is where the lane was). One without a stored position starts
        where the lane was ``late_join_lookback`` seconds ago (:meth:`lookback_start`), not at the
        read end: it may be a watcher whose last triggerer died before storing its first position.
        """
        positions = self.positions
        members = positions.take_placeable()
        if not members:
            return
        ends = await consumer.end_offsets(list(self.lanes))
        self.sample_positions(time.monotonic())  # the lanes' positions now belong to the lookback
        behind: dict[TopicPartition, dict[int, int]] = {}
        unrecorded: dict[str, int] = {}
        for tp, lane in self.lanes.items():
            next_read = lane.next_read()
            stored = self.usable_positions(tp, members, end=ends.get(tp))
            thresholds = {n: first for n, first in lane.thresholds.items() if n in positions.members}
            for member in members:
                first = stored.get(member.number)
                if first is None:
                    first = unrecorded.get(lane_label(tp))
                    if first is None:
                        first = unrecorded[lane_label(tp)] = self.lookback_start(tp, lane)
                if first >= next_read:
                    thresholds[member.number] = first
                else:
                    behind.setdefault(tp, {})[member.number] = first
            lane.set_thresholds(thresholds)
        if behind:
            await self.drain(REWIND_DRAIN_TIMEOUT)
            for tp, late in behind.items():
                self.rewind(consumer, tp, late)
        for member in members:
            member.placed = True
        self.log.info(
            "Kafka shared stream %s placed %d late watcher(s) %s; rewound %s; without a stored position "
            "(started %.0f s back, late_join_lookback): %s",
            self.source_label,
            len(members),
            {m.identity: self.firsts(m) for m in members},
            {lane_label(tp): min(late.values()) for tp, late in behind.items()} or "nothing",
            self.lookback,
            unrecorded or "none",
        )

    def firsts(self, member: PositionMember, *, ahead_only: bool = False) -> dict[str, int]:
        """
        Per lane, the first offset ``member`` receives (its threshold): what the placement logs
        show; ``ahead_only``: only lanes where it skips part of what the lane reads (past its start).
        """
        return {
            lane_label(tp): first
            for tp, lane in self.lanes.items()
            if (first := lane.thresholds.get(member.number)) is not None
            and (not ahead_only or first > lane.next_read())
        }

    async def offsets_since(
        self,
        consumer: AIOKafkaConsumer,
        tps: Sequence[TopicPartition],
        ends: dict[TopicPartition, int],
        *,
        since: float,
    ) -> dict[TopicPartition, int]:
        """
        Per partition of ``tps``, the first offset written at or after ``since`` (wall clock; the
        end offset where nothing was): where a watcher without a stored position starts at the
        latest when the stream forms, ``since`` being when it subscribed. The committed offset
        alone is not enough: with ``position_store="watchers"`` every triggerer's stream commits
        for its own watchers, so it can be past what a watcher subscribed on another triggerer
        ever received. Found by the kafka-ha production run: triggerer B's stream formed 7 s
        after A's, at the offsets A's stream had committed, and its two watchers, subscribed
        before the first order, never got the 23 published in between (docs/production.md,
        finding 10). A group's committed offsets from before the watcher subscribed (a
        migration from the upstream provider) still hold: only what was written since is read
        again. A broker that cannot answer by time leaves the committed offset (logged).
        """
        if not tps:
            return {}
        since_ms = int(since * 1000)
        try:
            found = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        except Exception:
            self.log.warning(
                "Kafka shared stream %s: offsets by time failed; watchers without a stored position start "
                "at the committed offset",
                self.source_label,
                exc_info=True,
            )
            return {}
        recent: dict[TopicPartition, int] = {}
        for tp in tps:
            hit = found.get(tp)
            # No record at or after the time: Kafka answers None, Tansu a timestamp of -1.
            if hit is None or hit.timestamp < 0:
                if tp in ends:
                    recent[tp] = ends[tp]
            else:
                recent[tp] = hit.offset
        return recent

    def sample_positions(self, now: float) -> None:
        """Note each lane's position if it moved (bounded: changes within the lookback, plus one)."""
        self.last_sample = now
        if self.lookback <= 0:
            return
        for tp, lane in self.lanes.items():
            position = lane.position()
            if position is None:
                continue
            # Keeps the newest sample older than the lookback too: the position the lane had then.
            self._history.setdefault(tp, RecentValues()).note(now, position, self.lookback)

    def lookback_start(self, tp: TopicPartition, lane: Lane) -> int:
        """
        Where a watcher without a stored position starts on ``tp``: the lowest position the lane
        had in the last ``late_join_lookback`` seconds (its start, if the stream is younger). A
        position at time t is at or below every offset first read after t, so every message
        published within the lookback reaches the watcher. 0 turns this off: the read end.
        The caller samples the lanes first (:meth:`sample_positions`): the history then holds
        the lane's position now, so the start is never above it.
        """
        next_read = lane.next_read()
        if self.lookback <= 0:
            return next_read
        history = self._history.get(tp)
        return min(history.values(), default=next_read) if history else next_read

    def rewind(self, consumer: AIOKafkaConsumer, tp: TopicPartition, late: dict[int, int]) -> None:
        """
        Re-read ``tp`` from the lowest position in ``late`` under a new epoch. Outcomes of the old
        epoch still in flight are dropped when they arrive (never committed); the offsets they
        cover are at or above ``lane.position()``, so they are read again, and the watchers that
        were here get them again too (their threshold is ``lane.position()``, not the read end).
        """
        lane = self.lanes[tp]
        resume = lane.position()
        if resume is None:
            resume = lane.next_read()
        positions = self.positions
        thresholds = {n: max(first, resume) for n, first in lane.thresholds.items() if n in positions.members}
        thresholds.update(late)
        start = min(thresholds.values())
        rewound = Lane.placed(next_epoch(), start, attempts=dict(lane.attempts), thresholds=thresholds)
        rewound.dead = set(lane.dead)
        rewound.judged = set(lane.judged)
        for number in lane.departed:
            # What the rewound lane re-reads is broadcast without it: its position here stops
            # where the old lane had it (a mark whose threshold is its bound: settled).
            frozen = lane.departed_position(number)
            if frozen is not None:
                rewound.departed[number] = [frozen, frozen]
        self.lanes[tp] = rewound
        consumer.seek(tp, start)
        self.counters.add("rewinds")

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) until nothing is in flight: a rewind then re-delivers nothing twice."""
        deadline = time.monotonic() + timeout
        # Polled: a rare path (a late watcher), bounded, and advance() signals no "all settled".
        while self.in_flight() > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def usable_positions(
        self, tp: TopicPartition, members: Sequence[PositionMember], *, end: int | None
    ) -> dict[int, int]:
        """``member number -> stored position`` on ``tp``, without positions past the log end."""
        label = lane_label(tp)
        usable: dict[int, int] = {}
        for member in members:
            first = member.stored.get(label) if member.stored else None
            if first is None:
                continue
            if end is not None and first > end:
                # The topic was re-created (or truncated): the position means nothing any more.
                self.log.warning(
                    "Ignoring position %d of watcher %s on %s: past the log end %d", first, member.identity, label, end
                )
                continue
            usable[member.number] = first
        return usable

    def positions_of(self, member: PositionMember) -> dict[str, int] | None:
        """
        What to store for ``member``: per lane, ``lane.position()`` once the member's threshold is
        at or below it (it received everything in between), else its threshold (it had everything
        below; a rewind for a late sibling put the lane behind it). A member that left: see
        :meth:`Lane.departed_position`. A lane it was never placed on: what it had (see the
        invariant in _core/positions.py).
        """
        out: dict[str, int] = {}
        for tp, lane in self.lanes.items():
            label = lane_label(tp)
            departed = lane.departed_position(member.number) if lane.departed else None
            if departed is not None:
                out[label] = departed
                continue
            first = lane.thresholds.get(member.number)
            if first is not None:
                position = lane.position()
                out[label] = first if position is None else max(first, position)
                continue
            kept = member.written.get(label)
            if kept is None and member.stored:
                kept = member.stored.get(label)
            if kept is not None:
                out[label] = kept
        return out or None

    # -- watchers that left (positions.Departures) ---------------------------------------------
    def depart(self, member: PositionMember) -> bool:
        """
        Follow ``member``, which left, on the lanes it was placed on (False: not placed, or batch
        mode: there a message can be read (``Lane.next_read`` passed it) and still be forming a
        batch when the watcher leaves, so it is broadcast without the watcher and the bound would
        pass it; such a watcher keeps the position it had when it left).
        """
        if self.batching:
            return False
        marked = [lane.depart(member.number) for lane in self.lanes.values()]
        return any(marked)

    def settled(self, member: PositionMember) -> bool:
        return all(lane.departure_settled(member.number) for lane in self.lanes.values())

    def forget_departed(self, member: PositionMember) -> None:
        for lane in self.lanes.values():
            lane.departed.pop(member.number, None)
