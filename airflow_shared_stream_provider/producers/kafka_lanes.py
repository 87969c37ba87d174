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

import json
from collections import deque
from dataclasses import dataclass, field

# Kafka's default offset.metadata.max.bytes is 4096: keep the attempt map well below it.
MAX_TRACKED_ATTEMPTS = 64


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
        if self.attempts:
            self.attempts.pop(offset, None)

    def hold(self, offset: int, *, attempts: int) -> None:
        """The offset must be read again (failed or nobody subscribed); ``attempts`` so far."""
        self.redeliver.add(offset)
        self.attempts[offset] = attempts

    def position(self) -> int | None:
        """Where a restarted consumer must resume: the first read offset not yet done."""
        if self.yielded:
            return self.yielded[0]
        return self.high_yielded + 1 if self.high_yielded >= 0 else None

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
