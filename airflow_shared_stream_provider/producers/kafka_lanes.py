"""
Per-partition commit bookkeeping for the Kafka producer (pure: no client, unit-testable).

Invariant: the commit point of a lane never passes an offset that has been read but is not
terminally handled (committed or dead-lettered). Failed and held offsets stay in the lane until a
redelivery of them is terminally handled.

Delivery attempts of held offsets travel in the commit's metadata (``{"attempts": {offset: n}}``),
so the poison cap survives a consumer restart on brokers that store commit metadata (Apache Kafka
does; some Kafka-compatible brokers drop it, and then the count restarts with the session).
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import dataclass, field

# Lane epochs, unique in the process: outcomes of an older epoch of a partition are dropped.
_epochs = itertools.count(1)


def next_epoch() -> int:
    return next(_epochs)


# Kafka's default offset.metadata.max.bytes is 4096: keep the attempt map well below it.
MAX_TRACKED_ATTEMPTS = 64
# Attempt counts one lane keeps in memory (only offsets that failed have one).
MAX_KEPT_ATTEMPTS = 10_000


@dataclass(slots=True)
class Lane:
    """One assigned partition. ``epoch`` changes on every (re)assignment."""

    epoch: int
    # Offsets read for the first time, in offset order. The commit point is the end of the longest
    # prefix of these that is done; keeping real offsets (not ``committed + 1``) makes gaps from
    # compaction and transaction markers harmless.
    yielded: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    redeliver: set[int] = field(default_factory=set)
    high_yielded: int = -1
    attempts: dict[int, int] = field(default_factory=dict)
    # Watcher positions (position_store="watchers", see _core/positions.py): the first offset each
    # placed watcher (member number) must receive, and their maximum. Offsets at or above ``floor``
    # go to every watcher; below it, :meth:`skip_for` names the watchers that already have them.
    thresholds: dict[int, int] = field(default_factory=dict)
    floor: int = -1
    # Where the consumer was placed (seek or committed offset) when the lane was last reset: the
    # lane's position before anything is read (None: group mode, nothing read yet).
    placed_at: int | None = None
    # Watcher positions: attempt counts outlive the settle of their offset. A watcher that failed
    # on it and left comes back behind its siblings and the lane is rewound for it; its count
    # must go on (the poison cap), not restart at 1 on every comeback.
    keep_attempts: bool = False
    # Watcher positions: offsets dead-lettered in this session that no watcher can take: unreadable
    # (a forced rejection) or poison (the cap). A rewind for a late watcher does not deliver them
    # again (they are in the DLQ): a watcher that failed on a poison message and comes back behind
    # it would otherwise fail on it again on every comeback.
    dead: set[int] = field(default_factory=set)
    # Watcher positions: offsets dead-lettered because a watcher's filter rejected them. That is
    # one watcher's judgement: another one may take the message (a filter on the region fires on
    # an order the validating watcher rejects). A rewind delivers them again to the late watcher,
    # which may be such a one, come back re-created after its event for it was stored for no asset
    # (a paused Dag; found by CI's production chaos run, which lost such an order). Dead-lettered
    # again, they are settled without a second dead-letter record.
    judged: set[int] = field(default_factory=set)
    # Watchers that left while placed on this lane (member number -> [threshold, bound]), until
    # their position cannot improve any more (see :meth:`departed_position`). ``bound`` starts at
    # what the lane had read when it left (nothing read later was broadcast to it) and drops to any
    # offset held since (a message it was sent but never took, resolved as failed: it never got it).
    departed: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def placed(cls, epoch: int, offset: int, *, attempts: dict[int, int], thresholds: dict[int, int]) -> Lane:
        """A lane whose consumer reads from ``offset`` on (a start or a rewind)."""
        lane = cls(epoch=epoch, high_yielded=offset - 1, attempts=attempts, placed_at=offset, keep_attempts=True)
        lane.set_thresholds(thresholds)
        return lane

    def set_thresholds(self, thresholds: dict[int, int]) -> None:
        self.thresholds = thresholds
        self.floor = max(thresholds.values(), default=-1)

    def skip_for(self, offset: int) -> frozenset[int] | None:
        """The watchers that must skip ``offset`` (they had it already); None: nobody (the hot path)."""
        if offset >= self.floor:
            return None
        skipping = frozenset(member for member, first in self.thresholds.items() if first > offset)
        return skipping or None

    def next_read(self) -> int:
        """The offset the next new record has (everything below was read in this lane's life)."""
        return self.high_yielded + 1

    def attempt_of(self, offset: int) -> int:
        """The delivery attempt a read of ``offset`` now is (1 on the first read)."""
        return self.attempts.get(offset, 0) + 1

    def admit(self, offset: int) -> int:
        """
        Classify a fetched offset; return the delivery attempt this read is, or 0 to skip it.

        A new offset (first read; 1 unless a previous session stored attempts for it) or a held
        offset read again is yielded; anything else is already in flight or done (a replay after
        a seek-back) and is skipped. One call per record: this is the consumer's hot loop.
        """
        if offset > self.high_yielded:
            self.high_yielded = offset
            self.yielded.append(offset)
            # Attempts are stored only for held offsets: almost always none, so no lookup.
            return self.attempt_of(offset) if self.attempts else 1
        if offset in self.redeliver:
            self.redeliver.discard(offset)
            return self.attempt_of(offset)
        return 0

    def settle(self, offset: int) -> None:
        """The offset is terminally handled (committed or dead-lettered)."""
        self.done.add(offset)
        if self.attempts and not self.keep_attempts:
            self.attempts.pop(offset, None)

    def hold(self, offset: int, *, attempts: int) -> None:
        """The offset must be read again (failed or nobody subscribed); ``attempts`` so far."""
        self.redeliver.add(offset)
        if self.departed:
            for mark in self.departed.values():
                mark[1] = min(mark[1], offset)
        self.attempts[offset] = attempts
        if len(self.attempts) > MAX_KEPT_ATTEMPTS:  # kept past settling (keep_attempts): oldest go first
            del self.attempts[min(self.attempts)]

    def position(self) -> int | None:
        """Where a restarted consumer must resume: the first read offset not yet done."""
        if self.yielded:
            return self.yielded[0]
        return self.high_yielded + 1 if self.high_yielded >= 0 or self.placed_at is not None else None

    def depart(self, member: int) -> bool:
        """
        A placed watcher left: track its position until the messages it had settle (False: it
        was not placed on this lane). Valid only when everything read was broadcast already
        (no batch forming), which the caller checks.
        """
        threshold = self.thresholds.get(member)
        if threshold is None:
            return False
        bound = self.next_read()
        # An offset held before it left (waiting, or re-read and in flight again) may be broadcast
        # again without it: the bound stays below. Such offsets have an attempt count (``hold``);
        # one restored from a commit's metadata may never have been held: the bound is only lower.
        if self.redeliver:
            bound = min(bound, *self.redeliver)
        if self.attempts:
            bound = min(
                (o for o in self.yielded if o < bound and o not in self.done and o in self.attempts), default=bound
            )
        self.departed[member] = [threshold, bound]
        return True

    def departed_position(self, member: int) -> int | None:
        """
        The position of a watcher that left: ``max(threshold, min(bound, position()))``. Below
        ``position()`` every offset is done, i.e. each watcher it was broadcast to resolved it, and
        a watcher that left resolves what it took only once its events are persisted (the
        manager's persist gate) and what it never took as failed (a hold: below ``bound``). Below
        its threshold it had everything before it was placed. Never decreases: a later hold is
        of an offset that was in flight, so at or above ``position()`` all along.
        """
        mark = self.departed.get(member)
        if mark is None:
            return None
        threshold, bound = mark
        position = self.position()
        return max(threshold, bound if position is None else min(bound, position))

    def departure_settled(self, member: int) -> bool:
        """Its position can improve no more (the lane passed its bound)."""
        mark = self.departed.get(member)
        if mark is None:
            return True
        position = self.position()
        return mark[0] >= mark[1] or (position is not None and position >= mark[1])

    def dead_lettered(self, offset: int, *, judged: bool) -> None:
        """
        Remember a dead-lettered offset (watcher positions only; bounded like the attempt counts):
        ``judged``, a watcher's filter rejected it (see :attr:`judged`); else no watcher can take it.
        """
        if not self.keep_attempts:
            return
        kept = self.judged if judged else self.dead
        kept.add(offset)
        if len(kept) > MAX_KEPT_ATTEMPTS:
            kept.discard(min(kept))

    def commit_metadata(self) -> str:
        tracked = sorted(self.attempts.items())[:MAX_TRACKED_ATTEMPTS]
        return json.dumps({"attempts": {str(o): n for o, n in tracked}}, separators=(",", ":")) if tracked else ""

    def restore_attempts(self, metadata: str | None) -> None:
        """Take over attempt counts a previous session stored with its commit (ignores junk)."""
        if not metadata:
            return
        try:
            stored = json.loads(metadata).get("attempts", {})
            self.attempts.update({int(o): int(n) for o, n in stored.items()})
        except (ValueError, AttributeError, TypeError):
            return

    def commit_point(self) -> int | None:
        """Pop the done prefix; return the offset to commit (last done + 1), or None if unchanged."""
        last_done: int | None = None
        while self.yielded and self.yielded[0] in self.done:
            last_done = self.yielded.popleft()
            self.done.discard(last_done)
        return None if last_done is None else last_done + 1

    def replay_from(self) -> int | None:
        """Where to seek to re-read held offsets, if any."""
        return min(self.redeliver) if self.redeliver else None
