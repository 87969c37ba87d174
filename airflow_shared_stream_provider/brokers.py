"""
The broker registry: one :class:`BrokerSpec` per broker, and everything that names brokers reads it.

A broker is its own modules (``triggers/<name>.py``, ``producers/<name>.py``, its docs page and
tests) plus **one entry in** :data:`BROKERS`. The lists that used to be kept by hand derive from
this table: the envelope's broker names (:data:`BrokerName`), the source field a stream's logs
name (``_core/trigger.py``), the common-messaging schemes (``queues.py``), the ``integrations`` /
``triggers`` / ``queues`` sections of ``provider.yaml`` (written by ``python -m
scripts.provider_info``, checked by its ``--check``), the import-hygiene test, and the harnesses
(fuzz, kill loop, triggerer bench, demo), which find a broker's entries through :class:`Harness`.
``tests/unit/test_broker_registry.py`` checks every entry against the code it points at.
docs/development.md ("Adding a broker") lists what a new broker writes.

Invariant: this module imports nothing of the package and no broker SDK. Dag files, trigger
modules and ``_core`` import it, so classes are named by dotted path (``module:attribute``) and
loaded on demand with :func:`load`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NewType

BrokerName = NewType("BrokerName", str)
"""
A broker's name: the envelope's ``broker``, the metric prefix, the second item of a stream key.

A ``str`` NewType rather than a ``Literal`` of the registry's names: a Literal would be a second
hand-kept list of brokers in ``_core``, to edit for each new broker. Names are minted in one place
per broker, the ``broker`` ClassVar of its settings class (``BrokerName("kafka")``), and the
registry test checks that each minted name is a registry entry's. Tests may mint names of their
own (``devkit/memory.py``: ``"memory"``), which are not user brokers and are in no list here.
"""


@dataclass(frozen=True)
class Harness:
    """
    Where a broker's test kit and harness entries live, as ``module:attribute`` paths (or a module
    path for a test module); ``None`` where the broker has none. A harness builds its
    ``name -> entry`` table from these (:func:`harness_entries`), so a new broker's entries can
    live in its own files.
    """

    local_broker: str | None = None  # starts the local broker process (devkit)
    kit: str | None = None  # BrokerKit (devkit/kits/<name>.py): what the demo, kill-loop and bench harnesses build on
    contract: str | None = None  # the broker's run of the contract suite (tests/integration/contract.py)
    fuzz: str | None = None  # hostile-corpus fuzz target (tests/integration/fuzz.py)
    faults: str | None = None  # broker fault tests (tests/integration/faults_harness.py)
    kill_loop: str | None = None  # LoopBroker (tests/e2e/loop_brokers.py, the kill-loop Dag)
    bench: str | None = None  # BenchBroker (bench/triggerer_bench.py; bench/stream_bench.py runs over it too)
    demo: str | None = None  # DemoStream (devkit/demo_streams.py, ``devkit.demo --broker``)


@dataclass(frozen=True)
class BrokerSpec:
    """One broker, as every list in the project sees it. Paths are ``module:attribute``."""

    name: BrokerName
    settings: str  # the StreamSettings subclass; its ``broker`` ClassVar is ``name``
    trigger: str  # importable by users as ``airflow_shared_stream_provider.triggers.<name>``
    producer: str  # the trigger's ``producer_class_path``; imports the SDK (the triggerer only)
    queue_provider: str  # the common-messaging provider of ``queue_scheme`` (listed in provider.yaml)
    extra: str  # ``pip install 'airflow-shared-stream-provider[<extra>]'`` installs the SDK
    sdk_modules: tuple[str, ...]  # module prefixes of the SDK: never loaded by the trigger module
    queue_scheme: str  # ``MessageQueueTrigger(scheme=...)``: ``shared+<name>``
    source_fields: tuple[str, ...]  # settings fields naming the stream's source, first set wins
    connection_type: str  # the upstream provider's connection type the producer reads
    conn_id_arg: str  # the trigger argument naming that connection
    default_conn_id: str  # its default
    integration_name: str  # provider.yaml integrations / triggers
    external_doc_url: str
    tags: tuple[str, ...]
    harness: Harness = field(default_factory=Harness)

    @property
    def trigger_module(self) -> str:
        return self.trigger.partition(":")[0]

    @property
    def trigger_path(self) -> str:
        """The trigger's dotted class path, as Airflow serialises it."""
        return self.trigger.replace(":", ".")

    @property
    def producer_path(self) -> str:
        return self.producer.replace(":", ".")

    @property
    def queue_provider_path(self) -> str:
        return self.queue_provider.replace(":", ".")


_PKG: Final = "airflow_shared_stream_provider"

