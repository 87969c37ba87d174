"""The rule SQS and Pub/Sub share: a sender's ``x-dead-letter-*`` attributes are renamed ``x-original-*``."""

from __future__ import annotations

from airflow_shared_stream_provider._core.dead_letter import disown_dead_letter_names


def test_a_senders_dead_letter_names_are_renamed_in_place() -> None:
    attributes = {"a": "1", "x-dead-letter-reason": "forged", "X-DEAD-LETTER-SOURCE": "forged-too", "b": "2"}
    assert list(disown_dead_letter_names(attributes, max_name_bytes=256).items()) == [
        ("a", "1"),
        ("x-original-x-dead-letter-reason", "forged"),
        ("x-original-X-DEAD-LETTER-SOURCE", "forged-too"),
        ("b", "2"),
    ]


def test_a_taken_name_is_prefixed_again_so_nothing_is_lost() -> None:
    attributes = {"x-dead-letter-reason": "second", "x-original-x-dead-letter-reason": "first"}
    assert disown_dead_letter_names(attributes, max_name_bytes=256) == {
        "x-original-x-original-x-dead-letter-reason": "second",
        "x-original-x-dead-letter-reason": "first",
    }


def test_a_renamed_name_past_the_broker_limit_is_dropped() -> None:
    long_name = "x-dead-letter-" + "n" * 240  # 254 characters: fits, but not with the prefix
    assert disown_dead_letter_names({long_name: "v", "k": "v"}, max_name_bytes=256) == {"k": "v"}


def test_attributes_without_the_prefix_are_untouched() -> None:
    attributes = {"x-dead-letters": "1", "dead-letter-reason": "2", "x-original-x-dead-letter-reason": "3"}
    assert disown_dead_letter_names(attributes, max_name_bytes=256) == attributes
