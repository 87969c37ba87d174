"""
The check of ``shared_stream_key()`` every broker's trigger gets, written once, and its table.

``tests/unit/test_settings_once.py`` runs :func:`assert_every_setting_reaches_the_key` for every
entry of the broker registry against :data:`KEY_CASES`; a broker without an entry there fails, so
a new broker (or a new setting of an old one) cannot be left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger


@dataclasses.dataclass(frozen=True)
class Change:
    """
    A setting's alternative that cannot be a lone value on the base arguments: ``reference`` is
    what the comparison starts from (the base arguments updated with it; a setting may need
    another one set first, e.g. ``sessions=True`` for a session option), ``changed`` the
    arguments then changed (the setting's own, plus any it must move with).
    """

    changed: Mapping[str, Any]
    reference: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KeyCase:
    """
    ``base``: valid trigger arguments. ``alternatives``: one entry per field of the trigger's
    settings, a value other than ``base``'s (or a :class:`Change`) that passes validation.
    """

    base: Mapping[str, Any]
    alternatives: Mapping[str, Any]


# The options every broker takes (StreamSettings' fields), each with a non-default value.
_COMMON: dict[str, Any] = {
    "max_payload_bytes": 4096,
    "oversize_policy": "truncate",
    "max_delivery_attempts": 9,
    "max_in_flight": 5,
    "max_in_flight_bytes": 8 * 1024 * 1024,
    "batch_size": 100,
    "batch_timeout": 2.0,
}

_SQS_QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"

KEY_CASES: dict[str, KeyCase] = {
    "kafka": KeyCase(
        base={"topics": ["orders"], "kafka_config_id": "kafka_prod"},
        alternatives={
            "topics": ["orders", "refunds"],
            "kafka_config_id": "other",
            "group_id": "g2",
            "dlq_topic": "dlq",
            "poll_timeout": 2.0,
            "max_batch_size": 10,
            "on_partial_assignment": "warn",
            "partial_assignment_grace": 1.0,
            "hold_backoff": 3.0,
            "position_store": "group",
            **_COMMON,
        },
    ),
    "sqs": KeyCase(
        base={"queue_url": _SQS_QUEUE, "aws_conn_id": "aws_prod"},
        alternatives={
            "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/refunds",
            "aws_conn_id": "aws_other",
            "region_name": "eu-west-1",
            "dlq_queue_url": _SQS_QUEUE + "-dlq",
            "wait_time_seconds": 5,
            "visibility_timeout": 60,
            "concurrent_receives": 3,
            "hold_backoff": 7,
            "reject_backoff": 30,
            **_COMMON,
        },
    ),
    "pubsub": KeyCase(
        base={"subscription": "projects/proj-a/subscriptions/orders-sub"},
        alternatives={
            "subscription": "projects/proj-a/subscriptions/other-sub",
            # project_id is in the key, not excluded from it: the trigger folds it into the full
            # subscription path (triggers/pubsub.py, "one spelling per stream"), so watchers on the
            # short name "orders-sub" that differ only in project_id (proj-b here, proj-a as the
            # base is spelled) get different keys. It cannot differ from a full path's project
            # (refused at parse time), so the comparison starts from the short name.
            "project_id": Change(reference={"subscription": "orders-sub"}, changed={"project_id": "proj-b"}),
            "gcp_conn_id": "gcp_other",
            "dead_letter_topic": "projects/proj-a/topics/dead",
            "max_messages": 10,
            "pull_timeout": 2.5,
            "ack_deadline_seconds": 120,
            "ack_flush_interval": 0.2,
            **_COMMON,
            "max_in_flight": 500,
        },
    ),
    "servicebus": KeyCase(
        base={"queue_name": "orders"},
        alternatives={
            "queue_name": "other-queue",
            # A topic subscription instead of a queue, then each of its two names changed alone.
            "topic_name": Change(
                reference={"queue_name": None, "topic_name": "orders", "subscription_name": "a"},
                changed={"topic_name": "refunds"},
            ),
            "subscription_name": Change(
                reference={"queue_name": None, "topic_name": "orders", "subscription_name": "a"},
                changed={"subscription_name": "b"},
            ),
            "azure_service_bus_conn_id": "other_conn",
            "prefetch_count": 0,
            "max_message_count": 10,
            "max_wait_time": 1.5,
            "renew_locks": False,
            "sessions": True,
            # Session options are refused without sessions=True: compare against a session stream.
            "max_concurrent_sessions": Change(reference={"sessions": True}, changed={"max_concurrent_sessions": 3}),
            "session_idle_timeout": Change(reference={"sessions": True}, changed={"session_idle_timeout": 0.5}),
            **_COMMON,
            "max_in_flight": 50,
        },
    ),
    "redis": KeyCase(
        base={"stream": "orders", "redis_conn_id": "redis_prod"},
        alternatives={
            "stream": "refunds",
            "redis_conn_id": "redis_other",
            "group": "other-group",
            "dead_letter_stream": "orders:dead-letter",
            "dead_letter_maxlen": 1000,
            "body_field": "payload",
            "create_group": False,
            "group_start_id": "$",
            "claim_idle": 60,
            "block": 5.0,
            "read_count": 500,
            "hold_backoff": 3,
            **_COMMON,
        },
    ),
}


def _spelling(kwargs: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in kwargs.items()))


def assert_every_setting_reaches_the_key(trigger_class: type[SharedStreamTrigger], case: KeyCase) -> None:
    """
    Every field of the trigger's settings changes ``shared_stream_key()``: a producer setting
    outside the key would let the first subscriber's value win silently. Checked:

    1. ``case.alternatives`` names exactly the settings' fields (a new setting needs an entry);
    2. each alternative's key differs from its reference's (the base, or its :class:`Change`'s);
    3. distinct argument sets (base, references, alternatives) give distinct keys, each hashable:
       no two settings collapse onto one key.
    """
    names = {f.name for f in dataclasses.fields(trigger_class(**case.base).settings)}
    assert names == set(case.alternatives), (
        f"settings fields without an alternative: {sorted(names - set(case.alternatives))}; "
        f"alternatives that are no field: {sorted(set(case.alternatives) - names)}"
    )
    keys: dict[tuple[tuple[str, str], ...], Hashable] = {}

    def key_of(kwargs: Mapping[str, Any]) -> Hashable:
        key = trigger_class(**kwargs).shared_stream_key()
        hash(key)
        keys[_spelling(kwargs)] = key
        return key

    key_of(case.base)
    for name, alternative in case.alternatives.items():
        change = alternative if isinstance(alternative, Change) else Change(changed={name: alternative})
        assert name in change.changed, f"{name}: the Change does not change {name}"
        reference = {**case.base, **change.reference}
        changed = {**reference, **change.changed}
        assert _spelling(changed) != _spelling(reference), f"{name}: the alternative equals its reference"
        assert key_of(changed) != key_of(reference), f"{name} is not part of the shared_stream_key"
    by_key: dict[Hashable, list[tuple[tuple[str, str], ...]]] = {}
    for spelling, key in keys.items():
        by_key.setdefault(key, []).append(spelling)
    shared = [spellings for spellings in by_key.values() if len(spellings) > 1]
    assert not shared, f"different settings share one key: {shared}"
