"""The check every broker's trigger tests make of ``shared_stream_key()``, written once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger


def assert_every_setting_reaches_the_key(
    trigger_class: type[SharedStreamTrigger], base: Mapping[str, Any], alternatives: Mapping[str, Any]
) -> None:
    """
    ``alternatives`` names every field of the trigger's settings with a value other than
    ``base``'s, and each changes ``shared_stream_key()``, each to a key of its own: a producer
    setting outside the key would let the first subscriber's value win silently.
    """
    names = {f.name for f in dataclasses.fields(trigger_class(**base).settings)}
    assert names == set(alternatives), "a new setting needs an entry here (and a trigger argument)"
    base_key = trigger_class(**base).shared_stream_key()
    keys = {base_key}
    for name, value in alternatives.items():
        key = trigger_class(**{**base, name: value}).shared_stream_key()
        assert key != base_key, f"{name} is not part of the shared_stream_key"
        keys.add(key)
    assert len(keys) == len(alternatives) + 1
