"""
The receive loop's template (``_core/producer.py``) against the producers of the registry.

Every hook a broker writes (a name of :class:`SharedStreamProducerBase` that the broker's producer
redefines) is listed in the docstring of ``_core/producer.py``, so a maintainer finds them there
and not by reading other brokers; and the template's one override, ``_messages``, stays with the
receive paths that docstring names (Kafka, Service Bus with sessions).
"""

from __future__ import annotations

import pytest

from airflow_shared_stream_provider._core import producer as producer_module
from airflow_shared_stream_provider._core.producer import SharedStreamProducerBase
from airflow_shared_stream_provider.brokers import BROKERS, BrokerSpec, load

by_name = pytest.mark.parametrize("spec", BROKERS, ids=[spec.name for spec in BROKERS])

# The brokers that keep their own receive loop; the docstring says why.
OWN_LOOP = {"kafka", "servicebus"}


def _written_hooks(producer: type) -> set[str]:
    """Names of the base the producer (or a class between it and the base) redefines."""
    base_names = {name for klass in SharedStreamProducerBase.__mro__ for name in vars(klass)}
    written: set[str] = set()
    for klass in producer.__mro__:
        if klass is SharedStreamProducerBase:
            break
        written.update(
            name for name in vars(klass) if name in base_names and not name.startswith("__") and name != "_abc_impl"
        )
    return written


@by_name
def test_every_hook_a_broker_writes_is_listed_in_the_base_docstring(spec: BrokerSpec) -> None:
    producer = load(spec.producer)
    doc = producer_module.__doc__ or ""
    missing = sorted(name for name in _written_hooks(producer) if f"``{name}" not in doc)
    assert not missing, f"{spec.name}: hooks not listed in _core/producer.py's docstring: {missing}"


@by_name
def test_only_the_named_receive_paths_keep_their_own_loop(spec: BrokerSpec) -> None:
    producer = load(spec.producer)
    assert ("_messages" in _written_hooks(producer)) == (spec.name in OWN_LOOP)
