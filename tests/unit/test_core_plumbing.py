"""
The broker-neutral plumbing the SQS, Pub/Sub and Service Bus producers share (``_core``): retries,
the in-flight bookkeeping of leases, per-message counts, dead-letter fields, the ack buffer, the
stop helpers and the connection readers. No broker, no sleeps: waits are recorded, not slept.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider._core.attempts import MessageCounts
from airflow_shared_stream_provider._core.connections import config_error
from airflow_shared_stream_provider._core.dead_letter import add_within_limit, dead_letter_fields
from airflow_shared_stream_provider._core.inflight import InFlight
from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.retry import (
    Backoff,
    ErrorStreak,
    Retry,
    chunks,
    retry_call,
    retry_entries,
)
from airflow_shared_stream_provider._core.tasks import best_effort, cancel_and_wait, close_quietly, first_of
from airflow_shared_stream_provider.producers.aws_connection import (
    AWS_THROTTLE_CODES,
    AwsConnection,
    aws_config_kwargs,
    aws_error_cause,
    load_aws_connection,
)
from airflow_shared_stream_provider.producers.pubsub_ack_buffer import AckBuffer
from airflow_shared_stream_provider.producers.pubsub_connection import prefixed_extra
from devkit.runner import settle

LOG = logging.getLogger(__name__)


class Sleeps:
    """A stand-in for ``asyncio.sleep`` that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


