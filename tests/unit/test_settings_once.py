"""
Each producer setting is written once, in its broker's settings dataclass, and every registry
broker is held to that here (issue 21): every setting reaches ``shared_stream_key()``, and each
trigger's ``__init__`` takes exactly the settings' own fields with the settings' defaults, so the
default a Dag author gets from the trigger is the one the settings (and docs/<broker>.md, checked
by test_docs_options.py) state. Parametrized over :data:`BROKERS`: a new broker is checked without
an edit here, and fails until ``tests/stream_keys.py`` has its :class:`KeyCase`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from airflow_shared_stream_provider.brokers import BROKERS, BrokerSpec, load
from tests.stream_keys import KEY_CASES, assert_every_setting_reaches_the_key

_REQUIRED = object()  # stands for "no default" on either side


def _classes(spec: BrokerSpec) -> tuple[type[SharedStreamTrigger], type[StreamSettings]]:
    trigger_class, settings_class = load(spec.trigger), load(spec.settings)
    assert trigger_class.settings_class is settings_class, f"{spec.trigger} builds another settings class"
    return trigger_class, settings_class


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _REQUIRED


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type: ``1 == 1.0 == True`` would hide an int/float/bool mismatch."""
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("spec", BROKERS, ids=lambda spec: spec.name)
def test_every_setting_reaches_the_key(spec: BrokerSpec) -> None:
    trigger_class, _ = _classes(spec)
    case = KEY_CASES.get(spec.name)
    assert case is not None, f"tests/stream_keys.py KEY_CASES needs an entry for broker {spec.name!r}"
    assert_every_setting_reaches_the_key(trigger_class, case)


def test_key_cases_are_registry_brokers() -> None:
    assert set(KEY_CASES) <= {spec.name for spec in BROKERS}


@pytest.mark.parametrize("spec", BROKERS, ids=lambda spec: spec.name)
def test_trigger_defaults_are_the_settings_defaults(spec: BrokerSpec) -> None:
    """
    The trigger's own parameters are its settings' own fields (the common options arrive through
    ``**options`` and take StreamSettings' defaults), each with the same default, or both required.
    """
    trigger_class, settings_class = _classes(spec)
    params = {
        name: param
        for name, param in inspect.signature(trigger_class.__init__).parameters.items()
        if name != "self" and param.kind is not inspect.Parameter.VAR_KEYWORD
    }
    common = {field.name for field in dataclasses.fields(StreamSettings)}
    own = {field.name: field for field in dataclasses.fields(settings_class) if field.name not in common}
    assert set(params) == set(own), (
        f"trigger parameters that are no setting: {sorted(set(params) - set(own))}; "
        f"settings without a trigger parameter: {sorted(set(own) - set(params))}"
    )
    differ = {}
    for name, param in params.items():
        in_trigger = _REQUIRED if param.default is inspect.Parameter.empty else param.default
        in_settings = _field_default(own[name])
        if not _same(in_trigger, in_settings):
            differ[name] = (in_trigger, in_settings)
    assert not differ, f"{spec.trigger} defaults (trigger, settings) differ: {differ}"
    # The common options' defaults are StreamSettings' (a broker must not shadow them silently).
    for field in dataclasses.fields(settings_class):
        if field.name in common:
            base_field = next(f for f in dataclasses.fields(StreamSettings) if f.name == field.name)
            assert _same(_field_default(field), _field_default(base_field)), (spec.settings, field.name)


@pytest.mark.parametrize("spec", BROKERS, ids=lambda spec: spec.name)
def test_a_trigger_left_at_its_defaults_builds_the_default_settings(spec: BrokerSpec) -> None:
    """What the trigger's body does with its defaults, not only what its signature says."""
    trigger_class, settings_class = _classes(spec)
    base = KEY_CASES[spec.name].base  # the stream's name and connection, every other setting defaulted
    settings = trigger_class(**base).settings
    differ = {
        field.name: (getattr(settings, field.name), _field_default(field))
        for field in dataclasses.fields(settings_class)
        if field.name not in base and not _same(getattr(settings, field.name), _field_default(field))
    }
    assert not differ, f"{spec.trigger} built (value, settings default): {differ}"


@pytest.mark.parametrize("spec", BROKERS, ids=lambda spec: spec.name)
def test_every_text_setting_refuses_empty_text_with_one_clear_error(spec: BrokerSpec) -> None:
    """
    A ``str`` / ``str | None`` field is checked by its type (StreamSettings), not by a line per
    broker: each one, set to "" or blank, fails the trigger with one error that starts with the
    field's name (a broker may check the text's form first, as Pub/Sub does with resource names).
    """
    trigger_class, settings_class = _classes(spec)
    base = KEY_CASES[spec.name].base
    text_fields = [field.name for field in dataclasses.fields(settings_class) if field.type in ("str", "str | None")]
    assert text_fields, f"{spec.settings} has no text settings: the broker names its source with one"
    for name in text_fields:
        for blank in ("", "  "):
            with pytest.raises(SharedStreamConfigError, match=rf"^{name}\b"):
                trigger_class(**{**base, name: blank})


@pytest.mark.parametrize("spec", BROKERS, ids=lambda spec: spec.name)
def test_a_brokers_settings_check_themselves_in_check_not_post_init(spec: BrokerSpec) -> None:
    """StreamSettings.__post_init__ runs the common checks, then check(): an override would skip them."""
    _, settings_class = _classes(spec)
    assert "__post_init__" not in vars(settings_class), f"{spec.settings} overrides __post_init__; write check()"
