"""
A triggerer that dies, for any broker whose producer gives leases back on close
(``release_on_close``): the same trigger, whose producer releases nothing when it closes, so its
leases just lapse as after a ``kill -9`` and the broker redelivers on its own clock.
"""

from __future__ import annotations

from typing import Any, TypeVar

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from airflow_shared_stream_provider.brokers import broker_spec, load

_TriggerT = TypeVar("_TriggerT", bound=SharedStreamTrigger)


def crashing(trigger: _TriggerT) -> _TriggerT:
    """``trigger`` with a producer that releases nothing on close (its class made once per broker)."""
    broker = trigger.settings_class.broker
    name = f"Crashing{type(trigger).__name__}"
    crashing_class = globals().get(name)
    if crashing_class is None:
        producer = load(broker_spec(broker).producer)
        if not hasattr(producer, "release_on_close"):
            raise TypeError(f"{producer.__name__} gives nothing back on close: it crashes as it is")
        # Module attributes: a re-created trigger (serialize(), then its class path) finds them.
        no_release = f"NoRelease{producer.__name__}"
        globals()[no_release] = type(no_release, (producer,), {"release_on_close": False, "__module__": __name__})
        crashing_class = globals()[name] = type(
            name, (type(trigger),), {"producer_class_path": f"{__name__}.{no_release}", "__module__": __name__}
        )
    _, kwargs = trigger.serialize()
    made: Any = crashing_class(**kwargs)
    return made  # type: ignore[no-any-return]