# -- retry -------------------------------------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap_and_a_streak_gives_up_at_its_limit() -> None:
    assert [Backoff(0.2).delay(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
    assert [Backoff(1.0, cap=16.0).delay(n) for n in (1, 5, 6, 9)] == [1.0, 16.0, 16.0, 16.0]
    streak = ErrorStreak(Backoff(1.0), limit=3)
    assert [streak.failed(), streak.failed(), streak.failed()] == [1.0, 2.0, None]
    streak.reset()
    assert streak.failed() == 1.0
    endless = ErrorStreak(Backoff(0.1, cap=10.0))
    assert [endless.failed() for _ in range(9)][-1] == 10.0


async def test_retry_entries_resends_only_what_a_retry_may_fix() -> None:
    sent: list[list[str]] = []
    answers: list[Retry[str]] = [(["b", "c"], "b, c throttled"), (["c"], "c throttled"), ([], "")]

    async def send(pending: list[str]) -> Retry[str]:
        sent.append(pending)
        return answers.pop(0)

    sleeps = Sleeps()
    assert await retry_entries(["a", "b", "c"], send, attempts=3, backoff=Backoff(0.2), sleep=sleeps) == (
        [],
        "c throttled",
    )
    assert sent == [["a", "b", "c"], ["b", "c"], ["c"]]
    assert sleeps.delays == [0.2, 0.4]


async def test_retry_entries_hands_back_what_still_fails_after_the_last_attempt() -> None:
    calls = 0

    async def send(pending: list[int]) -> Retry[int]:
        nonlocal calls
        calls += 1
        return pending, f"still down ({calls})"

    sleeps = Sleeps()
    assert await retry_entries([1, 2], send, attempts=3, backoff=Backoff(0.1), sleep=sleeps) == (
        [1, 2],
        "still down (3)",
    )
    assert calls == 3 and len(sleeps.delays) == 2  # no wait after the last attempt
    assert await retry_entries([], send, attempts=3, backoff=Backoff(0.1), sleep=sleeps) == ([], "")
    assert calls == 3  # nothing to send: no call


async def test_retry_call_retries_only_retriable_errors_and_raises_the_last() -> None:
    outcomes: list[BaseException | None] = [TimeoutError("slow"), TimeoutError("slow"), None]
    sleeps = Sleeps()

    async def call() -> str:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return "ok"

    def retriable(exc: BaseException) -> bool:
        return isinstance(exc, TimeoutError)

    assert await retry_call(call, attempts=3, backoff=Backoff(0.2), retriable=retriable, sleep=sleeps) == "ok"
    assert sleeps.delays == [0.2, 0.4]
    outcomes[:] = [TimeoutError("slow")] * 5
    with pytest.raises(TimeoutError):
        await retry_call(call, attempts=2, backoff=Backoff(0.2), retriable=retriable, sleep=sleeps)
    assert len(outcomes) == 3  # two attempts, then the error
    outcomes[:] = [PermissionError("denied"), None]
    with pytest.raises(PermissionError):
        await retry_call(call, attempts=5, backoff=Backoff(0.2), retriable=retriable, sleep=sleeps)
    assert outcomes == [None]  # not retried


def test_chunks_are_consecutive_and_at_most_the_batch_size() -> None:
    assert list(chunks(list(range(23)), 10)) == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    assert list(chunks([], 10)) == []


# -- in-flight bookkeeping ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_in_flight_keeps_leases_until_settled_and_counts_a_lost_lease_once() -> None:
    counters = StreamCounters("sqs", "q")
    clock = Clock()

    async def renew(handles: Sequence[str], seconds: float) -> Sequence[str]:
        lost = [handle for handle in handles if handle == "h2"]
        in_flight.count_renewals(len(handles) - len(lost), lost)
        return lost

    in_flight: InFlight[str, str] = InFlight(counters)
    keeper = LeaseKeeper(renew=renew, lease_seconds=30, renew_margin=10, max_hold=300, batch_size=10, now=clock)
    in_flight.add("h0", "before the keeper")  # no keeper yet: not leased
    assert in_flight.keep_leases(keeper) is keeper
    try:
        in_flight.add("h1", "m1", lease_expires_at=clock.now + 30)
        in_flight.add("h2", "m2", lease_expires_at=clock.now + 30)
        assert (len(in_flight), len(keeper), "h1" in in_flight, in_flight.get("h2")) == (3, 2, True, "m2")
        assert await keeper.renew_due(clock.now + 25) == 1
        assert (counters.leases_renewed, counters.leases_lost) == (1, 1)
        assert in_flight.lost_at_renewal("h2") and not in_flight.lost_at_renewal("h1")
        assert in_flight.settled("h2") == "m2"
        assert not in_flight.lost_at_renewal("h2")  # forgotten with its message
        assert in_flight.settled("h2") is None
        assert in_flight.drain() == {"h0": "before the keeper", "h1": "m1"}
        assert (len(in_flight), len(keeper)) == (0, 0)  # nothing given back is leased any more
    finally:
        await in_flight.stop()
    assert in_flight.keeper is None


def test_message_counts_are_bounded_least_recently_counted_first() -> None:
    counts: MessageCounts[str] = MessageCounts(limit=2)
    assert [counts.increment("a"), counts.increment("a"), counts.increment("b")] == [1, 2, 1]
    counts.increment("a")  # a is now the most recent
    counts.increment("c")  # over the limit: b goes
    assert (counts.get("a"), counts.get("b"), counts.get("c"), len(counts)) == (3, 0, 1, 2)
    counts.decrement("a")
    counts.decrement("c")
    assert (counts.get("a"), counts.get("c"), len(counts)) == (2, 0, 1)
    counts.forget("a")
    counts.decrement("missing")
    assert len(counts) == 0


# -- dead letters ------------------------------------------------------------------------------------
def test_dead_letter_fields_fill_what_the_limit_leaves_and_never_drop_an_original() -> None:
    fields = dead_letter_fields(reason="bad", source="q", message_id="m-1", delivery_attempt="3")
    assert list(fields) == [
        "x-dead-letter-reason",
        "x-dead-letter-source",
        "x-dead-letter-message-id",
        "x-dead-letter-delivery-attempt",
    ]
    original = {"tenant": "acme", "x-dead-letter-reason": "first time"}
    kept = add_within_limit(dict(original), fields, limit=3, overwrite=False)
    assert kept == {"tenant": "acme", "x-dead-letter-reason": "first time", "x-dead-letter-source": "q"}
    replaced = add_within_limit(dict(original), fields, limit=10, overwrite=True)
    assert replaced["x-dead-letter-reason"] == "bad" and len(replaced) == 5
    full = {f"a{i}": "v" for i in range(10)}
    assert add_within_limit(dict(full), fields, limit=10, overwrite=True) == full


# -- ack buffer --------------------------------------------------------------------------------------
class Sender:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_on = fail_on

    def of(self, kind: str):  # type: ignore[no-untyped-def]
        async def send(ids: Sequence[str]) -> None:
            self.calls.append((kind, list(ids)))
            if kind == self.fail_on:
                raise ConnectionError("gone")

        return send


async def test_ack_buffer_sends_acks_then_nacks_in_batches_from_its_task() -> None:
    sender = Sender()
    buffer = AckBuffer(send_acks=sender.of("ack"), send_nacks=sender.of("nack"), batch_size=2, interval=0, log=LOG)
    buffer.add(["a1"], ["n1"])
    await buffer.flush()  # not started: nothing is sent, nothing is lost
    assert (sender.calls, buffer.acks, buffer.nacks) == ([], ["a1"], ["n1"])
    buffer.start("acks[test]", where="test")
    try:
        buffer.add(["a2", "a3"], [])
        await settle()
        assert sender.calls == [("ack", ["a1", "a2"]), ("ack", ["a3"]), ("nack", ["n1"])]
        assert (buffer.acks, buffer.nacks, buffer.fatal) == ([], [], None)
    finally:
        await buffer.stop()


async def test_a_failed_ack_call_ends_the_flusher_and_is_kept_for_the_receive_loop() -> None:
    sender = Sender(fail_on="nack")
    buffer = AckBuffer(send_acks=sender.of("ack"), send_nacks=sender.of("nack"), batch_size=10, interval=0, log=LOG)
    buffer.start("acks[test]", where="test")
    try:
        buffer.add(["a1"], ["n1"])
        await settle()
        assert isinstance(buffer.fatal, ConnectionError)
        buffer.add(["a2"], [])
        await settle()
        assert sender.calls == [("ack", ["a1"]), ("nack", ["n1"])]  # nothing sent after the failure
    finally:
        await buffer.stop()


# -- stopping ----------------------------------------------------------------------------------------
async def test_cancel_and_wait_stops_running_tasks_and_retrieves_finished_errors() -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    running = asyncio.ensure_future(asyncio.Event().wait())
    failed = asyncio.ensure_future(fail())
    await settle()
    await cancel_and_wait(running, failed, None)
    assert running.cancelled() and failed.done()


async def test_first_of_returns_on_the_first_and_raises_its_error() -> None:
    never = asyncio.Event()
    ready = asyncio.Event()
    ready.set()
    await first_of((never.wait(), ready.wait()), timeout=None)
    await first_of((never.wait(),), timeout=0)

    async def fail() -> None:
        raise ValueError("no credit")

    with pytest.raises(ValueError, match="no credit"):
        await first_of((never.wait(), fail()), timeout=None)


async def test_stop_helpers_log_and_carry_on(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise ConnectionError("gone")

    async def ok() -> None:
        return None

    assert await best_effort(ok(), LOG, "not reached", timeout=1) is True
    assert await best_effort(fail(), LOG, "could not release %d message(s)", 3, timeout=1) is False
    assert await best_effort(asyncio.Event().wait(), LOG, "timed out", timeout=0) is False
    closed: list[str] = []

    class Closable:
        def __init__(self, name: str, error: bool = False) -> None:
            self.name = name
            self.error = error

        async def close(self) -> None:
            if self.error:
                raise ConnectionError(self.name)
            closed.append(self.name)

    await close_quietly(Closable("receiver", error=True), None, Closable("client"), log=LOG, where="q")
    assert closed == ["client"]
    assert "could not release 3 message(s)" in caplog.text
    assert "timed out" in caplog.text
    assert "q: error closing Closable" in caplog.text


# -- connections -------------------------------------------------------------------------------------
def test_prefixed_extras_and_config_errors() -> None:
    extras = {"project": "", "extra__google_cloud_platform__project": "old", "scope": "s"}
    assert prefixed_extra(extras, "project", "google_cloud_platform") == "old"
    assert prefixed_extra(extras, "scope", "google_cloud_platform") == "s"
    assert prefixed_extra(extras, "key_path", "google_cloud_platform") is None
    cause = KeyError("x")
    error = config_error("SQS queue 'q'", "the queue does not exist", cause)
    assert isinstance(error, SharedStreamConfigError)
    assert (str(error), error.__cause__) == ("SQS queue 'q': the queue does not exist", cause)


async def test_aws_connection_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {
        "region_name": "eu-west-1",
        "service_config": {"sqs": {"endpoint_url": "http://sqs.local"}},
        "endpoint_url": "http://generic.local",
        "role_arn": "arn:aws:iam::1:role/r",
        "config_kwargs": {"retries": {"max_attempts": 2}},
    }
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_UNIT", json.dumps({"conn_type": "aws", "login": "AKID", "password": "SECRET", "extra": extra})
    )
    conn = await load_aws_connection("aws_unit", service="sqs", region_name=None, fallback_region="us-east-2")
    assert (conn.region_name, conn.endpoint_url, conn.access_key_id, conn.connection_found) == (
        "eu-west-1",
        "http://sqs.local",
        "AKID",
        True,
    )
    assert "SECRET" not in conn.describe() and "role_arn=arn:aws:iam::1:role/r" in conn.describe()
    chain = await load_aws_connection("no_such_aws_conn", service="sqs", region_name=None, fallback_region="us-east-2")
    assert (chain.region_name, chain.connection_found, chain.access_key_id) == ("us-east-2", False, None)
    assert "default credential chain" in chain.describe()
    monkeypatch.setenv("AIRFLOW_CONN_AWS_BAD", json.dumps({"conn_type": "aws", "extra": {"config_kwargs": [1]}}))
    with pytest.raises(SharedStreamConfigError, match="config_kwargs must be a JSON object"):
        await load_aws_connection("aws_bad", service="sqs", region_name="eu-west-1", fallback_region=None)


def test_aws_error_codes_and_config_kwargs_say_what_to_fix() -> None:
    assert aws_error_cause("InvalidClientTokenId", "bad token", resource="q") == (
        "AWS rejected the credentials [InvalidClientTokenId: bad token]"
    )
    assert (
        aws_error_cause("AccessDenied", "no", resource="https://q") == "access denied to 'https://q' [AccessDenied: no]"
    )
    assert aws_error_cause("Weird", "thing", resource="q") == "Weird: thing"
    assert "Throttling" in AWS_THROTTLE_CODES and "AccessDenied" not in AWS_THROTTLE_CODES
    connection = AwsConnection(
        region_name="eu-west-1",
        endpoint_url=None,
        access_key_id=None,
        secret_access_key=None,
        session_token=None,
        role_arn=None,
        assume_role_kwargs={},
        config_kwargs={"retries": {"max_attempts": 2}, "signature_version": "v4", "region_name": "x", "bogus": 1},
        verify=None,
        connection_found=True,
    )
    assert aws_config_kwargs(connection) == ({"retries": {"max_attempts": 2}, "signature_version": "v4"}, ["bogus"])