BROKERS: Final[tuple[BrokerSpec, ...]] = (
    BrokerSpec(
        name=BrokerName("kafka"),
        settings=f"{_PKG}.triggers.kafka:KafkaStreamSettings",
        trigger=f"{_PKG}.triggers.kafka:KafkaSharedStreamTrigger",
        producer=f"{_PKG}.producers.kafka:KafkaSharedStreamProducer",
        queue_provider=f"{_PKG}.queues:KafkaSharedStreamQueueProvider",
        extra="kafka",
        sdk_modules=("aiokafka",),
        queue_scheme="shared+kafka",
        source_fields=("topics",),
        connection_type="kafka",
        conn_id_arg="kafka_config_id",
        default_conn_id="kafka_default",
        integration_name="Shared Stream Kafka",
        external_doc_url="https://kafka.apache.org/",
        tags=("software",),
        harness=Harness(
            local_broker="devkit.brokers:start_kafka",
            kit="devkit.kits.kafka:KafkaKit",
            contract="tests.integration.kafka.test_kafka_contract",
            fuzz="tests.integration.kafka.test_fuzz",
            faults="tests.integration.test_broker_faults",
            kill_loop="tests.e2e.loop_brokers:KafkaLoop",
            bench="bench.triggerer_bench:KafkaBroker",
            demo="devkit.demo_streams:KafkaDemoStream",
        ),
    ),
    BrokerSpec(
        name=BrokerName("sqs"),
        settings=f"{_PKG}.triggers.sqs:SqsStreamSettings",
        trigger=f"{_PKG}.triggers.sqs:SqsSharedStreamTrigger",
        producer=f"{_PKG}.producers.sqs:SqsSharedStreamProducer",
        queue_provider=f"{_PKG}.queues:SqsSharedStreamQueueProvider",
        extra="sqs",
        sdk_modules=("aiobotocore", "botocore"),
        queue_scheme="shared+sqs",
        source_fields=("queue_url",),
        connection_type="aws",
        conn_id_arg="aws_conn_id",
        default_conn_id="aws_default",
        integration_name="Shared Stream Amazon SQS",
        external_doc_url="https://aws.amazon.com/sqs/",
        tags=("aws",),
        harness=Harness(
            local_broker="devkit.brokers:start_moto",
            kit="devkit.kits.sqs:SqsKit",
            contract="tests.integration.sqs.test_sqs_contract",
            fuzz="tests.integration.sqs.test_fuzz",
            faults="tests.integration.test_broker_faults",
            kill_loop="tests.e2e.loop_brokers:SqsLoop",
            bench="bench.triggerer_bench:SqsBroker",
            demo="devkit.demo_streams:SqsDemoStream",
        ),
    ),
    BrokerSpec(
        name=BrokerName("pubsub"),
        settings=f"{_PKG}.triggers.pubsub:PubSubStreamSettings",
        trigger=f"{_PKG}.triggers.pubsub:PubSubSharedStreamTrigger",
        producer=f"{_PKG}.producers.pubsub:PubSubSharedStreamProducer",
        queue_provider=f"{_PKG}.queues:PubSubSharedStreamQueueProvider",
        extra="pubsub",
        sdk_modules=("google.cloud.pubsub", "google.pubsub"),
        queue_scheme="shared+pubsub",
        source_fields=("subscription",),
        connection_type="google_cloud_platform",
        conn_id_arg="gcp_conn_id",
        default_conn_id="google_cloud_default",
        integration_name="Shared Stream Google Pub/Sub",
        external_doc_url="https://cloud.google.com/pubsub",
        tags=("gcp",),
        harness=Harness(
            local_broker="devkit.brokers:start_pubsub_emulator",
            kit="devkit.kits.pubsub:PubSubKit",
            contract="tests.integration.pubsub.test_pubsub_contract",
            fuzz="tests.integration.pubsub.test_fuzz",
            faults="tests.integration.test_broker_faults_pubsub_servicebus",
            kill_loop="tests.e2e.loop_brokers:PubSubLoop",
            bench="bench.triggerer_bench:PubSubBroker",
            demo="devkit.demo_streams:PubSubDemoStream",
        ),
    ),
    BrokerSpec(
        name=BrokerName("servicebus"),
        settings=f"{_PKG}.triggers.servicebus:ServiceBusStreamSettings",
        trigger=f"{_PKG}.triggers.servicebus:ServiceBusSharedStreamTrigger",
        producer=f"{_PKG}.producers.servicebus:ServiceBusSharedStreamProducer",
        queue_provider=f"{_PKG}.queues:ServiceBusSharedStreamQueueProvider",
        extra="servicebus",
        sdk_modules=("azure.servicebus",),
        queue_scheme="shared+servicebus",
        source_fields=("queue_name", "topic_name"),
        connection_type="azure_service_bus",
        conn_id_arg="azure_service_bus_conn_id",
        default_conn_id="azure_service_bus_default",
        integration_name="Shared Stream Azure Service Bus",
        external_doc_url="https://azure.microsoft.com/products/service-bus",
        tags=("azure",),
        harness=Harness(
            local_broker="tests.servicebus_broker.broker:start_broker",
            kit="devkit.kits.servicebus:ServiceBusKit",
            contract="tests.integration.servicebus.test_servicebus_contract",
            fuzz="tests.integration.servicebus.test_fuzz",
            faults="tests.integration.test_broker_faults_pubsub_servicebus",
            kill_loop="tests.e2e.loop_brokers:ServiceBusLoop",
            bench="bench.triggerer_bench:ServiceBusBroker",
            demo="devkit.servicebus_demo:ServiceBusDemoStream",
        ),
    ),
    BrokerSpec(
        name=BrokerName("redis"),
        settings=f"{_PKG}.triggers.redis:RedisStreamSettings",
        trigger=f"{_PKG}.triggers.redis:RedisSharedStreamTrigger",
        producer=f"{_PKG}.producers.redis:RedisSharedStreamProducer",
        queue_provider=f"{_PKG}.triggers.redis:RedisSharedStreamQueueProvider",
        extra="redis",
        sdk_modules=("redis", "hiredis"),
        queue_scheme="shared+redis",
        source_fields=("stream",),
        connection_type="redis",
        conn_id_arg="redis_conn_id",
        default_conn_id="redis_default",
        integration_name="Shared Stream Redis Streams",
        external_doc_url="https://redis.io/docs/latest/develop/data-types/streams/",
        tags=("software",),
        harness=Harness(
            local_broker="devkit.redis_broker:start_redis",
            kit="devkit.kits.redis:RedisKit",
            contract="tests.integration.redis.test_redis_contract",
            fuzz="tests.integration.redis.test_fuzz",
            faults=None,  # redis-server restart and outage: tests/integration/redis/test_redis_specific.py
            kill_loop="tests.e2e.redis_loop:RedisLoop",
            bench="bench.redis_bench:RedisBroker",
            demo="devkit.redis_demo:RedisDemoStream",
        ),
    ),
)
"""Every user broker, in the order lists and docs show them."""

