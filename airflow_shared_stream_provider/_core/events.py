"""
The TriggerEvent our watchers yield: Airflow's, with a ``repr`` that names the messages instead of
repeating them.

Why it matters (measured, Airflow 3.3.2): the trigger runner logs every event it receives
(``log.ainfo("Trigger fired event", result=event)``), and the log line carries ``repr(event)``.
The triggerer's supervisor reads that log channel **4 KiB per select wake-up**
(``make_buffered_socket_reader``) and runs one whole loop after each read: trigger assignment,
cleanup and heartbeat queries against the metadata DB (``TriggerRunnerSupervisor.run_once``). A
batch event of ~140 envelopes (~70 KiB of repr) cost ~18 such loops, ~70 ms, on PostgreSQL, and
filled the triggerer log with every payload (66 MB a minute in the benchmark). The payload itself
travels on the separate request channel and is stored whole in the asset event; only the log line
shrinks.

The subclass adds no field, so the runner -> supervisor channel (whose schema is
``TriggerEvent``) serializes it exactly as a ``TriggerEvent`` and the supervisor rebuilds a plain
one: nothing downstream can tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.triggers.base import TriggerEvent

# Longest repr of a payload that is not one of ours (a user's make_event override, a marker).
_OTHER_REPR_LIMIT = 240


class StreamTriggerEvent(TriggerEvent):
    """A :class:`TriggerEvent` whose ``repr`` (the triggerer's log line) is one short line."""

    def __init__(self, payload: Any) -> None:
        super().__init__(payload)  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"TriggerEvent<{describe_payload(self.payload)}>"


def describe_payload(payload: Any) -> str:
    """
    One short line for a payload: a batch by its size and first and last message ids, a single
    envelope by its broker and id, anything else by its repr cut to 240 characters.
    """
    if isinstance(payload, Mapping):
        messages = payload.get("messages")
        if isinstance(messages, list) and len(payload) == 1:
            if not messages:
                return "batch of 0 messages"
            first, last = _id_of(messages[0]), _id_of(messages[-1])
            span = first if len(messages) == 1 else f"{first} .. {last}"
            return f"batch of {len(messages)} {_broker_of(messages[0])} messages {span}"
        if "message_id" in payload and "broker" in payload:
            return f"{_broker_of(payload)} message {_id_of(payload)}"
    text = repr(payload)
    if len(text) <= _OTHER_REPR_LIMIT:
        return text
    return f"{text[:_OTHER_REPR_LIMIT]}... ({len(text)} characters)"


def _id_of(envelope: Any) -> str:
    return repr(envelope.get("message_id")) if isinstance(envelope, Mapping) else "?"


def _broker_of(envelope: Any) -> str:
    broker = envelope.get("broker") if isinstance(envelope, Mapping) else None
    return broker if isinstance(broker, str) else "?"
