"""
What only SQS has: visibility leases, receive counts, FIFO message groups, queue URLs and regions.

Every assertion on queue state goes through the adapter's independent client.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import held_under_lease, orders, wait_until_async, wait_until_settled
from tests.integration.crash import crashing
from tests.integration.sqs.conftest import SqsAdapter

pytestmark = [pytest.mark.integration, pytest.mark.sqs]


async def wait_for_counts(adapter: SqsAdapter, expected: tuple[int, int], *, timeout: float = 20.0) -> None:
    async def reached() -> bool:
        return await adapter.counts() == expected

    await wait_until_async(reached, timeout=timeout)


def persist_where(runner: RunnerSim, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Persist only the pending events ``keep`` accepts (a supervisor that stalls on the others)."""
    chosen = [item for item in runner.pending if keep(item.event.payload)]
    runner.pending = [item for item in runner.pending if not keep(item.event.payload)]
    for item in chosen:
        runner.persisted[item.trigger_id].append(item.event.payload)
    runner.manager.confirm_persisted([item.seq for item in chosen if item.seq is not None])
    return len(chosen)


async def test_deleted_only_after_every_watcher_persisted(adapter: SqsAdapter) -> None:
    await adapter.publish(orders(5))
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, adapter.make_trigger())
        runner.add(2, adapter.make_trigger())
        await wait_until(lambda: len(runner.pending) == 10, timeout=20, what="10 fired events")
        assert await adapter.counts() == (0, 5)
        # Only watcher 1's events reach the DB: nothing may be deleted yet.
        only_first = [item for item in runner.pending if item.trigger_id == 1]
        runner.pending = [item for item in runner.pending if item.trigger_id != 1]
        manager.confirm_persisted([item.seq for item in only_first if item.seq is not None])
        await asyncio.sleep(0.3)  # give a wrong delete time to happen
        assert await adapter.counts() == (0, 5)
        runner.persist()
        await wait_until_settled(adapter, timeout=20)
        assert not runner.failures


async def test_visibility_is_extended_while_a_watcher_works(adapter: SqsAdapter) -> None:
    async def nobody_else_has_it() -> None:
        # Still hidden after two and a half visibility timeouts: the lease keeper extended it.
        assert await adapter.counts() == (0, 1), "the message became visible while the watcher worked"
        probe = await adapter.client.receive_message(QueueUrl=adapter.queue_url, WaitTimeSeconds=0)
        assert not probe.get("Messages"), "another consumer could receive the message"

    trigger = adapter.make_trigger(visibility_timeout=2)
    await held_under_lease(adapter, trigger, hold_for=5.0, nobody_else_has_it=nobody_else_has_it)


async def test_messages_come_back_after_a_crash(adapter: SqsAdapter) -> None:
    await adapter.publish(orders(4))
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, crashing(adapter.make_trigger(visibility_timeout=2)))  # nothing released on close
        await wait_until(lambda: len(runner.pending) == 4, timeout=20, what="4 fired events")
        runner.crash()
    # The dead triggerer released nothing: the messages are in flight until their lease runs out.
    assert await adapter.counts() == (0, 4)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until(lambda: runner.count(1) == 4, timeout=20, what="4 redelivered events")
        await wait_until_settled(adapter, timeout=20)
    assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == [0, 1, 2, 3]
    assert {p["delivery_attempt"] for p in runner.persisted[1]} == {2}


async def test_dead_letter_keeps_body_and_attributes_and_says_why(adapter: SqsAdapter) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    await adapter.publish([bad], attributes={"type": "order", "tenant": "acme"})
    await adapter.publish(orders(1))
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await wait_until_settled(adapter, timeout=20)
    [dead] = await adapter.dead_letter_messages()
    assert dead["Body"] == bad.decode()
    attributes = {name: value["StringValue"] for name, value in dead["MessageAttributes"].items()}
    assert attributes["type"] == "order"
    assert attributes["tenant"] == "acme"
    assert "order 7 is flagged bad" in attributes["x-dead-letter-reason"]
    assert attributes["x-dead-letter-source"] == adapter.queue_url
    assert attributes["x-dead-letter-message-id"]
    assert runner.count(1) == 1


async def test_without_a_dlq_rejected_messages_are_kept_not_deleted(adapter: SqsAdapter) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    await adapter.publish([bad])
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(
            1,
            adapter.make_trigger(
                dlq_queue_url=None, reject_backoff=600, filter_function="tests.integration.contract.reject_flagged"
            ),
        )
        # Rejected, parked invisible for reject_backoff: still in the queue, nothing dead-lettered.
        await wait_for_counts(adapter, (0, 1))
        await asyncio.sleep(1.5)  # more than a receive round: it must not come back meanwhile
        assert await adapter.counts() == (0, 1)
    assert await adapter.dead_lettered() == []


