"""
The outcome -> disposition mapping as ``advance`` applies it: its fast path for clean outcomes
must decide and count exactly what :func:`decide` and the per-message count would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome
from hypothesis import given
from hypothesis import strategies as st

from airflow_shared_stream_provider._core.dispositions import Decision, decide
from airflow_shared_stream_provider._core.envelope import StreamMessage
from airflow_shared_stream_provider._core.producer import Decided, message_outcome
from devkit.memory import (
    MemoryDelivery,
    MemoryMessage,
    MemorySharedStreamProducer,
    MemorySharedStreamTrigger,
    brokers,
)

COUNTED = ("advanced", "committed", "dead_lettered", "redelivered", "held", "rejected", "poison")


class CapturingProducer(MemorySharedStreamProducer):
    """The real base ``advance``; ``_apply`` only records what it was asked to do."""

    applied: list[Decision]

    async def _apply(self, decided: Sequence[Decided[MemoryDelivery]]) -> None:
        self.applied = [entry.decision for entry in decided]


def make_producer() -> CapturingProducer:
    trigger = MemorySharedStreamTrigger(broker_name="dispositions", max_delivery_attempts=3)
    return CapturingProducer(trigger.settings, stream_key=("dispositions", id(trigger)))


outcomes = st.builds(
    AdvanceOutcome,
    acked=st.integers(0, 3),
    failed=st.integers(0, 2),
    rejected=st.integers(0, 2),
)
messages = st.tuples(
    outcomes,
    st.integers(1, 5),  # delivery attempt
    st.none() | st.lists(st.text(max_size=5), min_size=1, max_size=2),  # rejections
    st.none() | st.lists(st.text(max_size=5), min_size=1, max_size=2),  # failures
    st.booleans(),  # culprit: a watcher failed on this very message
    st.booleans(),  # suspect: a force-failed watcher stood on it
)


@given(st.lists(messages, min_size=1, max_size=12))
def test_advance_decides_and_counts_like_decide(
    cases: list[tuple[AdvanceOutcome, int, list[str] | None, list[str] | None, bool, bool]],
) -> None:
    producer = make_producer()
    batch = []
    expected = []
    for index, (outcome, attempt, rejections, failures, culprit, suspect) in enumerate(cases):
        message = StreamMessage({"message_id": str(index)}, producer.take_seq())
        message.rejections = rejections
        message.failures = failures
        message.culprit = culprit
        message.suspect = suspect
        raw = MemoryMessage(str(index), b"{}", attempts=attempt)
        batch.append(AdvanceItem(MemoryDelivery(message, attempt, raw), outcome))
        merged = message_outcome(outcome, message)
        # A collateral failure (_core/attempts.py) is not counted: one delivery less for the cap.
        collateral = merged.failed and not merged.rejected and not culprit and not suspect
        expected.append(
            decide(
                merged,
                delivery_attempt=attempt - (1 if collateral else 0),
                max_delivery_attempts=3,
                rejections=rejections,
            )
        )
    reference = make_producer()
    try:
        asyncio.run(producer.advance(batch))
        assert producer.applied == expected
        # The counters match the per-message count, whichever path advance took.
        reference._count(batch, [Decided(item.broker_payload, d) for item, d in zip(batch, expected, strict=True)])
        assert {name: getattr(producer.counters, name) for name in COUNTED} == {
            name: getattr(reference.counters, name) for name in COUNTED
        }
    finally:
        asyncio.run(producer.aclose())
        asyncio.run(reference.aclose())
        brokers.pop("dispositions", None)
