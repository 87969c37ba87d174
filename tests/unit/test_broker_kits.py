"""The per-broker test kits (``devkit.kits``) and the harnesses built on them, without starting a broker."""

from __future__ import annotations

import threading
import typing
from collections.abc import Iterator

import pytest

from airflow_shared_stream_provider.brokers import BROKERS, broker_spec, harness_names
from bench.triggerer_bench import BROKER_CLASSES, BenchBroker
from devkit.demo_streams import STREAMS
from devkit.kits import BrokerKit, KitStream, harness_class, kit_class, paced_chunks


@pytest.mark.parametrize("name", [spec.name for spec in BROKERS])
def test_every_broker_has_a_kit_of_its_name(name: str) -> None:
    kit = kit_class(name)
    assert issubclass(kit, BrokerKit) and kit.name == name


@pytest.mark.parametrize("name", harness_names("bench"))
def test_the_bench_brokers_are_layers_over_the_kit(name: str) -> None:
    bench = BROKER_CLASSES[name]
    assert issubclass(bench, BenchBroker) and bench.name == name and bench.conn_id
    assert isinstance(bench().kit, kit_class(name))


@pytest.mark.parametrize("name", harness_names("demo"))
def test_the_demo_streams_name_their_broker(name: str) -> None:
    assert STREAMS[name].broker == name


def test_a_kit_stream_names_its_source_with_the_registry_s_source_field() -> None:
    for spec in BROKERS:
        stream = typing.get_type_hints(kit_class(spec.name).stream)["return"]
        assert issubclass(stream, KitStream)
        assert stream.source_arg in spec.source_fields, spec.name


def test_harness_class_refuses_a_missing_entry_and_a_wrong_type() -> None:
    assert broker_spec("redis").harness.faults is None
    with pytest.raises(KeyError, match="no faults harness"):
        harness_class("redis", "faults", object)
    with pytest.raises(TypeError, match="is not a BenchBroker"):
        harness_class("kafka", "kit", BenchBroker)


def test_paced_chunks_takes_each_item_only_when_its_chunk_is_due() -> None:
    taken: list[int] = []

    def items() -> Iterator[int]:
        for i in range(7):
            taken.append(i)
            yield i

    chunks = paced_chunks(items(), size=3, rate=None, stop=None)
    assert next(chunks) == [0, 1, 2] and taken == [0, 1, 2]
    assert list(chunks) == [[3, 4, 5], [6]]
    # Paced: one at a time, whatever the size.
    assert list(paced_chunks(range(3), size=10, rate=1000.0, stop=None)) == [[0], [1], [2]]


def test_paced_chunks_ends_once_stop_is_set() -> None:
    stop = threading.Event()
    out = []
    for chunk in paced_chunks(range(10), size=2, rate=None, stop=stop):
        out.append(chunk)
        stop.set()
    assert out == [[0, 1]]