async def test_poison_message_is_dead_lettered_after_max_delivery_attempts(
    adapter: SqsAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_ACK_TIMEOUT", "1")
    await adapter.publish(orders(1))
    manager = SharedStreamManager(ack_timeout=1.0)
    attempts: list[int] = []
    async with RunnerSim(manager) as runner:  # nothing is ever persisted: every delivery times out
        for trigger_id in range(1, 4):
            runner.add(trigger_id, adapter.make_trigger(max_delivery_attempts=3))
            await wait_until(lambda: len(runner.failures) == len(attempts) + 1, timeout=20, what="an ack timeout")
            attempts.append(runner.pending[-1].event.payload["delivery_attempt"])
        await wait_until_settled(adapter, timeout=20)
    assert attempts == [1, 2, 3]
    [dead] = await adapter.dead_letter_messages()
    reason = dead["MessageAttributes"]["x-dead-letter-reason"]["StringValue"]
    assert "poison message" in reason
    assert "max_delivery_attempts=3" in reason


async def test_fifo_group_keeps_flowing_while_another_group_is_stalled(fifo_adapter: SqsAdapter) -> None:
    adapter = fifo_adapter
    await adapter.publish([json.dumps({"group": "A", "n": i}).encode() for i in range(3)], group_id="A")
    await adapter.publish([json.dumps({"group": "B", "n": i}).encode() for i in range(6)], group_id="B")
    manager = SharedStreamManager(ack_timeout=60)

    def group_b(payload: dict[str, Any]) -> bool:
        return bool(payload["metadata"]["message_group_id"] == "B")

    async with RunnerSim(manager) as runner:
        runner.add(1, adapter.make_trigger())
        runner.add(2, adapter.make_trigger(match={"body.group": "B"}))

        # The supervisor persists group B's events only: group A's stay unconfirmed (stalled).
        async def only_b() -> bool:
            persist_where(runner, group_b)
            return runner.count(1) == 6 and await adapter.unsettled() <= 3

        await wait_until_async(only_b, timeout=30)
        assert [p["body"]["n"] for p in runner.persisted[1]] == list(range(6))
        assert [p["body"]["n"] for p in runner.persisted[2]] == list(range(6))
        # Group A is not lost and not redelivered behind our back: still in flight, in the queue.
        assert await adapter.unsettled() == 3
        assert all(not group_b(item.event.payload) for item in runner.pending)

        async def all_done() -> bool:
            runner.persist()
            return await adapter.unsettled() == 0 and runner.count(1) == 9

        await wait_until_async(all_done, timeout=30)
        assert not runner.failures
    group_a = [p["body"]["n"] for p in runner.persisted[1] if p["body"]["group"] == "A"]
    assert group_a == [0, 1, 2]
    assert all(p["metadata"]["message_group_id"] in ("A", "B") for p in runner.persisted[1])


async def _group_error(trigger: SqsSharedStreamTrigger) -> BaseException:
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger)
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="the group to fail")
        return runner.failures[1]


async def test_missing_queue_fails_the_group_naming_the_queue(adapter: SqsAdapter) -> None:
    missing = adapter.queue_url + "-nope"
    error = await _group_error(adapter.make_trigger(queue_url=missing))
    assert isinstance(error, SharedStreamConfigError)
    assert missing in str(error)
    assert "does not exist" in str(error)


async def test_missing_dlq_fails_the_group_naming_it(adapter: SqsAdapter) -> None:
    missing = adapter.dlq_url + "-nope"
    error = await _group_error(adapter.make_trigger(dlq_queue_url=missing))
    assert isinstance(error, SharedStreamConfigError)
    assert f"dlq_queue_url {missing!r}" in str(error)


async def test_wrong_region_fails_the_group_naming_queue_and_region(adapter: SqsAdapter) -> None:
    error = await _group_error(adapter.make_trigger(region_name="ap-southeast-2"))
    assert isinstance(error, SharedStreamConfigError)
    assert adapter.queue_url in str(error)
    assert "ap-southeast-2" in str(error)


async def test_no_credentials_fails_the_group_with_the_cause(
    adapter: SqsAdapter, sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_NO_KEYS",
        json.dumps({"conn_type": "aws", "extra": {"region_name": "us-east-1", "endpoint_url": sqs_endpoint}}),
    )
    error = await _group_error(adapter.make_trigger(aws_conn_id="aws_no_keys"))
    assert isinstance(error, SharedStreamConfigError)
    assert adapter.queue_url in str(error)
    assert "no usable AWS credentials" in str(error)
    assert "aws_no_keys" in str(error)


async def test_role_arn_in_the_connection_assumes_the_role(
    adapter: SqsAdapter, sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.environ.get("SQS_ENDPOINT_URL"):
        pytest.skip("needs an endpoint that also serves STS for a made-up role (moto)")
    conn = {
        "conn_type": "aws",
        "login": "testing",
        "password": "testing",
        "extra": {
            "region_name": "us-east-1",
            "endpoint_url": sqs_endpoint,
            # Where the amazon provider sends AssumeRole (never endpoint_url); moto serves STS too.
            "service_config": {"sts": {"endpoint_url": sqs_endpoint}},
            "role_arn": "arn:aws:iam::123456789012:role/shared-stream-test",
            "assume_role_kwargs": {"RoleSessionName": "it", "DurationSeconds": 900},
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_ROLE_IT", json.dumps(conn))
    await adapter.publish(orders(3))
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(aws_conn_id="aws_role_it"))
        await wait_until(lambda: runner.count(1) == 3, timeout=20, what="3 events")
        await wait_until_settled(adapter, timeout=20)
        assert not runner.failures
