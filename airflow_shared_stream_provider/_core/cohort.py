"""
The cohort: which watchers a shared stream waits for before it reads its first message.

Why. The manager broadcasts a message to the watchers subscribed at that moment, and the producer
advances (commits, deletes, acks) it once those have moved past it. A sibling that subscribes a
moment later never sees it: a *late subscriber*. With Airflow's default settings that is the
normal case after every triggerer restart: ``[triggerer] shared_stream_cohort_grace_period`` is 0,
and a triggerer takes at most ``max_trigger_to_select_per_loop`` (50) new triggers per loop, so a
stream with 120 watchers is re-formed over three loops; a backlog read after the first 50 arrived
was lost for the other 70 (measured on the real manager before this module existed).

What the producer does (every broker, before its first receive, :meth:`Cohort.wait_ready`):

1. **Settle.** Wait until no watcher has joined for ``cohort_settle`` seconds (default 3: a
   triggerer loop is about one second), so the watchers of one restart arrive before any message.
2. **Expected members.** Each watcher has an identity (its assets and filter) and reads, from its
   own asset's state store (``self.asset_state_store``, Airflow 3.3), the members its stream had
   the last time it formed. The producer waits until every expected member has joined, so even
   a triggerer whose loops are slower than the settle time re-forms the whole cohort. When the
   expected members are all present the settle time is not waited for.
3. **Bounded.** Never longer than ``cohort_max_wait`` (default 60 s): a watcher whose Dag was
   deleted, or that now runs on another triggerer, is waited for once, then forgotten (the record
   is rewritten with the members present). This is logged with the missing members' identities.

Once formed, the record is written to every member's asset state store, and grown (never shrunk)
when a watcher joins later: a graceful triggerer stop unsubscribes every watcher, and that must not
make the next start forget them.

**Returning members** (queue brokers: streams without watcher positions). A watcher the manager
force-fails (``AckTimeout``, a full queue) is left out of every later broadcast until the triggerer
re-creates its trigger, and on a queue broker the siblings' acks settle what it missed meanwhile:
lost for it (measured: the 30-minute production run, docs/production.md). So a member that leaves
by a failure is *away* (:meth:`Cohort.leave` with ``failed=True``): the stream reads nothing until
it is back (:meth:`Cohort.hold_remaining`), at most ``cohort_max_wait`` seconds, and every message
broadcast while it is away counts it in its audience (:meth:`Cohort.away_count`), so the producer
gives such a message back instead of settling it (``SharedStreamProducerBase.advance``); the
producer also stops reading as soon as it sees such a message, before the failed watcher has left
(``FlowGate.shortfall``, _core/flow.py). A member that leaves by cancellation (its Dag paused or
deleted, the triggerer stopping) is not waited for.

Both settings are operator settings (``[shared_stream_provider] cohort_settle`` and
``cohort_max_wait`` in airflow.cfg, or ``AIRFLOW__SHARED_STREAM_PROVIDER__COHORT_SETTLE``), not
per-Dag ones: they describe the triggerer deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from airflow_shared_stream_provider._core.airflow_internals import require_airflow_internals
from airflow_shared_stream_provider._core.state_store import StateStore, read_quietly, write_all
from airflow_shared_stream_provider._core.tasks import wait_for

log = logging.getLogger(__name__)

DEFAULT_COHORT_SETTLE: Final = 3.0
DEFAULT_COHORT_MAX_WAIT: Final = 60.0
CONFIG_SECTION: Final = "shared_stream_provider"


def cohort_limits() -> tuple[float, float]:
    """``(cohort_settle, cohort_max_wait)`` from Airflow config (the provider's own section)."""
    from airflow.configuration import conf

    settle = conf.getfloat(CONFIG_SECTION, "cohort_settle", fallback=DEFAULT_COHORT_SETTLE)
    max_wait = conf.getfloat(CONFIG_SECTION, "cohort_max_wait", fallback=DEFAULT_COHORT_MAX_WAIT)
    return max(0.0, settle), max(0.0, max_wait)


def cohort_record_enabled() -> bool:
    """
    ``[shared_stream_provider] cohort_record`` (default True): keep the cohort record in the
    watchers' asset state stores. The triggerer supervisor's peak RSS measured ~80 MB higher with
    it (attributed, unverified, to the supervisor building Airflow's in-process Execution API for
    the state-store calls); without it the cohort relies on ``cohort_settle`` alone.
    """
    from airflow.configuration import conf

    return conf.getboolean(CONFIG_SECTION, "cohort_record", fallback=True)


def record_key(stream_key: Hashable) -> str:
    """The state-store key of a stream's cohort record (short and stable across processes)."""
    digest = hashlib.sha256(repr(stream_key).encode()).hexdigest()[:16]
    return f"shared-stream-cohort/{digest}"


def stores_of(accessors: Any) -> list[tuple[str, StateStore]]:
    """
    ``(asset name or uri, accessor)`` for every asset a watcher trigger watches.

    ``BaseEventTrigger.asset_state_store`` (Airflow 3.3) is an ``AssetStateStoreAccessors`` the
    triggerer injects; it offers no public listing of its assets, so its two private name/uri maps
    are read (None outside a triggerer, e.g. in unit tests: then the cohort relies on the settle
    time). A watcher calls this as it subscribes, before its group's producer opens the stream, so
    the Airflow internals are checked here first (:mod:`.airflow_internals`): on an Airflow without
    those maps the watcher fails with that check's error instead of running without its cohort.
    """
    if accessors is None:
        return []
    require_airflow_internals()
    found: list[tuple[str, StateStore]] = [(str(name), store) for name, store in accessors._by_name.items()]
    found.extend((str(uri), store) for uri, store in accessors._by_uri.items())
    return sorted(found, key=lambda pair: pair[0])


def identity_of(asset_names: Iterable[str], watcher_spec: Any) -> str:
    """A watcher's identity: its assets and its filter (two identical watchers count twice)."""
    spec = json.dumps(watcher_spec, sort_keys=True, default=str)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return f"{'+'.join(sorted(asset_names)) or '?'}#{digest}"


@dataclass
class _Member:
    identity: str
    stores: list[tuple[str, StateStore]]
    lookup: asyncio.Task[None] | None = None
    record: Counter[str] | None = None  # what its asset's record held when it joined


@dataclass
class Cohort:
    """The watchers of one stream in this process; shared by the producer and the watchers."""

    clock: Callable[[], float] = time.monotonic
    members: dict[int, _Member] = field(default_factory=dict)
    expected: Counter[str] = field(default_factory=Counter)
    last_join: float = 0.0
    formed: bool = False
    recorded: Counter[str] = field(default_factory=Counter)
    # Returning members (module docstring): identities force-failed out of the formed stream and
    # not back yet, how many in all, and until when the stream waits for them.
    away: Counter[str] = field(default_factory=Counter)
    away_total: int = 0
    away_until: float = 0.0
    away_since: float = 0.0
    max_wait: float = DEFAULT_COHORT_MAX_WAIT
    stream: str = "?"
    # Called on every join and leave (the flow gate wakes a producer waiting for credit).
    on_change: Callable[[], None] | None = None
    _changed: asyncio.Event | None = None
    _writer: asyncio.Task[None] | None = None

    # -- watcher side --------------------------------------------------------------------------
    def join(self, token: int, identity: str, stores: list[tuple[str, StateStore]], key: str) -> None:
        """A watcher subscribed (call before its first await); its record is read in the background."""
        member = _Member(identity, stores)
        self.members[token] = member
        self.last_join = self.clock()
        if self.away.get(identity):
            self._returned(identity)
        if stores:
            member.lookup = asyncio.ensure_future(self._read_record(member, key))
        self._signal()
        if self.formed:
            self.schedule_write(key)

    def leave(self, token: int, *, failed: bool = False) -> None:
        """
        A watcher unsubscribed. ``failed``: the manager force-failed it (not cancelled) and its
        stream keeps no watcher positions: it is away until it joins again (module docstring).
        """
        member = self.members.pop(token, None)
        if member is not None and member.lookup is not None and not member.lookup.done():
            member.lookup.cancel()
        if failed and member is not None and self.formed:
            now = self.clock()
            if not self.away_total:
                self.away_since = now
            self.away[member.identity] += 1
            self.away_total += 1
            self.away_until = now + self.max_wait
            log.warning(
                "Shared stream %s reads nothing until watcher %s is back: the triggerer force-failed it, "
                "and what the other watchers settle meanwhile it would never see. Waiting at most %.0f s "
                "(cohort_max_wait).",
                self.stream,
                member.identity,
                self.max_wait,
            )
        self._signal()

    def _returned(self, identity: str) -> None:
        self.away[identity] -= 1
        if self.away[identity] <= 0:
            del self.away[identity]
        self.away_total -= 1
        if not self.away_total:
            log.info(
                "Shared stream %s reads again: watcher %s is back after %.1f s",
                self.stream,
                identity,
                self.clock() - self.away_since,
            )

    def hold_remaining(self) -> float:
        """Seconds the stream still waits for away members (0: it reads); forgets them at the bound."""
        if not self.away_total:
            return 0.0
        remaining = self.away_until - self.clock()
        if remaining > 0:
            return remaining
        log.warning(
            "Shared stream %s reads again without watcher(s) %s after %.0f s: not back within "
            "cohort_max_wait. Messages read from now on are settled without them until they join.",
            self.stream,
            sorted(self.away.elements())[:20],
            self.clock() - self.away_since,
        )
        self.away.clear()
        self.away_total = 0
        return 0.0

    def away_count(self) -> int:
        """Away members a message broadcast now misses (counted in its audience)."""
        return self.away_total if self.away_total and self.hold_remaining() > 0 else 0

    async def _read_record(self, member: _Member, key: str) -> None:
        _, store = member.stores[0]
        record = await read_quietly(store, key, f"the cohort record {key} of {member.identity}")
        if isinstance(record, list):
            wanted = Counter(str(identity) for identity in record)
            member.record = wanted
            self.expected |= wanted  # union with multiplicity: the largest count of each identity wins
        self._signal()

    # -- producer side -------------------------------------------------------------------------
    def present(self) -> Counter[str]:
        return Counter(member.identity for member in self.members.values())

    def missing(self) -> Counter[str]:
        return self.expected - self.present()

    def lookups_pending(self) -> bool:
        return any(m.lookup is not None and not m.lookup.done() for m in self.members.values())

    def ready(self, settle: float) -> bool:
        # No member at all is possible only for a producer driven directly (the manager creates one
        # at a watcher's subscribe): it reads after the settle time like any cohort without record.
        if self.lookups_pending() or self.missing():
            return False
        if self.expected:
            return True  # every member of the last formation is back: no need to wait for more
        return self.clock() - self.last_join >= settle

    async def wait_ready(self, *, settle: float, max_wait: float, stream: str) -> None:
        """Wait until the cohort is complete (see the module docstring), at most ``max_wait`` seconds."""
        started = self.clock()
        self.max_wait, self.stream = max_wait, stream
        self.last_join = max(self.last_join, started) if not self.members else self.last_join
        while not self.ready(settle):
            elapsed = self.clock() - started
            if elapsed >= max_wait:
                missing = sorted(self.missing().elements())
                log.warning(
                    "Shared stream %s starts after %.0f s without %d expected watcher(s) %s: deleted, paused "
                    "or running on another triggerer. The cohort record is rewritten without them.",
                    stream,
                    elapsed,
                    len(missing),
                    missing[:20],
                )
                break
            wait = max_wait - elapsed
            if not self.expected and not self.lookups_pending():
                wait = min(wait, max(0.0, self.last_join + settle - self.clock()))
            await self._wait_change(max(0.01, wait))
        self.formed = True
        log.info(
            "Shared stream %s formed with %d watcher(s) after %.1f s",
            stream,
            len(self.members),
            self.clock() - started,
        )

    def schedule_write(self, key: str) -> None:
        """Write the present members to every member's state store, in the background (grow only)."""
        if self._writer is not None and not self._writer.done():
            return
        self._writer = asyncio.ensure_future(self._write(key))

    async def _write(self, key: str) -> None:
        await asyncio.sleep(0)  # let the joins of this loop turn arrive first
        present = self.present()
        # Grow only, except right after a formation that timed out (those are forgotten then).
        members = present | (self.recorded if self.recorded else Counter())
        record = sorted(members.elements())
        if Counter(record) == self.recorded:
            return
        # Its asset already holds this record (the usual restart): no write.
        writers = [member for member in list(self.members.values()) if member.record != Counter(record)]
        await write_all(
            (store, key, record, f"the cohort record {key} to asset {name}")
            for member in writers
            for name, store in member.stores
        )
        for member in writers:
            member.record = Counter(record)
        self.recorded = Counter(record)

    async def close(self) -> None:
        for task in [self._writer, *(m.lookup for m in self.members.values())]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()
        if self.on_change is not None:
            self.on_change()

    async def _wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self._changed.wait(), timeout)
