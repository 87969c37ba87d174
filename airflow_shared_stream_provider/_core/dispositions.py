"""
Outcome -> disposition, in one place for every broker.

The manager reports, per message, how many watchers acked / failed / rejected it
(:class:`~airflow.triggers.shared_stream.AdvanceOutcome`). This module turns that into one of four
broker-neutral dispositions; each producer only says what the four mean on its broker:

==============  =====================================================  =================================
disposition     when                                                   meaning
==============  =====================================================  =================================
COMMIT          every watcher accepted (acked > 0, nothing else)       the broker may forget the message
DEAD_LETTER     any watcher rejected, or the poison cap was reached    move it to the dead-letter target
REDELIVER       some watcher failed (ack timeout / overflow)           deliver it again, promptly
HOLD            nobody was subscribed when it was broadcast            keep it, deliver it later
==============  =====================================================  =================================

Precedence: a reject wins over a failure (the guidance for Service Bus: dead-letter when any
subscriber rejected, abandon when only failures occurred, complete when every subscriber accepted).
A failed message whose ``delivery_attempt`` has reached ``max_delivery_attempts`` is dead-lettered
instead of redelivered again: the poison cap.
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

from airflow.triggers.shared_stream import AdvanceOutcome

DEFAULT_MAX_DELIVERY_ATTEMPTS: Final = 5


class Disposition(enum.Enum):
    COMMIT = "commit"
    DEAD_LETTER = "dead_letter"
    REDELIVER = "redeliver"
    HOLD = "hold"


class Decision(NamedTuple):
    disposition: Disposition
    reason: str


COMMIT_DECISION: Final = Decision(Disposition.COMMIT, "accepted by every watcher")
_HOLD = Decision(Disposition.HOLD, "no watcher was subscribed when it was broadcast")


def decide(
    outcome: AdvanceOutcome,
    *,
    delivery_attempt: int,
    max_delivery_attempts: int | None,
    rejections: list[str] | None = None,
) -> Decision:
    """Map one message's outcome to its disposition and a human-readable reason."""
    if outcome.rejected:
        detail = "; ".join(dict.fromkeys(rejections)) if rejections else "reject_shared_stream_event()"
        return Decision(Disposition.DEAD_LETTER, f"rejected by {outcome.rejected} watcher(s): {detail}")
    if outcome.failed:
        if max_delivery_attempts is not None and delivery_attempt >= max_delivery_attempts:
            return Decision(
                Disposition.DEAD_LETTER,
                f"poison message: failed {delivery_attempt} delivery attempt(s) "
                f"(max_delivery_attempts={max_delivery_attempts})",
            )
        return Decision(Disposition.REDELIVER, f"failed for {outcome.failed} watcher(s) (ack timeout or overflow)")
    if outcome.acked:
        return COMMIT_DECISION
    return _HOLD
