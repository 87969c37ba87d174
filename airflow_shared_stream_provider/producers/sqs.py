"""
SQS producer for shared streams: one aiobotocore client and one long-polling receive loop per queue.

Receive: ``ReceiveMessage`` with ``WaitTimeSeconds`` (long polling), up to 10 messages a call and
never more than the watchers' credit, every system and message attribute; ``concurrent_receives``
calls may be in flight at once. Each message becomes one envelope (``message_id`` = SQS
MessageId, ``delivery_attempt`` = ApproximateReceiveCount less the times it was only held,
``published_at`` = SentTimestamp, ``attributes`` = message attributes) broadcast to every watcher.

Lanes:

* **FIFO queues**: the MessageGroupId. Order is kept per group and groups never wait for one
  another, which matters because SQS hands out no further message of a group while one of its
  messages is in flight: a group stalled behind a slow watcher must not keep another group's
  messages from being deleted.
* **Standard queues**: the receive call the message came from (at most 10 messages). Not one lane
  per message, on purpose: the manager awaits one ``advance`` at a time, so one-message lanes mean
  one ``DeleteMessageBatch`` call per message (5x the 0.2 calls/message budget), or deleting after
  ``advance`` has returned, which would report a delete as done before it is. With the receive
  call as the lane, the messages that arrived together are deleted together, and a slow message
  holds back at most the 9 others of its call (their leases are kept, so SQS does not redeliver
  them). Persistence rounds often resolve a call's messages in two or three prefixes, so the
  deletes of a prefix are held back (still leased) until the call's last message is advanced and
  then sent as one batch; a clean close sends what is still held back. Standard queues have no
  ordering to keep.

==================  ===============================================================================
outcome             what happens on SQS
==================  ===============================================================================
acked (COMMIT)      ``DeleteMessageBatch``. Entries that fail on the server side are retried (3
                    attempts, backoff); if they still fail, ``advance`` raises, the manager ends the
                    group and the message comes back after its visibility timeout: a failed delete
                    is never counted as committed. An entry whose receipt handle is no longer valid
                    (lease lost, see below) is counted as redelivered, not committed.
rejected            ``SendMessageBatch`` to ``dlq_queue_url`` (original body and message attributes,
(DEAD_LETTER)       plus ``x-dead-letter-reason`` / ``-source`` / ``-message-id`` while SQS's 10-
                    attribute limit allows; a sender's own ``x-dead-letter-*`` are renamed
                    ``x-original-*``), retried like deletes, **then** deleted. Without a DLQ:
                    never deleted (never lost): the message is made invisible for ``reject_backoff``
                    seconds and logged; a RedrivePolicy on the queue then moves it to the queue's
                    own DLQ after its ``maxReceiveCount``.
failed (REDELIVER)  ``ChangeMessageVisibilityBatch`` to 0: delivered again promptly.
poison              a failed message whose ApproximateReceiveCount reached ``max_delivery_attempts``
                    is dead-lettered as above instead of redelivered again.
zero-subscriber     visibility set to ``hold_backoff`` seconds (default 1); the hold is not counted
(HOLD)              as a delivery attempt.
FIFO order          after a message of a group is redelivered or held, the messages of that group
                    received with it are released too (not deleted), so the group is read again in
                    order, as Kafka's seek back does. Watchers see those again (dedup on
                    ``message_id``).
lease lost          the lease keeper extends the visibility of every message watchers still work on
                    (``ChangeMessageVisibilityBatch``, 10 per call) until the ack timeout. If SQS
                    refuses an extension (the message already became visible), it is counted in
                    ``leases_lost``: SQS may deliver it again, so watchers may see it twice.
advance raises      the group ends; undeleted messages come back after their visibility timeout.
outage              a receive that fails transiently (network, throttling) is retried 1, 2, 4, 8 s
                    apart; the 5th failure in a row fails the group with ``BrokerUnavailableError``
                    (not a configuration error); the re-created triggers resume once SQS answers.
crash / restart     nothing undeleted is lost: messages come back after ``visibility_timeout``
                    (default 30 s) with ApproximateReceiveCount + 1. A clean stop releases the
                    messages still in flight at once (visibility 0).
==================  ===============================================================================

Binary bodies: SQS bodies are text. Publish bytes as base64 with the message attribute
``content-transfer-encoding: base64``; the producer decodes them, so the envelope carries JSON,
text, or base64 with ``body_encoding="base64"`` for bytes that are not UTF-8. Dead-lettering always
re-sends the body exactly as received.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from airflow_shared_stream_provider._core.attempts import MessageCounts
from airflow_shared_stream_provider._core.dead_letter import dead_letter_fields, disown_dead_letter_names, xml_text
from airflow_shared_stream_provider._core.dispositions import Decision, Disposition
from airflow_shared_stream_provider._core.errors import BrokerHandleClosedError
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.logsafe import REASON_LOG_LIMIT, log_safe
from airflow_shared_stream_provider._core.producer import (
    UNSENT,
    Decided,
    Delivery,
    Received,
    SharedStreamProducerBase,
)
from airflow_shared_stream_provider._core.retry import chunks
from airflow_shared_stream_provider._core.tasks import best_effort
from airflow_shared_stream_provider.producers.sqs_client import (
    AWS_ERRORS,
    LEASE_GONE_CODES,
    MAX_ATTRIBUTE_NAME,
    SQS_BATCH,
    SqsAdvanceError,
    SqsApi,
    envelope_fields,
    is_transient,
    send_entry,
)
from airflow_shared_stream_provider.triggers.sqs import SqsStreamSettings

# SqsAdvanceError lives with the batch calls in sqs_client; it stays importable from here.
__all__ = ["SqsAdvanceError", "SqsDelivery", "SqsSharedStreamProducer"]

_CLOSE_RELEASE_TIMEOUT: Final = 5.0
_HOLD_MEMORY: Final = 10_000
_FIFO_RELEASE: Final = Decision(Disposition.REDELIVER, "released to keep FIFO order behind a redelivered message")


@dataclass(slots=True)
class SqsDelivery(Delivery):
    """What ``advance`` needs of one SQS message (and what a DLQ send re-sends)."""

    receipt_handle: str
    message_id: str
    body: str
    message_attributes: dict[str, Any]
    group_id: str | None
    receive_call: int


class SqsSharedStreamProducer(SharedStreamProducerBase[SqsStreamSettings, SqsDelivery]):
    """One receive loop per queue for every watcher of the stream; see the module docstring."""

    receive_errors = AWS_ERRORS

    max_message_bytes = 1024 * 1024  # since 2025; 256 KiB before
    # A clean stop makes the messages still in flight visible again at once; tests that simulate
    # a crash turn this off (a killed triggerer releases nothing).
    release_on_close: ClassVar[bool] = True

    def __init__(self, settings: SqsStreamSettings, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        self._fifo = settings.fifo
        self._dlq_fifo = False
        self._client: Any = None
        self._api = SqsApi(settings, self.counters, self.log)
        # Receipt handles handed to watchers and not yet deleted / released, and their leases.
        self._unsettled: InFlight[str, None] = InFlight(self.counters)
        self._leases: LeaseKeeper[str] | None = None
        self._receive_calls = itertools.count(1)
        # The base's receive loop: up to 10 messages a call, concurrent_receives calls in flight.
        self.max_receive = SQS_BATCH
        self.concurrent_receives = settings.concurrent_receives
        # FIFO: group -> the receive call whose messages must not be deleted past a released one.
        self._fences: dict[str, int] = {}
        # FIFO: group -> its messages received and not yet advanced (a whole receive call is counted
        # before the first of its messages is yielded). A fence is dropped with its group's last
        # message in flight, so fences are bounded by what is in flight, not by how many groups
        # senders ever used.
        self._group_in_flight: Counter[str] = Counter()
        # MessageId -> times it was held (broadcast to nobody): not delivery attempts.
        self._holds: MessageCounts[str] = MessageCounts(_HOLD_MEMORY)
        # Standard queues: receive call -> messages not advanced yet, and the deletes held back until
        # the whole call is advanced (one DeleteMessageBatch per receive call).
        self._call_left: dict[int, int] = {}
        self._deferred: dict[int, list[SqsDelivery]] = {}
        self._max_hold = self.ack_timeout + max(5.0, self.ack_timeout / 10)

    # -- identity ------------------------------------------------------------------------------
    def source_label(self) -> str:
        return self.settings.queue_url

    def lane_of(self, broker_payload: SqsDelivery) -> Hashable:
        if self._fifo:
            return ("group", broker_payload.group_id)
        return ("receive", broker_payload.receive_call)

    def batch_lane_of(self, broker_payload: SqsDelivery) -> Hashable:
        """Batch mode: one batch lane per FIFO message group; a standard queue's messages share one."""
        return ("group", broker_payload.group_id) if self._fifo else None

    # -- receive (the loop is the base's: these are its hooks) ---------------------------------
    async def _connect(self) -> Any:
        return await self._api.connect()

    async def _connect_broker(self) -> None:
        self._client = await self._connect()
        self._dlq_fifo = await self._api.check_queues(self._client, fifo=self._fifo)

    def _receiving(self) -> None:
        settings = self.settings
        visibility = settings.visibility_timeout
        self._leases = self._unsettled.keep_leases(
            LeaseKeeper(
                renew=self._renew,
                lease_seconds=visibility,
                renew_margin=max(0.3, visibility / 3),
                max_hold=self._max_hold,
                batch_size=SQS_BATCH,
                name=f"sqs-lease-keeper[{settings.queue_name}]",
            )
        )

    async def _receive(self, count: int) -> Received:
        started, messages = await self._api.receive(self._client, count)
        return Received(messages, started=started)

    def _fatal_receive_error(self, exc: BaseException) -> Exception | None:
        if is_transient(exc):
            return None
        return self._api.config_error(self._receive_cause(exc), exc)

    def _receive_outage(self, exc: BaseException, failures: int) -> Exception:
        # A broker outage that outlasted the error streak: transient, not a setting.
        return self._api.unavailable_error(f"{self._receive_cause(exc)}; {failures} failures in a row", exc)

    def _receive_cause(self, exc: BaseException) -> str:
        return f"ReceiveMessage failed: {self._api.explain(exc, self.settings.queue_url)}"

    async def _admit(self, received: list[Any]) -> list[Any]:
        """A receive call's number (its lane on a standard queue) and what it brought per group / call."""
        if not received:
            return received
        assert isinstance(received, Received)
        received.number = call = next(self._receive_calls)
        if self._fifo:
            self._group_in_flight.update((raw.get("Attributes") or {}).get("MessageGroupId") or "" for raw in received)
        else:
            self._call_left[call] = len(received)
        return received

    def _to_delivery(
        self, raw: dict[str, Any], received: list[Any]
    ) -> tuple[SqsDelivery, dict[str, Any], str | None, object]:
        assert isinstance(received, Received)
        delivery = self._delivery(raw, received.number)
        self._unsettled.add(
            delivery.receipt_handle, None, lease_expires_at=received.started + self.settings.visibility_timeout
        )
        envelope, forced = self._envelope(raw, delivery)
        return delivery, envelope, forced, delivery.body

    def _delivery(self, raw: dict[str, Any], call: int) -> SqsDelivery:
        attributes = raw.get("Attributes") or {}
        message_id = str(raw["MessageId"])
        attempt = int(attributes.get("ApproximateReceiveCount", "1"))
        held = self._holds.get(message_id)
        if held:
            attempt = max(1, attempt - held)
        return SqsDelivery(
            UNSENT,
            attempt,
            str(raw["ReceiptHandle"]),
            message_id,
            str(raw.get("Body", "")),
            dict(raw.get("MessageAttributes") or {}),
            attributes.get("MessageGroupId"),
            call,
        )

    def _envelope(self, raw: dict[str, Any], delivery: SqsDelivery) -> tuple[dict[str, Any], str | None]:
        fields = envelope_fields(
            raw,
            queue_url=self.settings.queue_url,
            message_id=delivery.message_id,
            body=delivery.body,
            message_attributes=delivery.message_attributes,
            group_id=delivery.group_id,
        )
        return self.envelope(**fields, delivery_attempt=delivery.delivery_attempt)

    # -- leases --------------------------------------------------------------------------------
    async def _renew(self, handles: Sequence[str], lease_seconds: float) -> Sequence[str]:
        """A lease on SQS is the visibility timeout: extend it (10 per ChangeMessageVisibilityBatch)."""
        if self._client is None:
            raise BrokerHandleClosedError(f"SQS client for {self.settings.queue_url} is closed")
        failed = await self._change_visibility([(handle, int(lease_seconds)) for handle in handles], purpose="extend")
        self._unsettled.count_renewals(len(handles) - len(failed), failed)
        if failed:
            self.log.warning(
                "SQS refused to extend the visibility of %d message(s) on %s: SQS may deliver them again",
                len(failed),
                self.settings.queue_url,
            )
        return failed

    # -- advance -------------------------------------------------------------------------------
    async def _apply(self, decided: Sequence[Decided[SqsDelivery]]) -> Sequence[Decided[SqsDelivery]]:
        if self._client is None:
            raise BrokerHandleClosedError(
                f"advance called after the SQS client for {self.settings.queue_url} was closed; not advanced"
            )
        entries = list(decided)
        if self._fifo:
            entries = self._fence(entries)
        deletes: list[SqsDelivery] = []
        dead: list[Decided[SqsDelivery]] = []
        visibility: list[tuple[Decided[SqsDelivery], int]] = []
        for entry in entries:
            disposition = entry.disposition
            if disposition is Disposition.COMMIT:
                deletes.append(entry.delivery)
            elif disposition is Disposition.DEAD_LETTER:
                if self.settings.dlq_queue_url is None:
                    self.log.warning(
                        "SQS message %s on %s not dead-lettered (no dlq_queue_url): %s; kept, invisible for %s s",
                        log_safe(entry.delivery.message_id),
                        self.settings.queue_url,
                        log_safe(entry.decision.reason, REASON_LOG_LIMIT),
                        self.settings.reject_backoff,
                    )
                    visibility.append((entry, self.settings.reject_backoff))
                else:
                    dead.append(entry)
            elif disposition is Disposition.REDELIVER:
                visibility.append((entry, 0))
            else:
                self._holds.increment(entry.delivery.message_id)
                visibility.append((entry, self.settings.hold_backoff))
        lost: set[str] = set()
        if dead:
            await self._dead_letter(dead)
            deletes.extend(entry.delivery for entry in dead)
        if not self._fifo:
            # One lane is one receive call; a batch (batch mode) may hold messages of several.
            advanced_per_call = Counter(entry.delivery.receive_call for entry in entries)
            deletes_per_call: dict[int, list[SqsDelivery]] = {}
            for delivery in deletes:
                deletes_per_call.setdefault(delivery.receive_call, []).append(delivery)
            deletes = [
                delivery
                for call, advanced in advanced_per_call.items()
                for delivery in self._coalesce(call, advanced, deletes_per_call.get(call, []))
            ]
        if deletes:
            lost = await self._delete(deletes)
        if visibility:
            await self._release(visibility)
        for handle in [d.receipt_handle for d in deletes] + [e.delivery.receipt_handle for e, _ in visibility]:
            self._unsettled.settled(handle)
        for entry in entries:
            if entry.disposition is Disposition.COMMIT:
                self._holds.forget(entry.delivery.message_id)
        earlier = len(lost - {entry.delivery.receipt_handle for entry in entries})
        if earlier:
            # Held-back deletes an earlier advance already counted as committed: correct the tally.
            self.counters.committed -= earlier
            self.counters.add("redelivered", earlier)
        if lost:
            # Deletes refused for a lost lease: SQS delivers those again; count them as such.
            entries = [
                Decided(entry.delivery, Decision(Disposition.REDELIVER, "lease lost before the delete"))
                if entry.delivery.receipt_handle in lost
                else entry
                for entry in entries
            ]
        # What was done (FIFO releases, lost leases), not what was asked: the base class counts this.
        return entries

    def _coalesce(self, call: int, advanced: int, deletes: list[SqsDelivery]) -> list[SqsDelivery]:
        """
        Standard queues: delete a receive call's messages together, once all of them are advanced.

        A lane is one receive call, but persistence rounds often resolve its messages in two or
        three prefixes; deleting each prefix would double the delete calls. Deletes of a prefix are
        held back (the messages stay leased) until the call's last message is advanced, then sent in
        one batch; a clean close sends what is still held back.
        """
        left = self._call_left.get(call, 0) - advanced
        if left > 0:
            self._call_left[call] = left
            if deletes:
                self._deferred.setdefault(call, []).extend(deletes)
            return []
        self._call_left.pop(call, None)
        return self._deferred.pop(call, []) + deletes

    def _fence(self, entries: list[Decided[SqsDelivery]]) -> list[Decided[SqsDelivery]]:
        """FIFO: nothing of a group received with a released message is deleted past it."""
        out: list[Decided[SqsDelivery]] = []
        for entry in entries:
            delivery = entry.delivery
            group = delivery.group_id or ""
            fence = self._fences.get(group)
            kept = entry
            if fence is not None:
                if delivery.receive_call <= fence:
                    if entry.disposition in (Disposition.COMMIT, Disposition.DEAD_LETTER):
                        kept = Decided(delivery, _FIFO_RELEASE)
                else:
                    del self._fences[group]
            if kept.disposition in (Disposition.REDELIVER, Disposition.HOLD):
                self._fences[group] = delivery.receive_call
            left = self._group_in_flight[group] - 1
            if left > 0:
                self._group_in_flight[group] = left
            else:
                # Nothing of the group received so far is in flight: the fence has nothing left to
                # hold back, and the group's next message comes from a later call, which passes it.
                del self._group_in_flight[group]
                self._fences.pop(group, None)
            out.append(kept)
        return out

    async def _delete(self, deliveries: Sequence[SqsDelivery]) -> set[str]:
        """COMMIT: delete in batches of 10; return the receipt handles whose lease was gone (not deleted)."""
        lost: set[str] = set()
        queue_url = self.settings.queue_url
        for chunk in chunks(deliveries, SQS_BATCH):
            entries = [{"ReceiptHandle": delivery.receipt_handle} for delivery in chunk]
            faults = await self._api.batch("DeleteMessageBatch", self._client.delete_message_batch, queue_url, entries)
            for index, failure in faults.items():
                delivery = chunk[index]
                if failure.get("Code") in LEASE_GONE_CODES:
                    lost.add(delivery.receipt_handle)
                    continue
                raise SqsAdvanceError(
                    f"SQS DeleteMessageBatch on {queue_url} refused message {delivery.message_id}: "
                    f"{failure.get('Code')}: {failure.get('Message')}"
                )
        if lost:
            self.counters.add("leases_lost", len(lost))
            self.log.warning(
                "SQS refused to delete %d message(s) on %s: their lease was lost, SQS delivers them again",
                len(lost),
                queue_url,
            )
        return lost

    async def _release(self, entries: Sequence[tuple[Decided[SqsDelivery], int]]) -> None:
        """REDELIVER / HOLD: set visibility (0 = now). Best-effort: a failed release only delays redelivery."""
        try:
            await self._change_visibility(
                [(entry.delivery.receipt_handle, seconds) for entry, seconds in entries], purpose="release"
            )
        except SqsAdvanceError as exc:
            self.log.warning("%s; the messages come back when their visibility timeout ends", exc)

    async def _change_visibility(self, changes: Sequence[tuple[str, int]], *, purpose: str) -> list[str]:
        """ChangeMessageVisibilityBatch in chunks of 10; return the handles SQS refused as not in flight."""
        refused: list[str] = []
        for chunk in chunks(changes, SQS_BATCH):
            entries = [{"ReceiptHandle": handle, "VisibilityTimeout": seconds} for handle, seconds in chunk]
            faults = await self._api.batch(
                f"ChangeMessageVisibilityBatch ({purpose})",
                self._client.change_message_visibility_batch,
                self.settings.queue_url,
                entries,
            )
            refused.extend(chunk[index][0] for index in faults)
        return refused

    async def _dead_letter(self, entries: Sequence[Decided[SqsDelivery]]) -> None:
        """DEAD_LETTER: send to the DLQ (all must succeed before any of them is deleted)."""
        dlq_url = self.settings.dlq_queue_url
        assert dlq_url is not None
        for chunk in chunks(entries, SQS_BATCH):
            records = [self._dead_letter_record(entry) for entry in chunk]
            faults = await self._api.batch(
                "SendMessageBatch (dead letter)", self._client.send_message_batch, dlq_url, records
            )
            if faults:
                index, failure = next(iter(faults.items()))
                raise SqsAdvanceError(
                    f"SQS refused to dead-letter message {chunk[index].delivery.message_id} to {dlq_url}: "
                    f"{failure.get('Code')}: {failure.get('Message')}; not deleted"
                )
        self.log.info("SQS dead-lettered %d message(s) from %s to %s", len(entries), self.settings.queue_url, dlq_url)

    def _dead_letter_record(self, entry: Decided[SqsDelivery]) -> dict[str, Any]:
        """
        The original body and message attributes (a sender's ``x-dead-letter-*`` renamed
        ``x-original-*``), plus the producer's ``x-dead-letter-*`` while SQS's 10-attribute limit allows.
        """
        delivery = entry.delivery
        fields = dead_letter_fields(
            reason=xml_text(entry.decision.reason[:1024]),
            source=self.settings.queue_url,
            message_id=xml_text(delivery.message_id),
        )
        # The sender's own x-dead-letter-* attributes are renamed x-original-*: on the DLQ copy
        # those names are only ever the producer's (see _core/dead_letter.py).
        return send_entry(
            delivery.body,
            disown_dead_letter_names(delivery.message_attributes, max_name_bytes=MAX_ATTRIBUTE_NAME),
            fields,
            group_id=(delivery.group_id or "dead-letter") if self._dlq_fifo else None,
            deduplication_id=delivery.message_id,
        )

    # -- close ---------------------------------------------------------------------------------
    async def _close(self) -> None:
        try:
            await self._end_receives()
            await self._unsettled.stop()
            held_back = [delivery for deliveries in self._deferred.values() for delivery in deliveries]
            self._deferred.clear()
            releasing = self._client is not None and self.release_on_close
            # Accepted by every watcher, delete held back for the rest of its receive call.
            if held_back and releasing:
                deleted = await best_effort(
                    self._delete(held_back),
                    self.log,
                    "Could not delete %d accepted SQS message(s) on close; SQS delivers them again",
                    len(held_back),
                    timeout=_CLOSE_RELEASE_TIMEOUT,
                )
                if deleted:
                    for delivery in held_back:
                        self._unsettled.settled(delivery.receipt_handle)
            handles = list(self._unsettled.drain())
            if handles and releasing:
                await best_effort(
                    self._change_visibility([(handle, 0) for handle in handles], purpose="release on close"),
                    self.log,
                    "Could not release %d in-flight SQS message(s) on close; they come back after their "
                    "visibility timeout",
                    len(handles),
                    timeout=_CLOSE_RELEASE_TIMEOUT,
                )
        finally:
            self._client = None
            await self._api.aclose()