_BY_NAME: Final[dict[str, BrokerSpec]] = {spec.name: spec for spec in BROKERS}
if len(_BY_NAME) != len(BROKERS):  # a duplicated name would make one entry silently win
    raise RuntimeError("airflow_shared_stream_provider.brokers: two registry entries share a name")

BROKER_NAMES: Final[tuple[BrokerName, ...]] = tuple(spec.name for spec in BROKERS)


def broker_spec(name: str) -> BrokerSpec:
    """The entry of broker ``name``; ``KeyError`` naming the known brokers if there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no broker {name!r} in the registry (known: {', '.join(BROKER_NAMES)})") from None


def find_broker(name: str) -> BrokerSpec | None:
    """The entry of broker ``name``, or None (a test broker such as ``devkit/memory.py``'s)."""
    return _BY_NAME.get(name)


def load(path: str) -> Any:
    """The object a ``module:attribute`` path names (a plain dotted module path: the module)."""
    module, _, attribute = path.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def harness_entries(kind: str) -> Iterator[tuple[BrokerName, str]]:
    """``(broker, path)`` of every broker that has a ``kind`` harness entry (a :class:`Harness` field)."""
    for spec in BROKERS:
        path = getattr(spec.harness, kind)
        if path is not None:
            yield spec.name, path


def harness_names(kind: str) -> tuple[BrokerName, ...]:
    """The brokers with a ``kind`` harness entry, without importing any of them."""
    return tuple(name for name, _ in harness_entries(kind))


class HarnessTable(Mapping[str, Any]):
    """
    ``broker name -> harness entry`` for one :class:`Harness` field, each entry loaded on first
    lookup: a harness lists every broker without importing their SDKs or test brokers.
    """

    def __init__(self, kind: str) -> None:
        if kind not in {f.name for f in dataclasses.fields(Harness)}:
            raise ValueError(f"no harness kind {kind!r} (a field of Harness)")
        self.kind = kind
        self._paths: dict[str, str] = dict(harness_entries(kind))

    def __getitem__(self, name: str) -> Any:
        path = self._paths.get(name)
        if path is None:
            raise KeyError(f"broker {name!r} has no {self.kind} harness (known: {', '.join(self._paths)})")
        return load(path)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def sdk_module_prefixes() -> tuple[str, ...]:
    """Every broker SDK's module prefixes: what Dag files, trigger modules and ``_core`` never import."""
    return tuple(prefix for spec in BROKERS for prefix in spec.sdk_modules)
