"""
Split detection: is this stream's cohort also running, in part, on another triggerer?

Airflow 3.3 cannot pin asset watchers to a triggerer, so with several triggerers the siblings of
one stream split between them, and each triggerer opens its own consumer. On a queue (SQS, a
Service Bus queue or subscription, one Pub/Sub subscription) those consumers *compete*: each
message reaches the watchers of one triggerer only, and the others never see it. Nothing in the
broker or in Airflow tells a triggerer that this happens.

How it is detected. Every :data:`heartbeat_interval` the stream writes a heartbeat
``{"owner": host:pid:stream, "at": epoch seconds}`` to each of its watchers' asset state stores,
and reads the heartbeat of every *expected but absent* member of its cohort (a watcher that was in
this stream's last formation, :mod:`.cohort`, and is not subscribed here). A fresh heartbeat of
another owner means that watcher runs in another triggerer's stream right now: the stream is split.
The triggerer then logs an ERROR naming the watchers and the other owner (again every 10 minutes
while it lasts) and sets the ``split_triggerers`` gauge.

What it cannot see: watchers that were never in one formation with this stream (two triggerers
that started at the same time and never swapped a watcher). It sees the common cases: a second
triggerer added to a deployment, a fail-over, watchers moved back and forth by late heartbeats.

For Kafka with watcher positions a split is harmless (every stream reads every partition), so it is
logged at INFO there.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Hashable
from typing import Any, Final

from airflow_shared_stream_provider._core.cohort import CONFIG_SECTION, Cohort
from airflow_shared_stream_provider._core.state_store import StateStore, read_quietly, write_all

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL: Final = 30.0
# A heartbeat older than this many intervals is a stopped stream, not a split.
FRESH_INTERVALS: Final = 3
REPEAT_ERROR_SECONDS: Final = 600.0


def heartbeat_interval() -> float:
    """``[shared_stream_provider] heartbeat_interval`` (seconds, default 30; 0 turns detection off)."""
    from airflow.configuration import conf

    return max(0.0, conf.getfloat(CONFIG_SECTION, "heartbeat_interval", fallback=DEFAULT_HEARTBEAT_INTERVAL))


def heartbeat_key(stream_key: Hashable) -> str:
    digest = hashlib.sha256(repr(stream_key).encode()).hexdigest()[:16]
    return f"shared-stream-heartbeat/{digest}"


def assets_of(identity: str) -> list[str]:
    """The asset names in a cohort identity (``"a+b#digest"``, see :func:`.cohort.identity_of`)."""
    names, _, _ = identity.rpartition("#")
    return [name for name in names.split("+") if name and name != "?"]


def airflow_accessor(asset_name: str) -> StateStore:
    """The state store of any asset, by name (what a watcher's ``asset_state_store[...]`` returns)."""
    from airflow.sdk.execution_time.context import AssetStateStoreAccessor

    return AssetStateStoreAccessor(name=asset_name)  # type: ignore[return-value]


class SplitWatch:
    """One stream's heartbeats and split check; :meth:`run` until cancelled."""

    def __init__(
        self,
        cohort: Cohort,
        *,
        stream_key: Hashable,
        stream: str,
        competing: bool,
        interval: float,
        accessor_for: Callable[[str], StateStore] | None = None,
        on_split: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cohort = cohort
        self.key = heartbeat_key(stream_key)
        self.stream = stream
        self.competing = competing
        self.interval = interval
        self.accessor_for = accessor_for or airflow_accessor
        self.on_split = on_split
        self.clock = clock
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.splits: dict[str, str] = {}  # identity -> the other owner, as last checked
        self._last_error = float("-inf")

    async def run(self) -> None:
        while True:
            await self.beat()
            await self.check()
            await asyncio.sleep(self.interval)

    async def beat(self) -> None:
        """This stream's heartbeat, in each present member's own asset state store."""
        value = {"owner": self.owner, "at": self.clock()}
        stores = [member.stores[0] for member in list(self.cohort.members.values()) if member.stores]
        await write_all(
            (store, self.key, value, f"the heartbeat of stream {self.stream} to asset {name}") for name, store in stores
        )

    async def check(self) -> dict[str, str]:
        """Expected-but-absent members heart-beating from elsewhere: ``identity -> owner``."""
        found: dict[str, str] = {}
        now = self.clock()
        cohort = self.cohort
        # Members of this stream's record (read at join, or written by this stream) not subscribed here.
        absent = set(cohort.expected) | set(cohort.recorded)
        absent -= set(cohort.present())
        for identity in sorted(absent):
            names = assets_of(identity)
            if not names:
                continue
            beat: Any = await read_quietly(
                self.accessor_for(names[0]), self.key, f"the heartbeat of {identity}", level=logging.DEBUG
            )
            if not isinstance(beat, dict):
                continue
            owner, at = beat.get("owner"), beat.get("at")
            if not isinstance(owner, str) or owner == self.owner or not isinstance(at, int | float):
                continue
            if now - at <= FRESH_INTERVALS * self.interval:
                found[identity] = owner
        self.splits = found
        if self.on_split is not None:
            self.on_split(len(found))
        if found:
            self._report(found)
        return found

    def _report(self, found: dict[str, str]) -> None:
        owners = sorted(set(found.values()))
        if not self.competing:
            log.info(
                "Shared stream %s also runs on another triggerer (%d watcher(s) there: %s); fine with "
                "watcher positions: every triggerer's stream reads every partition",
                self.stream,
                len(found),
                owners,
            )
            return
        now = time.monotonic()
        if now - self._last_error < REPEAT_ERROR_SECONDS:
            return
        self._last_error = now
        log.error(
            "Shared stream %s is SPLIT across triggerers: %d of its watchers (%s) run in another triggerer's "
            "stream (%s). The triggerers' consumers compete for messages: each message reaches the watchers "
            "of one triggerer only, the others never see it. Run all watchers in one triggerer "
            "([triggerer] queues_enabled = True, and --queues on every other triggerer) or give each "
            "triggerer its own subscription; see docs/reliability.md, 'Several triggerers'.",
            self.stream,
            len(found),
            sorted(found)[:20],
            owners,
        )
