"""
What only Redis Streams has: idle-time leases and XAUTOCLAIM, delivery counts in the pending
entries list, the dead-letter stream, consumer groups and consumers, trimmed entries, a server restart.

Every assertion on stream state goes through the adapter's independent client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.redis import RedisSharedStreamProducer
from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger
from devkit.redis_broker import start_redis
from devkit.runner import RunnerSim, record_producers, wait_until
from tests.integration import crash
from tests.integration.contract import batched, held_under_lease, orders, wait_until_async, wait_until_settled
from tests.integration.redis.conftest import RedisAdapter

pytestmark = [pytest.mark.integration, pytest.mark.redis]


def crashing(adapter: RedisAdapter, **kwargs: Any) -> RedisSharedStreamTrigger:
    """A trigger whose triggerer 'dies': nothing is given back on close, leases just stop."""
    return crash.crashing(adapter.make_trigger(**kwargs))


async def consumers(adapter: RedisAdapter) -> dict[bytes, dict[bytes, Any]]:
    reply = await adapter.client.execute_command("XINFO", "CONSUMERS", adapter.stream, adapter.group)
    out = {}
    for item in reply:
        info = {bytes(item[i]): item[i + 1] for i in range(0, len(item), 2)}
        out[bytes(info[b"name"])] = info
    return out


async def test_acknowledged_only_after_every_watcher_persisted(adapter: RedisAdapter) -> None:
    await adapter.publish(orders(5))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger())
        runner.add(2, adapter.make_trigger())
        await wait_until(lambda: len(runner.pending) == 10, timeout=20, what="10 fired events")
        assert len(await adapter.pending()) == 5
        runner.persist_matching(lambda trigger_id, _: trigger_id == 1)  # only watcher 1's events stored
        await asyncio.sleep(0.5)  # give a wrong XACK time to happen
        assert len(await adapter.pending()) == 5, "acknowledged before every watcher's events were persisted"
        runner.persist()
        await wait_until_settled(adapter, timeout=20)
        assert not runner.failures
    # A clean stop leaves no consumer of ours behind when nothing is pending for it.
    assert await consumers(adapter) == {}


async def test_the_lease_is_kept_while_a_watcher_works(adapter: RedisAdapter) -> None:
    # claim_idle 4 s: the keeper renews a third of it before it lapses (idle ~2.7 s), so a stall
    # of the event loop up to ~1.3 s cannot let it lapse. With 2 s (0.67 s of slack) a loaded
    # 2-core CI machine stalled the loop long enough twice (the CI rehearsal of e1381d7).
    claim_idle_ms = 4000

    async def nobody_else_has_it() -> None:
        # No other consumer can claim it: its idle time is reset before it reaches claim_idle.
        stolen = await adapter.client.execute_command(
            "XAUTOCLAIM", adapter.stream, adapter.group, "intruder", claim_idle_ms, "0-0", "JUSTID"
        )
        assert not stolen[1], "another consumer could claim the entry while a watcher worked on it"
        [(_, _, idle, delivered)] = await adapter.pending()
        assert idle < claim_idle_ms and delivered == 1

    trigger = adapter.make_trigger(claim_idle=claim_idle_ms / 1000)
    await held_under_lease(adapter, trigger, hold_for=2.5 * claim_idle_ms / 1000, nobody_else_has_it=nobody_else_has_it)


async def test_a_dead_consumers_entries_are_claimed_after_claim_idle(adapter: RedisAdapter) -> None:
    await adapter.publish(orders(4))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, crashing(adapter, claim_idle=2))
        await wait_until(lambda: len(runner.pending) == 4, timeout=20, what="4 fired events")
        runner.crash()
    # The dead triggerer gave nothing back: its entries stay pending under its consumer.
    pending = await adapter.pending()
    assert len(pending) == 4 and len({consumer for _, consumer, _, _ in pending}) == 1
    dead_consumer = pending[0][1]
    started = asyncio.get_running_loop().time()
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(claim_idle=2))
        await wait_until(lambda: runner.count(1) == 4, timeout=20, what="4 claimed events")
        waited = asyncio.get_running_loop().time() - started
        await wait_until_settled(adapter, timeout=20)
    assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == [0, 1, 2, 3]
    assert {p["delivery_attempt"] for p in runner.persisted[1]} == {2}
    assert waited >= 1.5, f"claimed after {waited:.1f} s, before claim_idle"
    # The dead consumer is left (its pending list is empty now: a later stream deletes it after an hour).
    assert (await consumers(adapter))[dead_consumer][b"pending"] == 0


async def test_poison_entry_is_dead_lettered_on_its_delivery_count(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_ACK_TIMEOUT", "1")
    [entry_id] = await adapter.publish_ids(orders(1))
    attempts: list[int] = []
    async with RunnerSim(SharedStreamManager(ack_timeout=1.0)) as runner:  # nothing persisted: every delivery times out
        for trigger_id in range(1, 4):
            runner.add(trigger_id, adapter.make_trigger(max_delivery_attempts=3))
            await wait_until(lambda: len(runner.failures) == len(attempts) + 1, timeout=20, what="an ack timeout")
            attempts.append(runner.pending[-1].event.payload["delivery_attempt"])
            if len(attempts) < 3:
                # Given back: the pending list says how often it was delivered, which is the attempt.
                await wait_until_async(lambda: _times_delivered(adapter, len(attempts)), timeout=10, interval=0.05)
        await wait_until_settled(adapter, timeout=20)
    assert attempts == [1, 2, 3]
    [(_, fields)] = await adapter.dead_letter_entries()
    values = dict(zip(fields[::2], fields[1::2], strict=True))
    reason = values[b"x-dead-letter-reason"].decode()
    assert "poison message" in reason and "max_delivery_attempts=3" in reason
    assert values[b"x-dead-letter-message-id"] == entry_id


async def test_a_collateral_failure_sets_the_delivery_count_back_in_redis(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    An ack timeout fails the watcher and its 4 outstanding entries; only the one it stood on (the
    last it pulled) counts. The other 3 get their times-delivered set back in Redis itself
    (``RETRYCOUNT``), so a restarted triggerer would not count them either (_core/attempts.py).
    """
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_ACK_TIMEOUT", "1")
    entry_ids = [entry_id.decode() for entry_id in await adapter.publish_ids(orders(4))]
    async with RunnerSim(SharedStreamManager(ack_timeout=1.0)) as runner:  # nothing persisted
        runner.add(1, adapter.make_trigger(max_delivery_attempts=2))
        await wait_until(lambda: len(runner.pending) == 4, timeout=20, what="the watcher fired on every entry")
        await wait_until(lambda: 1 in runner.failures, timeout=20, what="an ack timeout")

        async def given_back() -> bool:
            counts = {entry[0].decode(): entry[3] for entry in await adapter.pending()}
            return counts == {**dict.fromkeys(entry_ids[:3], 0), entry_ids[3]: 1}

        await wait_until_async(given_back, timeout=10, interval=0.05)
        runner.pending.clear()
        runner.add(2, adapter.make_trigger(max_delivery_attempts=2))
        await wait_until(lambda: len(runner.pending) == 4, timeout=20, what="the second delivery")
        attempts = {
            event.event.payload["message_id"]: event.event.payload["delivery_attempt"] for event in runner.pending
        }
    # With max_delivery_attempts=2 the suspect is on its last attempt; the others start again.
    assert attempts == {**dict.fromkeys(entry_ids[:3], 1), entry_ids[3]: 2}


