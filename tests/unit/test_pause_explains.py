"""
bench.production: which of a paused watcher's misses its Dag's pause explains (finding 11), and
the triggerers' logs that show which messages a watcher fired (bench/triggerer_log.py).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from bench.production import FIRED_FOR_NO_ASSET, PUBLISHED_WHILE_PAUSED, SIBLINGS_AFTER_PAUSE, pause_reason
from bench.triggerer_log import TriggererLogs

PAUSE = [(1000.0, 1030.0)]


def test_a_message_published_during_the_pause_is_explained_on_a_queue_broker() -> None:
    assert pause_reason(1010.0, None, PAUSE, replays=False) == PUBLISHED_WHILE_PAUSED
    assert pause_reason(1010.0, 1011.0, PAUSE, replays=False) == PUBLISHED_WHILE_PAUSED


def test_on_a_queue_broker_an_event_fired_after_the_pause_began_and_not_stored_is_explained() -> None:
    # The logs show the watcher fired it after the pause began; no asset event has it: Airflow had
    # dropped the trigger. The evidence wins over the siblings' proxy.
    assert pause_reason(990.0, 995.0, PAUSE, replays=False, fired_at=1004.0) == FIRED_FOR_NO_ASSET
    assert pause_reason(990.0, None, PAUSE, replays=False, fired_at=1004.0) == FIRED_FOR_NO_ASSET


def test_on_a_queue_broker_an_event_its_siblings_got_after_the_pause_began_is_explained() -> None:
    # Published before the pause, but worked off after it began: still queued for the paused
    # watcher when it was cancelled, or its event stored for no asset.
    assert pause_reason(990.0, 1002.0, PAUSE, replays=False) == SIBLINGS_AFTER_PAUSE


def test_kafka_replays_everything_for_a_re_created_watcher_so_nothing_explains_a_miss() -> None:
    assert pause_reason(990.0, 1002.0, PAUSE, replays=True) is None
    assert pause_reason(990.0, 1002.0, PAUSE, replays=True, fired_at=1004.0) is None
    assert pause_reason(1010.0, None, PAUSE, replays=True) is None  # published while it was away


def test_a_message_worked_off_before_the_pause_is_a_loss_on_every_broker() -> None:
    assert pause_reason(990.0, 995.0, PAUSE, replays=False) is None
    assert pause_reason(990.0, 995.0, PAUSE, replays=False, fired_at=996.0) is None  # fired before: should be stored
    assert pause_reason(990.0, None, PAUSE, replays=False) is None
    assert pause_reason(990.0, 1002.0, [], replays=False, fired_at=1004.0) is None  # a watcher that was not paused


def _line(at: str, text: str) -> str:
    return f"{at} [info     ] {text} dag_id=None loc=triggerer_job_runner.py:1046 map_index=None run_id=None\n"


def test_the_logs_say_what_each_watcher_fired_under_every_trigger_id_it_had(tmp_path: Path) -> None:
    """Lines as Airflow 3.3.2 and our trigger write them; a watcher re-created as trigger 21 was trigger 4."""
    fired = "Trigger fired event            [airflow.jobs.triggerer_job_runner]"
    first = [
        _line("2026-11-28T05:54:07.1Z", "Watcher sqs_orders_eu#ef0061c14636 runs as trigger 4 on a sqs shared stream"),
        _line("2026-11-28T05:54:07.2Z", "Watcher sqs_orders_big#01 runs as trigger 5 on a sqs shared stream"),
        _line("2026-11-28T05:54:22.5Z", f"{fired} name='ID 4' result=\"TriggerEvent<sqs message 'm-1'>\""),
        _line("2026-11-28T05:54:23.0Z", f"{fired} name='ID 5' result=\"TriggerEvent<sqs message 'm-2'>\""),
        # a batch names its first and last message only: no evidence
        _line(
            "2026-11-28T05:54:24.0Z",
            f"{fired} name='ID 4' result=\"TriggerEvent<batch of 3 sqs messages 'm-3' .. 'm-5'>\"",
        ),
    ]
    rejoined = _line(
        "2026-11-28T05:57:07Z", "Watcher sqs_orders_eu#ef0061c14636 runs as trigger 21 on a sqs shared stream"
    )
    log = tmp_path / "triggerer.log"
    log.write_text("".join(first) + rejoined[:60])  # the last line half written when read
    logs = TriggererLogs(tmp_path)
    logs.refresh()
    at = datetime(2026, 11, 28, 5, 54, 22, 500000, tzinfo=timezone.utc).timestamp()
    assert logs.fired("sqs_orders_eu") == {"m-1": at}
    assert set(logs.fired("sqs_orders_big")) == {"m-2"}
    # The rest of the half-written line, and the second triggerer's log with the re-created watcher.
    with log.open("a") as f:
        f.write(rejoined[60:])
    (tmp_path / "triggerer-b.log").write_text(
        _line("2026-11-28T05:57:10Z", f"{fired} name='ID 21' result=\"TriggerEvent<sqs message 'm-9'>\"")
        + _line("2026-11-28T05:57:11Z", f"{fired} name='ID 21' result=\"TriggerEvent<sqs message 'm-1'>\"")
    )
    logs.refresh()
    assert logs.watcher_of[21] == "sqs_orders_eu"
    assert set(logs.fired("sqs_orders_eu")) == {"m-1", "m-9"}
    assert logs.fired("sqs_orders_eu")["m-1"] == at  # the first time it fired, not the replay
    # Trigger 4 was replaced by 21: only what 4 fired can have been stored for no asset.
    assert set(logs.fired("sqs_orders_eu", replaced_triggers_only=True)) == {"m-1"}
    assert logs.fired("sqs_orders_big", replaced_triggers_only=True) == {}
