"""bench.production: which of a paused watcher's misses its Dag's pause explains (finding 11)."""

from __future__ import annotations

import pytest

from bench.production import explained_by_pause

PAUSE = [(1000.0, 1030.0)]


@pytest.mark.parametrize("replays", [True, False])
def test_a_message_published_during_the_pause_is_explained_on_every_broker(replays: bool) -> None:
    assert explained_by_pause(1010.0, None, PAUSE, replays=replays)
    assert explained_by_pause(1010.0, 1011.0, PAUSE, replays=replays)


def test_on_a_queue_broker_an_event_its_siblings_got_after_the_pause_began_is_explained() -> None:
    # Published before the pause, but worked off after it began: the paused watcher's event for it
    # could be stored for no asset (Airflow dropped the trigger before cancelling it).
    assert explained_by_pause(990.0, 1002.0, PAUSE, replays=False)


def test_kafka_replays_for_a_re_created_watcher_so_only_the_publish_window_explains() -> None:
    assert not explained_by_pause(990.0, 1002.0, PAUSE, replays=True)


def test_a_message_worked_off_before_the_pause_is_a_loss_on_every_broker() -> None:
    assert not explained_by_pause(990.0, 995.0, PAUSE, replays=False)
    assert not explained_by_pause(990.0, None, PAUSE, replays=False)
    assert not explained_by_pause(990.0, 1002.0, [], replays=False)  # a watcher that was not paused