async def _times_delivered(adapter: RedisAdapter, count: int) -> bool:
    pending = await adapter.pending()
    return bool(pending) and pending[0][3] == count


async def test_dead_letter_stream_keeps_every_field_in_order_and_says_why(adapter: RedisAdapter) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    entry_id = await adapter.publish_fields(
        [b"type", b"order", b"body", bad, b"type", b"again", b"x-dead-letter-reason", b"forged", b"\xff", b"\x00"]
    )
    await adapter.publish(orders(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await wait_until_settled(adapter, timeout=20)
    [(_, fields)] = await adapter.dead_letter_entries()
    assert fields[:10] == [
        b"type",
        b"order",
        b"body",
        bad,
        b"type",
        b"again",
        b"x-original-x-dead-letter-reason",
        b"forged",
        b"\xff",
        b"\x00",
    ]
    added = dict(zip(fields[10::2], fields[11::2], strict=True))
    assert set(added) == {
        b"x-dead-letter-reason",
        b"x-dead-letter-source",
        b"x-dead-letter-message-id",
        b"x-dead-letter-group",
    }
    assert b"order 7 is flagged bad" in added[b"x-dead-letter-reason"]
    assert added[b"x-dead-letter-source"] == adapter.stream.encode()
    assert added[b"x-dead-letter-message-id"] == entry_id
    assert added[b"x-dead-letter-group"] == adapter.group.encode()
    assert runner.count(1) == 1


async def test_dead_letter_maxlen_trims_the_dead_letter_stream(adapter: RedisAdapter) -> None:
    bad = [json.dumps({"order_id": i, "bad": True}).encode() for i in range(300)]
    await adapter.publish(bad)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(
            1,
            adapter.make_trigger(
                dead_letter_maxlen=10, filter_function="tests.integration.contract.reject_flagged", batch_size=50
            ),
        )
        await wait_until_settled(adapter, timeout=30)
    # MAXLEN ~ trims whole radix-tree nodes (100 entries by default): about 10, never all 300.
    assert await adapter.client.xlen(adapter.dead_letter_stream) < 300


async def test_without_a_dead_letter_stream_rejected_entries_are_acknowledged_and_stay_in_the_stream(
    adapter: RedisAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    [entry_id] = await adapter.publish_ids([bad])
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(
            1,
            adapter.make_trigger(dead_letter_stream=None, filter_function="tests.integration.contract.reject_flagged"),
        )
        await wait_until_settled(adapter, timeout=20)
    assert await adapter.client.exists(adapter.dead_letter_stream) == 0
    [(kept_id, _)] = await adapter.client.execute_command("XRANGE", adapter.stream, "-", "+")
    assert bytes(kept_id) == entry_id
    assert any(entry_id.decode() in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


async def test_a_missing_group_is_created_with_the_stream(adapter: RedisAdapter) -> None:
    assert await adapter.client.exists(adapter.stream) == 0
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until_async(lambda: _group_exists(adapter), timeout=20)
        await adapter.publish(orders(3))
        await wait_until(lambda: runner.count(1) == 3, timeout=20, what="3 events")
        await wait_until_settled(adapter, timeout=20)


async def _group_exists(adapter: RedisAdapter) -> bool:
    return await adapter.group_info() is not None


async def test_group_start_id_dollar_skips_what_was_there(adapter: RedisAdapter) -> None:
    await adapter.publish(orders(3))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(group_start_id="$"))
        await wait_until_async(lambda: _group_exists(adapter), timeout=20)
        await adapter.publish([json.dumps({"order_id": 99}).encode()])
        await wait_until(lambda: runner.count(1) >= 1, timeout=20, what="the new entry")
        await asyncio.sleep(0.5)
    assert [p["body"]["order_id"] for p in runner.persisted[1]] == [99]


async def _group_error(trigger: RedisSharedStreamTrigger) -> BaseException:
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger)
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="the group to fail")
        return runner.failures[1]


async def test_a_missing_group_is_refused_when_create_group_is_false(adapter: RedisAdapter) -> None:
    error = await _group_error(adapter.make_trigger(create_group=False))
    assert isinstance(error, SharedStreamConfigError)
    assert adapter.stream in str(error) and "create_group" in str(error)
    await adapter.publish(orders(1))  # the stream exists now, the group still does not
    error = await _group_error(adapter.make_trigger(create_group=False))
    assert isinstance(error, SharedStreamConfigError)
    assert "consumer group does not exist" in str(error) and adapter.group in str(error)
    assert await adapter.group_info() is None


async def test_a_key_that_is_no_stream_fails_the_group_naming_it(adapter: RedisAdapter) -> None:
    await adapter.client.set(adapter.stream, b"a string")
    error = await _group_error(adapter.make_trigger())
    assert isinstance(error, SharedStreamConfigError)
    assert adapter.stream in str(error) and "not a stream" in str(error)


async def test_a_missing_connection_and_a_wrong_password_are_configuration_errors(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = await _group_error(adapter.make_trigger(redis_conn_id="no_such_redis"))
    assert isinstance(error, SharedStreamConfigError) and "'no_such_redis' does not exist" in str(error)
    conn = json.loads(__import__("os").environ[f"AIRFLOW_CONN_{adapter.conn_id.upper()}"])
    conn.update(login="nobody", password="very-secret-password")
    monkeypatch.setenv("AIRFLOW_CONN_REDIS_WRONG_PASSWORD", json.dumps(conn))
    error = await _group_error(adapter.make_trigger(redis_conn_id="redis_wrong_password"))
    assert isinstance(error, SharedStreamConfigError)
    assert "authentication failed" in str(error) or "ACL" in str(error)
    assert "very-secret-password" not in str(error)


async def test_trimmed_and_deleted_pending_entries_are_dropped_not_stuck(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await adapter.publish_ids(orders(6))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, crashing(adapter, claim_idle=1))
        await wait_until(lambda: len(runner.pending) == 6, timeout=20, what="6 fired events")
        runner.crash()
    # While pending under the dead consumer: two deleted, the oldest two trimmed away.
    await adapter.client.xdel(adapter.stream, ids[3], ids[5])
    await adapter.client.execute_command("XTRIM", adapter.stream, "MINID", ids[2])
    made = record_producers(monkeypatch, RedisSharedStreamProducer)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(claim_idle=1))
        await wait_until(lambda: runner.count(1) == 2, timeout=20, what="the 2 entries left")
        await wait_until_settled(adapter, timeout=20)
        assert not runner.failures
        trimmed = made[0].counters.trimmed
    assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == [2, 4]
    assert trimmed == 4
    assert await adapter.pending() == []


async def test_batch_mode_claims_a_dead_consumers_batch_with_its_delivery_count(adapter: RedisAdapter) -> None:
    await adapter.publish(orders(10))
    options: dict[str, Any] = {"batch_size": 50, "batch_timeout": 0.3, "claim_idle": 1}
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, crashing(adapter, **options))
        await wait_until(lambda: len(runner.pending) >= 1, timeout=20, what="a batch")
        runner.crash()
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(**options))
        runner.add(2, adapter.make_trigger(**options, match={"body.region": "eu"}))
        await wait_until(lambda: len(batched(runner, 1)) >= 10, timeout=20, what="10 claimed messages")
        await wait_until_settled(adapter, timeout=20)
    assert sorted(e["body"]["order_id"] for e in batched(runner, 1)) == list(range(10))
    assert {e["delivery_attempt"] for e in batched(runner, 1)} == {2}
    assert sorted(e["body"]["order_id"] for e in batched(runner, 2)) == [0, 3, 6, 9]
    assert runner.count(1) < 10, "claimed entries must fill batches too"


