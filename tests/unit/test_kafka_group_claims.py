"""
The process-wide consumer-group registry of the Kafka producer: one group, one stream per topic.

Each test uses its own :class:`ConsumerGroupClaims` (the producer's module-level one is exercised
against a real broker in tests/integration/kafka/test_kafka_group_id.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.kafka_config import GroupSource, ResolvedGroup
from airflow_shared_stream_provider.producers.kafka_groups import ConsumerGroupClaims, GroupClaim, bootstrap_addresses
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger


def claim_for(
    group: str = "orders-group",
    *,
    source: GroupSource = "connection",
    bootstrap: str = "b1:9092,b2:9092",
    **trigger_kwargs: Any,
) -> GroupClaim:
    """A claim as the producer builds it: settings and key from a real trigger."""
    options: dict[str, Any] = {"topics": ["orders"], "kafka_config_id": "kafka_x"}
    options.update(trigger_kwargs)
    trigger = KafkaSharedStreamTrigger(**options)
    return GroupClaim(
        group=ResolvedGroup(group, source, trigger.settings.kafka_config_id),
        stream_key=trigger.shared_stream_key(),
        settings=trigger.settings,
        bootstrap=bootstrap_addresses(bootstrap),
    )


async def test_two_streams_in_one_group_on_one_topic_fail_naming_both_and_the_group() -> None:
    claims = ConsumerGroupClaims(handover_grace=0)
    first = claim_for(dlq_topic="orders.dlq")
    second = claim_for(dlq_topic="orders.rejected")
    await claims.claim(first)
    with pytest.raises(SharedStreamConfigError) as error:
        await claims.claim(second)
    message = str(error.value)
    assert "'orders-group'" in message
    assert "group.id of connection 'kafka_x'" in message
    assert "on the topics ['orders']" in message
    assert "dlq_topic='orders.rejected' vs 'orders.dlq'" in message
    assert repr(first.stream_key) in message and repr(second.stream_key) in message
    assert claims.holders("orders-group") == (first,)  # the running stream keeps its group


async def test_overlapping_is_enough_for_a_conflict() -> None:
    claims = ConsumerGroupClaims(handover_grace=0)
    await claims.claim(claim_for(topics=["orders", "refunds"]))
    with pytest.raises(SharedStreamConfigError, match=r"on the topics \['refunds'\]"):
        await claims.claim(claim_for(topics=["refunds", "returns"]))


async def test_the_same_stream_claims_again_while_its_old_producer_closes() -> None:
    """A restarted group: the manager starts the new producer before the old one closed."""
    claims = ConsumerGroupClaims(handover_grace=0)
    old = claim_for()
    new = claim_for()  # equal settings: the same shared-stream key
    assert old.stream_key == new.stream_key
    await claims.claim(old)
    await claims.claim(new)
    assert claims.holders("orders-group") == (old, new)
    claims.release(old)
    assert claims.holders("orders-group") == (new,)  # the old producer never releases the new one's claim
    with pytest.raises(SharedStreamConfigError):
        await claims.claim(claim_for(max_batch_size=7))


@pytest.mark.parametrize(
    "other",
    [
        {"topics": ["refunds"]},  # disjoint topics: Kafka gives each member its own topics' partitions
        {"bootstrap": "other-cluster:9092"},  # same group name on another cluster
        {"group": "another-group"},
    ],
)
async def test_streams_that_cannot_split_each_others_partitions_coexist(other: dict[str, Any]) -> None:
    claims = ConsumerGroupClaims(handover_grace=0)
    await claims.claim(claim_for(dlq_topic="orders.dlq"))
    await claims.claim(claim_for(**other))


async def test_one_common_bootstrap_address_means_one_cluster() -> None:
    claims = ConsumerGroupClaims(handover_grace=0)
    await claims.claim(claim_for(bootstrap="B1:9092, b2:9092"))
    with pytest.raises(SharedStreamConfigError):
        await claims.claim(claim_for(bootstrap="b2:9092,b3:9092", dlq_topic="orders.dlq"))


async def test_a_stream_replacing_another_waits_for_it_to_release_the_group() -> None:
    """A Dag change: the new stream's producer starts while the old one is still closing."""
    claims = ConsumerGroupClaims(handover_grace=10)
    old = claim_for(dlq_topic="orders.dlq")
    new = claim_for(dlq_topic="orders.dlq.v2")
    await claims.claim(old)
    waiting = asyncio.create_task(claims.claim(new))
    await asyncio.sleep(0.05)
    assert not waiting.done() and claims.holders("orders-group") == (old,)
    claims.release(old)
    await asyncio.wait_for(waiting, timeout=1)
    assert claims.holders("orders-group") == (new,)


async def test_a_conflict_that_outlasts_the_grace_fails_after_it() -> None:
    claims = ConsumerGroupClaims(handover_grace=0.3)
    await claims.claim(claim_for())
    started = time.monotonic()
    with pytest.raises(SharedStreamConfigError):
        await claims.claim(claim_for(poll_timeout=0.5))
    assert 0.3 <= time.monotonic() - started < 2


async def test_releasing_frees_the_group_and_a_lost_claim_releases_nothing() -> None:
    claims = ConsumerGroupClaims(handover_grace=0)
    first = claim_for()
    loser = claim_for(dlq_topic="orders.dlq")
    await claims.claim(first)
    with pytest.raises(SharedStreamConfigError):
        await claims.claim(loser)
    claims.release(loser)  # the producer's close always releases: a no-op for a claim never recorded
    assert claims.holders("orders-group") == (first,)
    claims.release(first)
    assert claims.holders("orders-group") == ()
    await claims.claim(loser)
    assert claims.holders("orders-group") == (loser,)
