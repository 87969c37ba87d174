"""
The consumer group: trigger ``group_id`` > the connection's ``group.id`` > derived, continuity with
the upstream provider's committed offsets, and (``position_store="group"``) one stream per group and
topic in a triggerer.

Real broker (Tansu or KAFKA_BOOTSTRAP_SERVERS), real ``SharedStreamManager`` driven like the
triggerer (RunnerSim), and for continuity the upstream provider's own shared-stream trigger.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.base import TriggerEvent
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider.producers.kafka_groups import group_claims
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async

from .conftest import KafkaAdapter

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

MIGRATED_CONN = "kafka_migrated"
PER_PARTITION = 10


def connection_extra(adapter: KafkaAdapter, *, group_id: str | None) -> dict[str, Any]:
    """The connection as an upstream-provider user has it: group.id and auto-commit off."""
    extra: dict[str, Any] = {
        "bootstrap.servers": adapter.bootstrap,
        "enable.auto.commit": "false",
        "auto.offset.reset": "earliest",
        # Tansu holds a JoinGroup for half the session timeout: short, and equal for both clients.
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 2000,
    }
    if group_id is not None:
        extra["group.id"] = group_id
    return extra


def set_connection(monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{MIGRATED_CONN.upper()}", json.dumps({"conn_type": "kafka", "extra": extra}))


@pytest.fixture(autouse=True)
def no_claim_outlives_its_test() -> Iterator[None]:
    yield
    assert not group_claims._claims, f"group claims left behind: {group_claims._claims}"


async def publish_numbered(adapter: KafkaAdapter) -> None:
    """``PER_PARTITION`` messages per partition, body ``{"p": partition, "i": index}`` (offset == i)."""
    for partition in range(adapter.partitions):
        bodies = [json.dumps({"p": partition, "i": i}).encode() for i in range(PER_PARTITION)]
        await adapter.publish(bodies, partition=partition)


async def committed_equals(adapter: KafkaAdapter, expected: dict[int, int]) -> bool:
    return await adapter.committed() == expected


async def test_a_stream_continues_from_the_upstream_providers_committed_offsets(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.providers.apache.kafka.triggers.shared_stream import (
        KafkaSharedStreamTrigger as UpstreamKafkaSharedStreamTrigger,
    )

    set_connection(monkeypatch, connection_extra(adapter, group_id=adapter.group_id))
    await publish_numbered(adapter)
    # Upstream persists a different prefix of each partition; each partition keeps an unpersisted
    # tail, so the last message the watcher sits on is never one that has to be committed.
    cuts = {0: 3, 1: 6, 2: 8}

    def in_prefix(_trigger_id: int, event: TriggerEvent) -> bool:
        body = json.loads(event.payload)
        return bool(body["i"] < cuts[body["p"]])

    # 1. The upstream provider's shared stream, on the real manager, commits those prefixes.
    async with RunnerSim(SharedStreamManager()) as upstream:
        upstream.add(1, UpstreamKafkaSharedStreamTrigger(topics=[adapter.topic], kafka_config_id=MIGRATED_CONN))
        total = adapter.partitions * PER_PARTITION
        await wait_until(lambda: len(upstream.pending) == total, timeout=60, what="upstream read every message")
        upstream.persist_matching(in_prefix)
        await wait_until_async(lambda: committed_equals(adapter, cuts), timeout=30)
    assert await adapter.committed() == cuts, "upstream committed past its persisted prefix"

    # 2. Ours, same connection, no group_id on the trigger: continues exactly there.
    expected = {(p, i) for p, cut in cuts.items() for i in range(cut, PER_PARTITION)}
    ends = {p: PER_PARTITION for p in range(adapter.partitions)}
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as ours:
        ours.add(1, KafkaSharedStreamTrigger(topics=[adapter.topic], kafka_config_id=MIGRATED_CONN, poll_timeout=0.2))
        await wait_until(lambda: ours.count(1) >= len(expected), timeout=60, what="ours read the rest")
        # Checked before waiting for the commits: in another group (the connection's group.id
        # dropped) the commits would never reach the ends, and this says why.
        read = Counter((payload["body"]["p"], payload["body"]["i"]) for payload in ours.persisted[1])
        assert set(read) == expected, "skipped or re-read messages across the migration"
        await wait_until_async(lambda: committed_equals(adapter, ends), timeout=30)
        assert not ours.failures, ours.failures
    read = Counter((payload["body"]["p"], payload["body"]["i"]) for payload in ours.persisted[1])
    assert set(read) == expected, "skipped or re-read messages across the migration"
    assert max(read.values()) == 1, "a message was read twice"
    assert {payload["metadata"]["group_id"] for payload in ours.persisted[1]} == {adapter.group_id}
    assert all(p["metadata"]["offset"] == p["body"]["i"] for p in ours.persisted[1])


@pytest.mark.parametrize(
    ("trigger_group", "connection_group", "expected"),
    [
        ("from-trigger", "from-connection", "from-trigger"),
        (None, "from-connection", "from-connection"),
        (None, None, "derived"),
    ],
)
async def test_the_group_is_the_triggers_else_the_connections_else_derived(
    adapter: KafkaAdapter,
    monkeypatch: pytest.MonkeyPatch,
    trigger_group: str | None,
    connection_group: str | None,
    expected: str,
) -> None:
    suffix = adapter.group_id  # unique per test: groups never carry offsets from another test
    set_connection(monkeypatch, connection_extra(adapter, group_id=connection_group and f"{connection_group}-{suffix}"))
    trigger = KafkaSharedStreamTrigger(
        topics=[adapter.topic],
        kafka_config_id=MIGRATED_CONN,
        group_id=trigger_group and f"{trigger_group}-{suffix}",
        poll_timeout=0.2,
    )
    group = trigger.settings.effective_group_id() if expected == "derived" else f"{expected}-{suffix}"
    await adapter.publish([b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    adapter.group_id = group  # where the commits must land
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as runner:
        runner.add(1, trigger)
        await wait_until_async(lambda: committed_equals(adapter, {0: 1, 1: 1, 2: 1}), timeout=60)
    assert {p["metadata"]["group_id"] for p in runner.persisted[1]} == {group}
    for other in {f"from-trigger-{suffix}", f"from-connection-{suffix}"} - {group}:
        adapter.group_id = other
        assert await adapter.committed() == {0: 0, 1: 0, 2: 0}, f"commits landed in {other}"


async def test_two_streams_resolving_to_one_group_on_one_topic_fail_the_second(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_claims, "handover_grace", 0.5)
    set_connection(monkeypatch, connection_extra(adapter, group_id=adapter.group_id))

    def stream(**kwargs: Any) -> KafkaSharedStreamTrigger:
        # Group mode: with watcher positions (the default) a stream assigns itself every partition
        # and no claim is needed (test_watcher_positions.py runs two streams on one group).
        return KafkaSharedStreamTrigger(
            topics=[adapter.topic], kafka_config_id=MIGRATED_CONN, poll_timeout=0.2, position_store="group", **kwargs
        )

    await adapter.publish([b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.05) as runner:
        runner.add(1, stream())
        await wait_until_async(lambda: committed_equals(adapter, {0: 1, 1: 1, 2: 1}), timeout=60)
        # Another stream (a different producer setting: another key) on the same topic and the
        # connection's group: it would split the partitions with the first one.
        runner.add(2, stream(dlq_topic=adapter.dlq_topic))
        await wait_until(lambda: 2 in runner.failures, timeout=30, what="the second stream failed")
        error = runner.failures[2]
        assert isinstance(error, SharedStreamConfigError)
        message = str(error)
        assert f"group {adapter.group_id!r} (group.id of connection {MIGRATED_CONN!r})" in message
        assert f"on the topics [{adapter.topic!r}]" in message
        assert f"dlq_topic={adapter.dlq_topic!r} vs None" in message
        assert repr(stream().shared_stream_key()) in message
        assert repr(stream(dlq_topic=adapter.dlq_topic).shared_stream_key()) in message
        # The first stream never noticed: still the only member, it reads what comes next.
        await adapter.publish([b'{"n": 4}', b'{"n": 5}', b'{"n": 6}'])
        await wait_until_async(lambda: committed_equals(adapter, {0: 2, 1: 2, 2: 2}), timeout=60)
        assert 1 not in runner.failures and runner.count(1) == 6
        [claim] = group_claims.holders(adapter.group_id)
        assert claim.stream_key == stream().shared_stream_key()


async def test_a_stream_restarting_while_its_old_producer_runs_keeps_the_group(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The same key claiming again before its previous producer closed (what a restarted group does:
    the manager starts the new group before the old producer's close finished) is allowed, and
    the old producer's close leaves the new one's claim in place.
    """
    monkeypatch.setattr(group_claims, "handover_grace", 0.5)
    set_connection(monkeypatch, connection_extra(adapter, group_id=adapter.group_id))

    def stream(**kwargs: Any) -> KafkaSharedStreamTrigger:
        options: dict[str, Any] = {"poll_timeout": 0.2, "on_partial_assignment": "warn", "position_store": "group"}
        options.update(kwargs)
        return KafkaSharedStreamTrigger(topics=[adapter.topic], kafka_config_id=MIGRATED_CONN, **options)

    old = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    new = RunnerSim(SharedStreamManager(), confirm_interval=0.05)
    await adapter.publish([json.dumps({"n": n}).encode() for n in range(6)])
    async with new:
        async with old:
            old.add(1, stream())
            await wait_until(lambda: len(group_claims.holders(adapter.group_id)) == 1, timeout=30, what="old claim")
            new.add(1, stream())
            await wait_until(lambda: len(group_claims.holders(adapter.group_id)) == 2, timeout=30, what="new claim")
            # Both members joined and split the partitions (what the restart overlap looks like).
            await wait_until_async(lambda: committed_equals(adapter, {0: 2, 1: 2, 2: 2}), timeout=60)
            assert not old.failures and not new.failures
            assert old.count(1) > 0 and new.count(1) > 0
        # The old producer closed: the new one holds the group alone, and keeps it.
        [claim] = group_claims.holders(adapter.group_id)
        assert claim.stream_key == stream().shared_stream_key()
        new.add(2, stream(dlq_topic=adapter.dlq_topic))
        await wait_until(lambda: 2 in new.failures, timeout=30, what="a different stream refused")
        assert isinstance(new.failures[2], SharedStreamConfigError)
        # After the rebalance the restarted stream owns every partition and reads what comes next.
        await adapter.publish([json.dumps({"n": n}).encode() for n in range(6, 9)])
        await wait_until_async(lambda: committed_equals(adapter, {0: 3, 1: 3, 2: 3}), timeout=60)
        assert 1 not in new.failures