async def test_a_redis_restart_with_its_append_only_file_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, redis_connection: str
) -> None:
    """
    A redis-server of this test's own (appendfsync always), stopped and started again on its port
    and data directory while watchers hold unacknowledged entries: what was published before and
    after is delivered, the acknowledgements after the restart go through, nothing is left pending.
    """
    with start_redis(own=True, appendfsync="always") as server:
        monkeypatch.setenv(f"AIRFLOW_CONN_{redis_connection.upper()}", json.dumps(server.connection()))
        client = aioredis.Redis(**server.client_kwargs(), protocol=2)
        client.set_response_callback("XRANGE", lambda response, **_: response)
        client.set_response_callback("XPENDING", lambda response, **_: response)
        adapter = RedisAdapter.fresh(client, redis_connection, server)
        try:
            await adapter.publish(orders(20)[:10])
            async with RunnerSim(SharedStreamManager(ack_timeout=120)) as runner:
                runner.add(1, adapter.make_trigger())
                runner.add(2, adapter.make_trigger(match={"body.region": "eu"}))
                await wait_until(lambda: len(runner.pending) >= 14, timeout=20, what="10 + 4 fired events")
                server.stop()  # SIGTERM: the AOF is written; every client connection drops
                await asyncio.sleep(2.0)
                server.start()
                assert len(await adapter.pending()) == 10, "the pending entries list did not survive the restart"
                await adapter.publish(orders(20)[10:])
                runner.confirm_interval = 0.05
                runner._persister = asyncio.create_task(runner._persist_loop())

                def complete() -> bool:
                    return {p["body"]["order_id"] for p in runner.persisted[1]} == set(range(20))

                await wait_until(complete, timeout=60, what="every order after the restart")
                await wait_until_settled(adapter, timeout=60)
                assert not runner.failures, runner.failures
            eu = sorted({p["body"]["order_id"] for p in runner.persisted[2]})
            assert eu == [i for i in range(20) if i % 3 == 0]
        finally:
            # This test's own server is thrown away: only the kit stream's client is closed.
            await adapter.in_thread(adapter.kit.close)
            await client.aclose()


