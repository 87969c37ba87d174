"""
Which shared streams of this triggerer consume through which Kafka consumer group.

Two producers that are members of one group on the same topics would split the partitions, and
each stream would silently see only part of the topic. :data:`group_claims` makes the second one
fail at start with an error naming both (see :class:`ConsumerGroupClaims`). No Kafka client here:
only settings and asyncio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Hashable

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.tasks import wait_for
from airflow_shared_stream_provider.producers.kafka_config import ResolvedGroup
from airflow_shared_stream_provider.triggers.kafka import KafkaStreamSettings

_log = logging.getLogger(__name__)


def bootstrap_addresses(bootstrap_servers: str) -> frozenset[str]:
    """``"B1:9092, b2:9092"`` -> ``{"b1:9092", "b2:9092"}``: what identifies a cluster here."""
    return frozenset(part.strip().lower() for part in bootstrap_servers.split(",") if part.strip())


@dataclasses.dataclass(eq=False)
class GroupClaim:
    """One running producer's use of a consumer group (compared by identity: one per producer)."""

    group: ResolvedGroup
    stream_key: Hashable
    settings: KafkaStreamSettings
    bootstrap: frozenset[str]
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def describe(self) -> str:
        return f"topics {','.join(self.settings.topics)} on connection {self.settings.kafka_config_id!r}"


class ConsumerGroupClaims:
    """
    Process-wide: consumer group -> the shared streams of this triggerer consuming through it.

    Invariant: two claims of one group on overlapping topics of one cluster (bootstrap addresses
    in common) always belong to the same shared-stream key. Two producers of one key overlap only
    while a restarted group's new producer starts before the old one finished closing (the manager
    evicts a stopping group before closing its producer); that handover is allowed. Streams with
    different keys would be two members splitting the partitions for good; the later one waits
    ``handover_grace`` seconds for the other to go away (a Dag change replaces a stream's
    settings: the new stream may start before the old one closed), then fails.

    Claims on disjoint topics may share a group (Kafka assigns each member only the partitions of
    the topics it subscribed to). Only this process is covered: the same group on another
    triggerer is caught by the partial-assignment check.

    Single event loop, like the manager: ``claim`` checks and records without an ``await`` in
    between, so two producers starting together cannot both pass the check.
    """

    def __init__(self, handover_grace: float = 10.0) -> None:
        self.handover_grace = handover_grace
        self._claims: dict[str, list[GroupClaim]] = {}

    def holders(self, group_id: str) -> tuple[GroupClaim, ...]:
        return tuple(self._claims.get(group_id, ()))

    def _conflict(self, claim: GroupClaim) -> GroupClaim | None:
        topics = set(claim.settings.topics)
        for other in self._claims.get(claim.group.group_id, ()):
            if other.stream_key == claim.stream_key:
                continue  # a restarted group of the same stream: its old producer is closing
            if topics & set(other.settings.topics) and claim.bootstrap & other.bootstrap:
                return other
        return None

    async def claim(self, claim: GroupClaim) -> None:
        """Record ``claim``; raise :class:`SharedStreamConfigError` while another stream holds its group."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.handover_grace
        while True:
            other = self._conflict(claim)
            if other is None:
                self._claims.setdefault(claim.group.group_id, []).append(claim)
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise SharedStreamConfigError(_conflict_message(claim, other))
            _log.info(
                "Kafka shared stream [%s] waits up to %.1fs for stream [%s] to release consumer group %r",
                claim.describe(),
                remaining,
                other.describe(),
                claim.group.group_id,
            )
            try:
                await wait_for(other.released.wait(), timeout=remaining)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                continue  # re-checked once more, then the deadline has passed

    def release(self, claim: GroupClaim) -> None:
        """Forget ``claim`` (a no-op when it was never recorded, e.g. it lost a conflict)."""
        claims = self._claims.get(claim.group.group_id)
        if claims is not None:
            remaining = [c for c in claims if c is not claim]
            if remaining:
                self._claims[claim.group.group_id] = remaining
            else:
                del self._claims[claim.group.group_id]
        claim.released.set()


def _conflict_message(claim: GroupClaim, other: GroupClaim) -> str:
    shared = sorted(set(claim.settings.topics) & set(other.settings.topics))
    differences = [
        f"{f.name}={getattr(claim.settings, f.name)!r} vs {getattr(other.settings, f.name)!r}"
        for f in dataclasses.fields(claim.settings)
        if getattr(claim.settings, f.name) != getattr(other.settings, f.name)
    ]
    return (
        f"Kafka shared stream [{claim.describe()}] would consume as group {claim.group.group_id!r} "
        f"({claim.group.origin()}), which shared stream [{other.describe()}] of this triggerer already "
        f"uses ({other.group.origin()}) on the topics {shared}. Two members of one group split the "
        "partitions, and each stream would see only part of the topic. The streams differ in "
        f"{'; '.join(differences) or 'nothing but their keys'}: make their producer settings equal so "
        "they share one consumer, or give one of them its own group_id. Stream keys: "
        f"{claim.stream_key!r} and {other.stream_key!r}."
    )


group_claims = ConsumerGroupClaims()
