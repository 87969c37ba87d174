"""The example Dags' consumer helper reads both event shapes and skips flush markers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "example_dags"))

from order_events import envelopes_of, unique_envelopes


def envelope(message_id: str, partition: int = 0, offset: int = 0) -> dict[str, Any]:
    return {"message_id": message_id, "source": "orders", "metadata": {"partition": partition, "offset": offset}}


def stored(payload: Any) -> dict[str, Any]:
    return {"from_trigger": True, "payload": payload}


def test_one_envelope_per_event_and_batches_read_alike() -> None:
    assert envelopes_of(stored(envelope("a"))) == [envelope("a")]
    assert envelopes_of(stored({"messages": [envelope("a"), envelope("b")]})) == [envelope("a"), envelope("b")]


def test_markers_and_foreign_events_carry_no_message() -> None:
    assert envelopes_of(stored({"marker": "flush", "after_message_id": "a"})) == []
    assert envelopes_of({"note": "created by hand"}) == []
    assert envelopes_of(None) == []


def test_unique_envelopes_unpacks_batches_dedups_and_orders() -> None:
    events = {
        "asset": [
            {"extra": stored({"messages": [envelope("m2", 0, 2), envelope("m1", 0, 1)]})},
            {"extra": stored(envelope("m1", 0, 1))},  # a redelivery, alone
            {"extra": stored({"marker": "flush"})},
        ]
    }
    assert [e["message_id"] for e in unique_envelopes(events)] == ["m1", "m2"]