async def test_a_hold_is_not_counted_and_comes_back_after_hold_backoff(adapter: RedisAdapter) -> None:
    """Zero subscribers (an outcome with no count at all): the entry comes back, its attempt unchanged."""
    from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome

    [entry_id] = await adapter.publish_ids(orders(1))
    trigger = adapter.make_trigger(claim_idle=5, hold_backoff=1)
    producer = RedisSharedStreamProducer(trigger.settings, stream_key=trigger.shared_stream_key())
    stream = cast(AsyncGenerator[tuple[Any, Any], None], producer.open_stream())
    try:
        message, delivery = await anext(stream)
        assert message.envelope["delivery_attempt"] == 1
        await producer.advance([AdvanceItem(delivery, AdvanceOutcome(acked=0, failed=0))])
        [(_, _, idle, delivered)] = await adapter.pending()
        assert delivered == 0, "the hold counted a delivery"
        assert 3500 <= idle <= 5000, f"idle {idle} ms: not claimable after hold_backoff (claim_idle 5 s, backoff 1 s)"
        started = asyncio.get_running_loop().time()
        message, delivery = await asyncio.wait_for(anext(stream), timeout=10)
        assert asyncio.get_running_loop().time() - started >= 0.8
        assert message.envelope["message_id"] == entry_id.decode()
        assert message.envelope["delivery_attempt"] == 1
        assert producer.counters.held == 1
        await producer.advance([AdvanceItem(delivery, AdvanceOutcome(acked=1, failed=0))])
        assert await adapter.pending() == []
    finally:
        await stream.aclose()
        await producer.aclose()


