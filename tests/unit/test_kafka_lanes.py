"""The Kafka commit invariant, as a property: a lane never commits past an unresolved offset."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_shared_stream_provider.producers.kafka_lanes import Lane

# A run: the offsets read (increasing, with gaps as compaction/transactions leave), then a
# sequence of outcomes in any order: each read offset is settled, held (and later re-read and
# settled or held again), or left unresolved.
offsets_strategy = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=60, unique=True).map(
    sorted
)


@settings(max_examples=300, deadline=None)
@given(offsets=offsets_strategy, data=st.data())
def test_commit_point_never_passes_an_unresolved_or_failed_offset(offsets: list[int], data: st.DataObject) -> None:
    lane = Lane(epoch=1)
    for offset in offsets:
        assert lane.admit(offset) == 1
    unresolved = set(offsets)
    committed = None
    for _ in range(len(offsets) * 3):
        if not unresolved:
            break
        offset = data.draw(st.sampled_from(sorted(unresolved)))
        if data.draw(st.booleans()):
            lane.settle(offset)
            unresolved.discard(offset)
        else:
            lane.hold(offset, attempts=1)
            # Re-read after a seek-back: only the held offset is re-admitted, the others skipped.
            for other in offsets:
                if other >= offset:
                    attempt = lane.admit(other)
                    assert attempt == (2 if other == offset else 0)
        point = lane.commit_point()
        if point is not None:
            committed = point
        if committed is not None:
            assert all(committed <= o for o in unresolved), (committed, sorted(unresolved))
    if not unresolved:
        final = lane.commit_point()
        committed = final if final is not None else committed
        assert committed == offsets[-1] + 1


def test_gaps_in_offsets_do_not_stall_commits() -> None:
    lane = Lane(epoch=1)
    for offset in (10, 11, 15, 20):  # 12-14 and 16-19 are transaction markers / compacted away
        lane.admit(offset)
    for offset in (20, 10, 15, 11):
        lane.settle(offset)
    assert lane.commit_point() == 21


def test_replay_skips_what_is_in_flight_and_redelivers_only_the_held_offset() -> None:
    lane = Lane(epoch=1)
    for offset in range(5):
        lane.admit(offset)
    lane.settle(0)
    lane.hold(1, attempts=1)
    assert lane.commit_point() == 1
    assert lane.replay_from() == 1
    # 1 comes back as its second attempt, 2-4 are in flight (skipped), 5 is new.
    assert [lane.admit(o) for o in range(1, 6)] == [2, 0, 0, 0, 1]


def test_attempt_counts_ride_in_the_commit_metadata_and_survive_a_restart() -> None:
    lane = Lane(epoch=1)
    for offset in (5, 6):
        lane.admit(offset)
    lane.hold(5, attempts=3)
    lane.settle(6)
    assert lane.commit_point() is None
    assert lane.position() == 5
    restarted = Lane(epoch=2)
    restarted.restore_attempts(lane.commit_metadata())
    assert restarted.attempt_of(5) == 4
    assert restarted.attempt_of(6) == 1
    restarted.restore_attempts("not json")  # metadata written by something else is ignored
    assert restarted.attempt_of(5) == 4
    # The first read in the new session is the attempt after the stored ones.
    assert restarted.admit(5) == 4
    assert restarted.admit(6) == 1
