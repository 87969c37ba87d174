"""
Redis Streams producer for shared streams: one client and one consumer-group reader per stream.

Receive: ``XREADGROUP GROUP <group> <consumer> COUNT n BLOCK ms STREAMS <stream> >`` (new
entries, ``n`` never more than the watchers' credit), and every ``claim_idle / 4`` seconds, or
right after an entry was given back, ``XAUTOCLAIM`` of the group's entries idle for
``claim_idle`` (a dead consumer's, or ones this stream gave back) before new entries are read.
Each entry becomes one envelope (``message_id`` = the entry id, ``delivery_attempt`` = its
times-delivered in the group's pending entries list, ``published_at`` = the id's millisecond part,
``body`` = the ``body_field`` value, ``attributes`` = every other field) broadcast to every watcher.

Lane: the stream (one lane). Entries are broadcast and acknowledged in stream order; an entry
given back comes again after the entries read since (Redis redelivers pending entries by
``XAUTOCLAIM``, not in the stream's place).

==================  ===============================================================================
outcome             what happens on Redis
==================  ===============================================================================
acked (COMMIT)      ``XACK`` (one call per advance batch): the entry leaves the group's pending
                    entries list. The entry stays in the stream (other groups may read it) until
                    the stream is trimmed.
rejected            ``XADD`` to ``dead_letter_stream`` (the entry's fields in order, a sender's
(DEAD_LETTER)       ``x-dead-letter-*`` fields renamed ``x-original-*``, plus ``x-dead-letter-reason``
                    / ``-source`` / ``-message-id`` / ``-group``), **then** ``XACK``. A failed XADD
                    raises from ``advance``: nothing is acknowledged that was not dead-lettered.
                    Without a dead-letter stream: acknowledged and logged at ERROR with the entry id
                    (the entry stays in the stream until trimmed).
failed (REDELIVER)  the entry's idle time is set to ``claim_idle`` (``XCLAIM ... IDLE``, its delivery
                    count kept): the next ``XAUTOCLAIM`` takes it at once, counting one more delivery.
                    A collateral failure (queued behind the entry a force-failed watcher stood on,
                    ``_core/attempts.py``) sets the count back by one as well (``RETRYCOUNT``): it
                    does not count, even after a restart.
poison              a failed entry whose times-delivered reached ``max_delivery_attempts`` is
                    dead-lettered as above instead of given back again; one failed only as
                    collateral, once delivered ``4 x max_delivery_attempts`` times (counted by this
                    producer since it started).
zero-subscriber     idle time set to ``claim_idle - hold_backoff`` and the delivery count set back by
(HOLD)              one (``RETRYCOUNT``): claimed again after ``hold_backoff``, not counted.
lease lost          the lease of an entry is its idle time: while watchers work on it the lease
                    keeper sets it back to 0 (``XCLAIM ... JUSTID`` of entries this consumer still
                    owns, in one script call per 500) until the ack timeout. An entry another
                    consumer claimed meanwhile is counted in ``leases_lost`` (never taken back
                    from it): it is delivered there too (a duplicate, never a loss).
trimmed / deleted   an entry deleted from the stream (``XDEL``, ``XTRIM``, ``MAXLEN``) while pending
                    has nothing left to deliver: ``XAUTOCLAIM`` drops it from the pending list and
                    names it; counted in ``trimmed`` and logged.
advance raises      the group ends; what was not acknowledged stays pending and is claimed again
                    after ``claim_idle``.
outage              a Redis call that fails transiently (connection, timeout, ``LOADING``, ``BUSY``)
                    is retried by redis-py (3 times, reconnecting), then 1, 2, 4, 8 s apart; the
                    5th failure in a row fails the group with ``BrokerUnavailableError``; the
                    re-created triggers resume once Redis answers.
crash / restart     nothing unacknowledged is lost: a killed triggerer's entries stay pending under
                    its consumer and are claimed after ``claim_idle`` (default 30 s) with their
                    delivery count + 1. A clean stop gives its entries back at once.
==================  ===============================================================================

Consumers: each stream is its own consumer in the group (``airflow-shared-stream:<host>:<pid>:<random>``);
a clean stop deletes it when nothing is pending for it, and opening a stream deletes this
provider's consumers with nothing pending that were idle for an hour (a killed triggerer's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from airflow_shared_stream_provider._core.connections import config_error
from airflow_shared_stream_provider._core.dispositions import Decision, Disposition
from airflow_shared_stream_provider._core.envelope import text_value
from airflow_shared_stream_provider._core.errors import (
    BrokerHandleClosedError,
    BrokerUnavailableError,
    SharedStreamConfigError,
)
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.logsafe import REASON_LOG_LIMIT, log_safe
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.producer import (
    RECEIVE_ERROR_LIMIT,
    UNSENT,
    Decided,
    Delivery,
    SharedStreamProducerBase,
)
from airflow_shared_stream_provider._core.retry import ErrorStreak, chunks
from airflow_shared_stream_provider._core.tasks import best_effort
from airflow_shared_stream_provider.producers.redis_client import (
    CONSUMER_PREFIX,
    DELETE_IDLE_CONSUMER_SCRIPT,
    DELIVERY_COUNTS_SCRIPT,
    REDIS_ERRORS,
    SET_IDLE_SCRIPT,
    STALE_CONSUMER_SECONDS,
    Entry,
    RedisConnection,
    consumer_name,
    dead_letter_fields,
    entries_of,
    error_code,
    is_transient,
    load_redis_connection,
    make_client,
    published_at,
    redis_errors,
    split_fields,
)
from airflow_shared_stream_provider.triggers.redis import RedisStreamSettings

__all__ = ["RedisAdvanceError", "RedisDelivery", "RedisSharedStreamProducer"]

# A connect that fails is retried with the receive loop's waits (receive_backoff, the base's).
_CLOSE_TIMEOUT: Final = 5.0
_SCRIPT_BATCH: Final = 500
"""Entries per lease / give-back script call (each costs the server one XPENDING + XCLAIM)."""


class RedisAdvanceError(RuntimeError):
    """
    A dead-letter ``XADD`` or an ``XACK`` failed: raised from ``advance``, the manager ends the
    group, and what was not acknowledged stays pending and is claimed again after ``claim_idle``.
    """


@dataclass
class RedisCounters(StreamCounters):
    """The shared counters plus what only Redis has."""

    trimmed: int = 0  # pending entries deleted from the stream before they were delivered again


@dataclass(slots=True)
class RedisDelivery(Delivery):
    """What ``advance`` needs of one entry (and what a dead-letter copy re-sends)."""

    entry_id: str
    fields: list[bytes]


class RedisSharedStreamProducer(SharedStreamProducerBase[RedisStreamSettings, RedisDelivery]):
    """One consumer-group reader per stream for every watcher of it; see the module docstring."""

    # Redis's largest value (proto-max-bulk-len): one field of an entry may be that large.
    max_message_bytes = 512 * 1024 * 1024
    # A collateral failure's give-back sets the entry's times-delivered back (XCLAIM RETRYCOUNT),
    # as a HOLD's does: the forgiveness survives a restart of the triggerer.
    forgiveness_is_durable = True
    # A clean stop gives the entries still in flight back at once; tests that simulate a crash turn
    # this off (a killed triggerer gives nothing back).
    release_on_close: ClassVar[bool] = True
    receive_errors = REDIS_ERRORS

    def __init__(self, settings: RedisStreamSettings, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        self.counters: RedisCounters = RedisCounters(self.broker, self.source_label())
        self.consumer = consumer_name()
        self.connection: RedisConnection | None = None
        self._client: Any = None
        self._set_idle: Any = None
        self._delivery_counts: Any = None
        self._delete_consumer: Any = None
        self._body_field = settings.body_field.encode("utf-8", "surrogatepass")
        self._stream = settings.stream.encode("utf-8", "surrogatepass")
        self._claim_idle_ms = int(settings.claim_idle * 1000)
        # Entries broadcast and not yet acknowledged / given back (with their delivery attempt), and
        # their leases (idle time).
        self._unsettled: InFlight[str, int] = InFlight(self.counters)
        self._max_hold = self.ack_timeout + max(5.0, self.ack_timeout / 10)
        # XAUTOCLAIM: when the next pass is due (monotonic) and where an unfinished pass resumes.
        self._claim_interval = max(0.5, settings.claim_idle / 4)
        self._claim_due = 0.0
        self._claim_cursor = b"0-0"
        self._claiming = False  # whether the receive in progress is a claim pass
        self.max_receive = settings.read_count

    # -- identity ------------------------------------------------------------------------------
    def source_label(self) -> str:
        return self.settings.stream

    def _where(self) -> str:
        where = (
            self.connection.describe()
            if self.connection is not None
            else f"redis_conn_id={self.settings.redis_conn_id!r}"
        )
        return f"Redis stream {self.settings.stream!r} (group {self.settings.group!r}; {where})"

    def _config_error(self, cause: str, exc: BaseException | None = None) -> SharedStreamConfigError:
        return config_error(self._where(), cause, exc)

    def _unavailable(self, cause: str, exc: BaseException | None) -> BrokerUnavailableError:
        error = BrokerUnavailableError(
            f"{self._where()}: {cause}; the stream resumes when the trigger is re-created and Redis answers "
            "again (unacknowledged entries are claimed again after claim_idle)"
        )
        error.__cause__ = exc
        return error

    def _explain(self, exc: BaseException) -> Exception:
        """What an error of opening the stream means: a setting, or an unreachable server."""
        if isinstance(exc, redis_errors.AuthenticationError):
            return self._config_error(f"authentication failed ({type(exc).__name__})", exc)
        if is_transient(exc):
            return self._unavailable(f"cannot reach Redis ({type(exc).__name__}: {exc})", exc)
        code = error_code(exc)
        if code == "WRONGTYPE":
            return self._config_error("the key exists and is not a stream", exc)
        if code in ("NOPERM", "NOAUTH", "WRONGPASS"):
            return self._config_error(f"refused by the server's ACL or auth ({exc})", exc)
        return self._config_error(f"{type(exc).__name__}: {exc}", exc)

    # -- connection ----------------------------------------------------------------------------
    async def _connect(self) -> None:
        settings = self.settings
        self.connection = await load_redis_connection(settings.redis_conn_id)
        self._client = client = make_client(self.connection, settings, client_name=self.consumer)
        self._set_idle = client.register_script(SET_IDLE_SCRIPT)
        self._delivery_counts = client.register_script(DELIVERY_COUNTS_SCRIPT)
        self._delete_consumer = client.register_script(DELETE_IDLE_CONSUMER_SCRIPT)
        self.log.info("Redis shared stream connecting to %s as consumer %s", self._where(), self.consumer)
        try:
            await self._ensure_group()
            if settings.dead_letter_stream is not None:
                kind = text_value(await client.type(settings.dead_letter_stream))
                if kind not in ("none", "stream"):
                    raise self._config_error(
                        f"dead_letter_stream {settings.dead_letter_stream!r} exists and is a {kind}, not a stream"
                    )
            await self._delete_stale_consumers()
        except REDIS_ERRORS as exc:
            raise self._explain(exc) from exc

    async def _ensure_group(self) -> None:
        """The consumer group exists afterwards (created with MKSTREAM if allowed), or a config error."""
        settings = self.settings
        client = self._client
        if settings.create_group:
            try:
                await client.xgroup_create(settings.stream, settings.group, id=settings.group_start_id, mkstream=True)
                self.log.info(
                    "Created consumer group %r on Redis stream %r at %s",
                    settings.group,
                    settings.stream,
                    settings.group_start_id,
                )
            except redis_errors.ResponseError as exc:
                if error_code(exc) != "BUSYGROUP":
                    raise
            return
        try:
            groups = await client.execute_command("XINFO", "GROUPS", settings.stream)
        except redis_errors.ResponseError as exc:
            if "no such key" in str(exc).lower():
                raise self._config_error("the stream does not exist and create_group is False", exc) from exc
            raise
        names = {_info(group).get(b"name") for group in groups or ()}
        if settings.group.encode("utf-8", "surrogatepass") not in names:
            raise self._config_error(
                "the consumer group does not exist and create_group is False: create it "
                f"(XGROUP CREATE {settings.stream} {settings.group} 0) or pass create_group=True"
            )

    async def _delete_stale_consumers(self) -> None:
        """Delete this provider's consumers of the group with nothing pending, idle for an hour (killed streams')."""
        settings = self.settings
        consumers = await self._client.execute_command("XINFO", "CONSUMERS", settings.stream, settings.group)
        for consumer in consumers or ():
            info = _info(consumer)
            name = info.get(b"name")
            if not isinstance(name, bytes) or not name.startswith(CONSUMER_PREFIX.encode()):
                continue
            if info.get(b"pending") == 0 and int(info.get(b"idle") or 0) >= STALE_CONSUMER_SECONDS * 1000:
                await self._delete_consumer(
                    keys=[settings.stream], args=[settings.group, name, int(STALE_CONSUMER_SECONDS * 1000)]
                )

    # -- receive (the loop is the base's: these are its hooks) ---------------------------------
    async def _connect_broker(self) -> None:
        await self._connect_with_retries()

    def _receiving(self) -> None:
        settings = self.settings
        self._unsettled.keep_leases(
            LeaseKeeper(
                renew=self._renew,
                lease_seconds=settings.claim_idle,
                renew_margin=max(0.3, settings.claim_idle / 3),
                max_hold=self._max_hold,
                batch_size=_SCRIPT_BATCH,
                name=f"redis-lease-keeper[{settings.stream}]",
            )
        )

    async def _receive(self, count: int) -> list[tuple[Entry, int]]:
        """A claim pass when one is due, else new entries: ``(entry, its delivery count)`` each."""
        self._claiming = time.monotonic() >= self._claim_due
        if self._claiming:
            entries, counts = await self._claim(count)
            return list(zip(entries, counts, strict=True))
        return [(entry, 1) for entry in await self._read(count, self._block_seconds())]

    def _fatal_receive_error(self, exc: BaseException) -> Exception | None:
        return None if is_transient(exc) else self._explain(exc)

    def _receive_outage(self, exc: BaseException, failures: int) -> Exception:
        call = "XAUTOCLAIM" if self._claiming else "XREADGROUP"
        return self._unavailable(f"{call} failed {failures} times in a row ({type(exc).__name__}: {exc})", exc)

    async def _admit(self, received: list[Any]) -> list[Any]:
        if self._claiming and received:
            return await self._skip_in_flight(received)
        return received

    def _to_delivery(
        self, raw: tuple[Entry, int], received: list[Any]
    ) -> tuple[RedisDelivery, dict[str, Any], str | None, object]:
        entry, count = raw
        entry_id = entry.entry_id.decode("ascii", "replace")
        attempt = max(1, count)
        delivery = RedisDelivery(UNSENT, attempt, entry_id, entry.fields)
        self._unsettled.add(entry_id, attempt)
        body, attributes = split_fields(entry.fields, self._body_field)
        envelope, forced = self._envelope(delivery, body, attributes)
        return delivery, envelope, forced, body

    async def _skip_in_flight(self, claimed: list[tuple[Entry, int]]) -> list[tuple[Entry, int]]:
        """
        Claimed entries this stream still has in flight (their lease lapsed: held past the ack
        timeout, the manager about to fail them) are not broadcast again; the claim's delivery count
        is taken back and the lease renewed, so a slow advance does not count as deliveries.
        """
        keep: list[tuple[Entry, int]] = []
        restore: list[tuple[str, int]] = []
        for entry, count in claimed:
            attempt = self._unsettled.get(entry.entry_id.decode("ascii", "replace"))
            if attempt is None:
                keep.append((entry, count))
            else:
                restore.append((entry.entry_id.decode("ascii", "replace"), attempt))
        if restore:
            try:
                await self._set_idle_of(restore, idle_ms=0)
            except REDIS_ERRORS as exc:  # only the count and the lease: the next claim pass tries again
                self.log.warning(
                    "Redis stream %s: could not renew %d lapsed lease(s): %s", self.settings.stream, len(restore), exc
                )
        return keep

    async def _connect_with_retries(self) -> None:
        """Connect and check the group; a server that does not answer is retried like a receive."""
        errors = ErrorStreak(self.receive_backoff, limit=RECEIVE_ERROR_LIMIT)
        while True:
            try:
                await self._connect()
                return
            except BrokerUnavailableError as exc:
                delay = errors.failed()
                if delay is None:
                    raise
                self.log.warning("%s; retrying in %.0f s", exc, delay)
                await self._close_client()
                await asyncio.sleep(delay)

    def _block_seconds(self) -> float:
        """XREADGROUP's wait: ``block``, but never past the next claim pass."""
        until_claim = self._claim_due - time.monotonic()
        return max(0.01, min(self.settings.block, until_claim))

    async def _read(self, count: int, block: float) -> list[Entry]:
        settings = self.settings
        self.counters.add("api_calls")
        reply = await self._client.execute_command(
            "XREADGROUP",
            "GROUP",
            settings.group,
            self.consumer,
            "COUNT",
            count,
            "BLOCK",
            max(1, int(block * 1000)),
            "STREAMS",
            settings.stream,
            ">",
        )
        if not reply:
            return []
        return entries_of(reply[0][1])  # RESP2 (make_client): [[stream, [entries]]]

    async def _claim(self, count: int) -> tuple[list[Entry], list[int]]:
        """
        One ``XAUTOCLAIM`` of entries idle for ``claim_idle`` (from where the last pass stopped) and
        their delivery counts; schedules the next pass when this one reached the end.
        """
        settings = self.settings
        self.counters.add("api_calls")
        reply = await self._client.execute_command(
            "XAUTOCLAIM",
            settings.stream,
            settings.group,
            self.consumer,
            self._claim_idle_ms,
            self._claim_cursor,
            "COUNT",
            count,
        )
        cursor = bytes(reply[0])
        entries = entries_of(reply[1])
        deleted = list(reply[2]) if len(reply) > 2 and reply[2] else []
        if cursor == b"0-0":
            self._claim_due = time.monotonic() + self._claim_interval
        self._claim_cursor = cursor
        if deleted:
            self.counters.add("trimmed", len(deleted))
            self.log.warning(
                "Redis stream %s: %d pending entr%s deleted from the stream before being delivered again "
                "(XDEL / XTRIM / MAXLEN); dropped from the group's pending list: %s",
                settings.stream,
                len(deleted),
                "y was" if len(deleted) == 1 else "ies were",
                log_safe(", ".join(bytes(d).decode("ascii", "replace") for d in deleted[:10])),
            )
        # Entries whose fields are gone (nil) were deleted between the claim and now: nothing to deliver.
        gone = [entry for entry in entries if not entry.fields]
        if gone:
            await self._ack([entry.entry_id.decode("ascii", "replace") for entry in gone])
            self.counters.add("trimmed", len(gone))
            entries = [entry for entry in entries if entry.fields]
        if not entries:
            return [], []
        self.counters.add("api_calls")
        counts = await self._delivery_counts(
            keys=[settings.stream], args=[settings.group, *(entry.entry_id for entry in entries)]
        )
        return entries, [int(count) for count in counts]

    def _envelope(
        self, delivery: RedisDelivery, body: bytes | None, attributes: dict[str, str]
    ) -> tuple[dict[str, Any], str | None]:
        settings = self.settings
        return self.envelope(
            source=settings.stream,
            message_id=delivery.entry_id,
            body=body,
            attributes=attributes,
            published_at=published_at(delivery.entry_id),
            delivery_attempt=delivery.delivery_attempt,
            metadata={"stream": settings.stream, "group": settings.group},
        )

    # -- leases --------------------------------------------------------------------------------
    async def _renew(self, entry_ids: Sequence[str], _lease_seconds: float) -> Sequence[str]:
        """A lease on Redis is the entry's idle time: set it back to 0 for the entries still ours."""
        if self._client is None:
            raise BrokerHandleClosedError(f"Redis client for {self.settings.stream} is closed")
        lost = await self._set_idle_of([(entry_id, -1) for entry_id in entry_ids], idle_ms=0)
        self._unsettled.count_renewals(len(entry_ids) - len(lost), lost)
        if lost:
            self.log.warning(
                "Redis stream %s: %d entr%s no longer pending for this consumer (claimed by another): it may "
                "be delivered there too",
                self.settings.stream,
                len(lost),
                "y is" if len(lost) == 1 else "ies are",
            )
        return lost

    async def _set_idle_of(self, changes: Sequence[tuple[str, int]], *, idle_ms: int) -> list[str]:
        """Set the idle time (and delivery count, unless -1) of entries this consumer owns; return the others."""
        settings = self.settings
        lost: list[str] = []
        for chunk in chunks(changes, _SCRIPT_BATCH):
            args: list[Any] = [settings.group, self.consumer, idle_ms]
            for entry_id, retry_count in chunk:
                args += (entry_id, retry_count)
            self.counters.add("api_calls")
            refused = await self._set_idle(keys=[settings.stream], args=args)
            lost.extend(bytes(entry_id).decode("ascii", "replace") for entry_id in refused or ())
        return lost

    # -- advance -------------------------------------------------------------------------------
    async def _apply(self, decided: Sequence[Decided[RedisDelivery]]) -> Sequence[Decided[RedisDelivery]] | None:
        if self._client is None:
            raise BrokerHandleClosedError(
                f"advance called after the Redis client for {self.settings.stream} was closed; not advanced"
            )
        acks: list[str] = []
        dead: list[Decided[RedisDelivery]] = []
        give_back: list[tuple[str, int]] = []
        hold: list[tuple[str, int]] = []
        for entry in decided:
            delivery = entry.delivery
            disposition = entry.disposition
            if disposition is Disposition.COMMIT:
                acks.append(delivery.entry_id)
            elif disposition is Disposition.DEAD_LETTER:
                dead.append(entry)
            elif disposition is Disposition.REDELIVER:
                # A forgiven (collateral) failure sets the times-delivered back: durable forgiveness.
                give_back.append((delivery.entry_id, delivery.delivery_attempt - 1 if entry.forgiven else -1))
            else:  # HOLD: claimed again after hold_backoff, the delivery count set back by one
                hold.append((delivery.entry_id, delivery.delivery_attempt - 1))
        if dead:
            acks += await self._dead_letter(dead)
        if acks:
            await self._ack(acks)
        # Forgotten before the give-back call: the claim pass that may take them back right after
        # must not find them in flight here (it would skip them as in flight). A lease a renewal
        # already found lost is counted once (there), not again by the give-back.
        counted = {e.delivery.entry_id for e in decided if self._unsettled.lost_at_renewal(e.delivery.entry_id)}
        for entry in decided:
            self._unsettled.settled(entry.delivery.entry_id)
        lost: set[str] = set()
        if give_back or hold:
            lost = await self._give_back(give_back, hold, counted=counted)
        if not lost:
            return None
        # Given back after another consumer claimed them: delivered there (counted as redelivered).
        return [
            Decided(entry.delivery, Decision(Disposition.REDELIVER, "claimed by another consumer before the give-back"))
            if entry.delivery.entry_id in lost
            else entry
            for entry in decided
        ]

    async def _ack(self, entry_ids: Sequence[str]) -> None:
        self.counters.add("api_calls")
        try:
            await self._client.xack(self.settings.stream, self.settings.group, *entry_ids)
        except REDIS_ERRORS as exc:
            raise RedisAdvanceError(
                f"{self._where()}: XACK of {len(entry_ids)} entr{'y' if len(entry_ids) == 1 else 'ies'} failed "
                f"({type(exc).__name__}: {exc}); they stay pending and are claimed again after claim_idle"
            ) from exc

    async def _give_back(
        self, give_back: Sequence[tuple[str, int]], hold: Sequence[tuple[str, int]], *, counted: set[str]
    ) -> set[str]:
        """REDELIVER (claimable at once) and HOLD (after hold_backoff); best-effort: a failure only delays them."""
        settings = self.settings
        lost: set[str] = set()
        try:
            if give_back:
                lost.update(await self._set_idle_of(give_back, idle_ms=self._claim_idle_ms))
            if hold:
                idle = max(0, self._claim_idle_ms - int(settings.hold_backoff * 1000))
                lost.update(await self._set_idle_of(hold, idle_ms=idle))
        except REDIS_ERRORS as exc:
            self.log.warning(
                "Redis stream %s: could not give %d entr%s back (%s); they are claimed again after claim_idle",
                settings.stream,
                len(give_back) + len(hold),
                "y" if len(give_back) + len(hold) == 1 else "ies",
                exc,
            )
        # The next claim pass takes them (a held entry only once hold_backoff has passed).
        due = time.monotonic() + (0.0 if give_back else settings.hold_backoff)
        self._claim_due = min(self._claim_due, due)
        self._claim_cursor = b"0-0"
        self.counters.add("leases_lost", len(lost - counted))
        return lost

    async def _dead_letter(self, entries: Sequence[Decided[RedisDelivery]]) -> list[str]:
        """DEAD_LETTER: XADD each to the dead-letter stream (all must succeed); the ids to acknowledge."""
        settings = self.settings
        dlq = settings.dead_letter_stream
        if dlq is None:
            for entry in entries:
                self.log.error(
                    "Redis entry %s of stream %s acknowledged without a copy (no dead_letter_stream): %s; it stays "
                    "in the stream until trimmed",
                    entry.delivery.entry_id,
                    settings.stream,
                    log_safe(entry.decision.reason, REASON_LOG_LIMIT),
                )
            return [entry.delivery.entry_id for entry in entries]
        trim: list[Any] = ["MAXLEN", "~", settings.dead_letter_maxlen] if settings.dead_letter_maxlen else []
        pipe = self._client.pipeline(transaction=False)
        for entry in entries:
            fields = dead_letter_fields(
                entry.delivery.fields,
                reason=entry.decision.reason,
                source=settings.stream,
                entry_id=entry.delivery.entry_id,
                group=settings.group,
            )
            pipe.execute_command("XADD", dlq, *trim, "*", *fields)
        self.counters.add("api_calls")
        try:
            results = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            results = [exc]
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            raise RedisAdvanceError(
                f"{self._where()}: XADD to dead_letter_stream {dlq!r} failed ({describe(failures[0])}); "
                f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} not acknowledged"
            ) from failures[0]
        self.log.info(
            "Redis dead-lettered %d entr%s from %s to %s",
            len(entries),
            "y" if len(entries) == 1 else "ies",
            settings.stream,
            dlq,
        )
        return [entry.delivery.entry_id for entry in entries]

    # -- close ---------------------------------------------------------------------------------
    async def _close(self) -> None:
        try:
            await self._unsettled.stop()
            entry_ids = list(self._unsettled.drain())
            if self._client is not None and self.release_on_close:
                if entry_ids:
                    await best_effort(
                        self._set_idle_of([(entry_id, -1) for entry_id in entry_ids], idle_ms=self._claim_idle_ms),
                        self.log,
                        "Could not give %d in-flight Redis entr(ies) back on close; they are claimed again after "
                        "claim_idle",
                        len(entry_ids),
                        timeout=_CLOSE_TIMEOUT,
                    )
                else:
                    # Nothing pending for this consumer: leave no consumer behind in the group.
                    await best_effort(
                        self._delete_consumer(
                            keys=[self.settings.stream], args=[self.settings.group, self.consumer, 0]
                        ),
                        self.log,
                        "Could not delete consumer %s of group %s",
                        self.consumer,
                        self.settings.group,
                        timeout=_CLOSE_TIMEOUT,
                    )
        finally:
            await self._close_client()

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await best_effort(
                client.aclose(),
                self.log,
                "error closing the Redis client of %s",
                self.settings.stream,
                timeout=_CLOSE_TIMEOUT,
            )


def _info(item: Any) -> dict[bytes, Any]:
    """An ``XINFO`` record (a flat RESP2 list, or a RESP3 map) as a dict."""
    if isinstance(item, dict):
        return {bytes(k) if isinstance(k, bytes | bytearray) else str(k).encode(): v for k, v in item.items()}
    return {bytes(item[i]): item[i + 1] for i in range(0, len(item) - 1, 2)}


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