async def test_a_lapsed_lease_is_not_broadcast_again_nor_counted(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The producer stops renewing at the ack timeout it read (+5 s); a manager that has not failed the
    entry by then (its own timeout is longer here) still holds it: the claim pass that takes it
    back must neither broadcast it again nor let the claim count as a delivery.
    """
    monkeypatch.setenv("AIRFLOW__TRIGGERER__SHARED_STREAM_ACK_TIMEOUT", "1")  # the producer's max_hold: 6 s
    await adapter.publish(orders(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger(claim_idle=1))
        await wait_until(lambda: len(runner.pending) == 1, timeout=20, what="the event")
        await asyncio.sleep(9.0)  # lease lapsed at ~6 s; claimed back at ~7 s and every second after
        assert len(runner.pending) == 1, "broadcast again while still in flight"
        [(_, _, _, delivered)] = await adapter.pending()
        assert delivered == 1, f"the claims of an entry in flight counted {delivered - 1} deliveries"
        runner.persist()
        await wait_until_settled(adapter, timeout=20)
        assert not runner.failures
    assert runner.count(1) == 1


async def test_an_unreachable_server_fails_the_group_as_unavailable_not_misconfigured(
    adapter: RedisAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    import airflow_shared_stream_provider.producers.redis_client as client_module
    from airflow_shared_stream_provider._core.errors import BrokerUnavailableError
    from airflow_shared_stream_provider._core.retry import Backoff
    from devkit.ports import free_port

    monkeypatch.setattr(RedisSharedStreamProducer, "receive_backoff", Backoff(0.01))  # the 1-2-4-8 s waits, shortened
    monkeypatch.setattr(client_module, "CLIENT_RETRIES", 0)  # and redis-py's own retries of each call
    port = free_port()  # nothing listens there
    monkeypatch.setenv(
        "AIRFLOW_CONN_REDIS_NOWHERE",
        json.dumps({"conn_type": "redis", "host": "127.0.0.1", "port": port, "password": "very-secret-password"}),
    )
    error = await _group_error(adapter.make_trigger(redis_conn_id="redis_nowhere"))
    assert isinstance(error, BrokerUnavailableError), repr(error)
    assert f"127.0.0.1:{port}" in str(error) and adapter.stream in str(error)
    assert "very-secret-password" not in str(error)
