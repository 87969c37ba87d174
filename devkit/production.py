"""
A production topology on one machine, started by one command::

    .venv/bin/python -m devkit.production --brokers kafka,sqs,pubsub,redis,servicebus   # Ctrl-C stops it

What runs, each as a process of its own on loopback (picture and advice: docs/production.md):

* **PostgreSQL 15** as the metadata DB (:class:`devkit.postgres.PostgresServer`);
* **Airflow 3.3**: ``db migrate``, api-server, scheduler (LocalExecutor), dag-processor and **two
  triggerers**, with Airflow's default ``[triggerer]`` settings (``devkit.airflow_env`` lowers only
  the health-check threshold, so a killed triggerer is noticed in 10 s instead of 30);
* the **local brokers** of the example Dags (``devkit.demo_streams.STREAMS``: Tansu for Kafka,
  moto for SQS, Google's Pub/Sub emulator, redis-server, the Service Bus test broker), each with its
  ``orders`` source and dead-letter destination;
* a **Spark standalone cluster**: a master and two workers (:class:`devkit.spark_cluster.SparkCluster`);
  every broker's ``<broker>_orders_spark_pipeline`` Dag runs its ``@task.pyspark`` on it, one core
  per application so that every broker's pipeline can run at once;
* every broker's example Dags (``example_dags/example_<broker>_orders.py``): four watchers on one
  shared stream per broker, three consumer Dags and the PySpark pipeline.

How the two triggerers share the watchers (Airflow 3.3.2 cannot pin a watcher to a triggerer;
``../shared/notes/airflow-3.3-facts.md`` section 2):

* ``kafka-ha`` (only Kafka in the topology): both triggerers take watchers. The first one's
  ``capacity`` is half the watchers, so the stream is split between them from the start; Kafka's
  ``position_store="watchers"`` keeps each watcher's own position, so a split and every takeover
  after a kill lose nothing (tests/e2e/test_two_triggerers_e2e.py).
* ``recipe`` (any queue broker in the topology): a split of a queue broker's stream loses messages
  for watchers (its two consumers compete), so the tested recipe applies: ``[triggerer]
  queues_enabled`` and the second triggerer started with ``--queues standby``. It never takes an
  asset watcher (watchers have no queue) and serves deferred tasks only; every watcher runs in the
  first one, which a supervisor restarts when it dies (the chaos run does so).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Literal

from devkit.airflow_env import AirflowEnv
from devkit.demo import DEFAULT_MAX_PAYLOAD_BYTES, SPARK_LOCAL_CONNECTION, build_dags_folder, expected_watchers
from devkit.demo_streams import STREAMS, DemoStream, KafkaDemoStream
from devkit.demo_types import WATCHERS, OrderMessage
from devkit.postgres import FAST_SETTINGS, PostgresServer
from devkit.spark_cluster import SparkCluster

SPARK_CONN_ID: Final = "spark_orders"
STANDBY_QUEUE: Final = "standby"  # the second triggerer's queue in the recipe: no watcher has it
SECOND_TRIGGERER: Final = "triggerer-b"
QUEUE_BROKERS: Final = frozenset({"sqs", "pubsub", "servicebus", "redis"})
# The latency pair (devkit/dags/kafka_latency_pair.py): asset name == watcher name, and each
# asset's consumer Dag is "<asset>_consumer" with one task, ``handle_orders``.
DEVKIT_DAGS: Final = Path(__file__).resolve().parent / "dags"
LATENCY_PAIR_FILE: Final = DEVKIT_DAGS / "kafka_latency_pair.py"
# More watchers on the example Kafka stream (devkit/dags/kafka_more_watchers.py), each with a
# one-task consumer Dag "<asset>_consumer" (devkit/dags/light_consumer.py, which both files import).
MORE_WATCHERS_FILE: Final = DEVKIT_DAGS / "kafka_more_watchers.py"
LIGHT_CONSUMER_FILE: Final = DEVKIT_DAGS / "light_consumer.py"
# Each extra watcher's ``match`` on body.region (kafka_more_watchers.REGION_SETS: the same list).
MORE_WATCHER_REGIONS: Final = (
    ("us",),
    ("apac",),
    ("eu", "us"),
    ("apac", "eu"),
    ("apac", "eu", "us"),
    ("eu", "us", "apac", "latam"),
)
UPSTREAM_ASSET: Final = "upstream_kafka_orders"
OURS_N1_ASSET: Final = "ours_kafka_orders_n1"
LATENCY_PAIR: Final = (UPSTREAM_ASSET, OURS_N1_ASSET)
UPSTREAM_CONN_ID: Final = "kafka_upstream"


def pair_dag(asset: str) -> str:
    """The one-task consumer Dag of a latency-pair or extra watcher's asset (light_consumer.py)."""
    return f"{asset}_consumer"


@dataclass(frozen=True)
class MessageFacts:
    """What the filters look at in one message, worked out once (a run checks ~10^5 messages x 10 watchers)."""

    fired: frozenset[str]  # the example watchers that must fire (devkit.demo.expected_watchers)
    region: Any  # body.region; None when the body is no JSON object or the message is oversize

    @classmethod
    def of(cls, message: OrderMessage) -> MessageFacts:
        fired, _ = expected_watchers(message)
        body = message.body()
        oversize = len(message.value) + 1024 > DEFAULT_MAX_PAYLOAD_BYTES  # dead-lettered, fires nothing
        region = body.get("region") if isinstance(body, dict) and not oversize else None
        return cls(frozenset(fired), region)


@dataclass(frozen=True)
class WatcherRole:
    """
    What a watcher must fire on, written from the documented filter semantics: the same as an
    example watcher (``example``: its Kafka name, see :func:`devkit.demo.expected_watchers`), or
    every order whose ``region`` is one of ``regions`` (a ``match`` on ``body.region``).
    """

    example: str | None = None
    regions: tuple[str, ...] = ()

    def fires(self, facts: MessageFacts) -> bool:
        if self.example is not None:
            return self.example in facts.fired
        return facts.region in self.regions


def more_watchers(count: int) -> dict[str, WatcherRole]:
    """``watcher -> role`` of ``kafka_more_watchers.py`` with ``$ORDERS_MORE_WATCHERS=count``."""
    if not 0 <= count <= len(MORE_WATCHER_REGIONS):
        raise ValueError(f"more watchers: 0 to {len(MORE_WATCHER_REGIONS)} (one distinct filter each); got {count}")
    return {
        f"kafka_orders_more_{i + 1:02d}": WatcherRole(regions=regions)
        for i, regions in enumerate(MORE_WATCHER_REGIONS[:count])
    }


HaMode = Literal["kafka-ha", "recipe"]


CONSUMER_POOL: Final = "light_consumers"
# A cluster policy (Airflow applies it to every task it parses): every task of a Dag that is not a
# PySpark pipeline runs in CONSUMER_POOL. The pool must exist before such a task is scheduled.
CONSUMER_POOL_POLICY: Final = f"""\
# Written by devkit.production (consumer_pool_slots): the light consumer Dags share one pool.
PIPELINE_SUFFIX = "_spark_pipeline"


def task_policy(task):
    if not task.dag_id.endswith(PIPELINE_SUFFIX):
        task.pool = {CONSUMER_POOL!r}
"""


def write_consumer_pool_policy(airflow_home: Path) -> Path:
    """Write :data:`CONSUMER_POOL_POLICY` to ``AIRFLOW_HOME/config/airflow_local_settings.py`` (on sys.path)."""
    path = airflow_home / "config" / "airflow_local_settings.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CONSUMER_POOL_POLICY)
    return path


# Airflow's object-storage XCom backend (apache-airflow-providers-common-io): an XCom of at least
# XCOM_OBJECT_STORAGE_THRESHOLD bytes is written by the task process itself to a file under the
# configured path, and only that path goes through the Execution API into the metadata DB.
XCOM_OBJECT_STORAGE_BACKEND: Final = "airflow.providers.common.io.xcom.backend.XComObjectStorageBackend"
XCOM_OBJECT_STORAGE_THRESHOLD: Final = 64 * 1024


def xcom_object_storage_config(
    root: Path | str, threshold: int = XCOM_OBJECT_STORAGE_THRESHOLD
) -> dict[str, dict[str, object]]:
    """
    The ``[core]`` and ``[common.io]`` options that keep large XComs out of the metadata DB.

    The pipeline's ``extract`` hands its batch to ``aggregate`` as an XCom. At 100 orders/s a run
    that caught up after a slow one carried ~40,000 rows (~6 MB of JSON); through the Execution
    API that push passed the API's 5 s timeout on a loaded machine, the task was killed after four
    retries, and the next run carried its rows too (the 30-minute run of docs/production.md).
    ``root`` is a directory (or ``s3://``/``gs://`` URL, any fsspec path) every worker can read;
    ``threshold``: the smallest XCom, in bytes of JSON, written there (0: every one).
    """
    path = root.as_uri() if isinstance(root, Path) else root
    return {
        "core": {"xcom_backend": XCOM_OBJECT_STORAGE_BACKEND},
        "common.io": {
            "xcom_objectstorage_path": path,
            "xcom_objectstorage_threshold": threshold,
            "xcom_objectstorage_compression": "gzip",
        },
    }


def ha_mode_for(brokers: Sequence[str]) -> HaMode:
    """``kafka-ha`` when every broker tolerates a split stream (Kafka only), else ``recipe``."""
    return "recipe" if QUEUE_BROKERS.intersection(brokers) else "kafka-ha"


def upstream_kafka_connection(bootstrap: str) -> dict[str, Any]:
    """What the upstream Kafka provider's shared stream requires: a group id of its own, no auto-commit."""
    extra = {
        "bootstrap.servers": bootstrap,
        "auto.offset.reset": "earliest",
        "group.id": "airflow-upstream-kafka-orders",
        "enable.auto.commit": "false",
    }
    return {"conn_type": "kafka", "extra": extra}


@dataclass
class ProductionTopology:
    """
    Everything of the module docstring, started by :meth:`start` and stopped by :meth:`stop`
    (context manager). Attributes are usable once started: :attr:`env` (the Airflow),
    :attr:`streams` (broker name -> its :class:`DemoStream`), :attr:`spark`, :attr:`postgres`.

    :param brokers: registry broker names with a demo stream, e.g. ``("kafka", "sqs")``.
    :param workdir: where everything writes (Dags, ``AIRFLOW_HOME``, the pipeline's output).
    :param spark: ``standalone`` (master + 2 workers) or ``local`` (``local[2]`` in the task).
    :param batch_size: the watchers' ``batch_size`` (1: one asset event per message).
    :param batch_timeout: the watchers' ``batch_timeout`` in seconds (None: the trigger's default).
    :param max_payload_bytes: the watchers' ``max_payload_bytes`` (None: the trigger's default, 64 KiB).
    :param durable_db: PostgreSQL with its default durability (fsync on); ``False`` uses the test
        suite's ``FAST_SETTINGS`` (a crash of the *machine* could lose commits; a killed Airflow
        process cannot).
    :param startup_timeout: seconds for each start-up wait.
    :param upstream_kafka: also run the latency pair on the Kafka broker's topic
        (``devkit/dags/kafka_latency_pair.py``): the upstream Kafka provider's shared stream and
        ours, one watcher each in a consumer group of its own, the same one-task consumer Dag;
        the comparison of docs/production.md.
    :param pipeline: load the brokers' example Dags (watchers, consumers, the PySpark pipeline).
        ``False`` (only with ``upstream_kafka``) leaves the latency pair alone on the machine: the
        brokers, PostgreSQL, Spark and both triggerers still run.
    :param more_watchers: that many more watchers on the example Kafka stream (only with Kafka
        and the pipeline; ``devkit/dags/kafka_more_watchers.py``), each with a one-task consumer
        Dag: the example's 4 plus 6 are issue 23's "10 watchers".
    :param kafka_storage: Tansu's storage, ``memory`` or ``s3`` (a local moto server; the one
        where ``restart-broker`` restarts Kafka with its data, ``devkit.kits.kafka``).
    :param ha: ``kafka-ha`` or ``recipe`` (module docstring); default: :func:`ha_mode_for` the brokers.
        ``recipe`` with Kafka alone is allowed (every watcher in one triggerer); ``kafka-ha`` with a
        queue broker is refused (its stream would split: loss by design).
    :param task_heartbeat_timeout: ``[scheduler] task_instance_heartbeat_timeout`` (Airflow's
        default: 300 s). A ``kill -9`` of the scheduler takes the LocalExecutor's running tasks
        with it (its process group), and the new scheduler fails and retries them only after this
        long: 60 s keeps the chaos run's recovery short. ``[scheduler] orphaned_tasks_check_interval``
        (default 300 s) gets the same value: a scheduler started right after a killed one resets
        the killed one's tasks only at that check. ``[triggerer]`` stays at Airflow's defaults.
    :param consumer_pool_slots: run the light consumer Dags' tasks (every Dag but the PySpark
        pipelines) in a pool of this many slots (:data:`CONSUMER_POOL`, set by a cluster policy in
        ``AIRFLOW_HOME/config/airflow_local_settings.py``; the example Dags stay as they are).
        None: Airflow's ``default_pool`` for all. On one small machine the consumer Dags of many
        watchers each run a task per stored event, back to back (each a process that loads
        Airflow), and take the CPU the pipeline's Spark job needs; a pool is how one Airflow keeps
        them from it (on a real deployment: another worker queue, docs/production.md).
    :param xcom_object_storage_threshold: XComs of this many bytes or more (64 KiB by default; 0:
        every one) go to files under ``<workdir>/xcom`` (:func:`xcom_object_storage_config`, the
        deployment advice of docs/production.md) instead of through the Execution API into the
        metadata DB; None: Airflow's default backend (every XCom in the DB).
    """

    brokers: Sequence[str]
    workdir: Path
    spark: Literal["standalone", "local"] = "standalone"
    batch_size: int = 1
    batch_timeout: float | None = None
    max_payload_bytes: int | None = None
    durable_db: bool = True
    startup_timeout: float = 420.0
    upstream_kafka: bool = False
    pipeline: bool = True
    more_watchers: int = 0
    task_heartbeat_timeout: int = 60
    ha: HaMode | None = None
    kafka_storage: Literal["memory", "s3"] = "memory"
    consumer_pool_slots: int | None = None
    xcom_object_storage_threshold: int | None = XCOM_OBJECT_STORAGE_THRESHOLD

    streams: dict[str, DemoStream[Any]] = field(default_factory=dict, init=False)
    postgres: PostgresServer | None = field(default=None, init=False)
    spark_cluster: SparkCluster | None = field(default=None, init=False)
    _env: AirflowEnv | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        unknown = [name for name in self.brokers if name not in STREAMS]
        if unknown or not self.brokers:
            raise ValueError(f"brokers must be some of {sorted(STREAMS)}; got {list(self.brokers)}")
        if self.ha == "kafka-ha" and ha_mode_for(self.brokers) != "kafka-ha":
            raise ValueError("kafka-ha splits streams between triggerers: only with Kafka alone")
        if self.upstream_kafka and "kafka" not in self.brokers:
            raise ValueError("upstream_kafka compares on the kafka broker's topic: add kafka to brokers")
        if not self.pipeline and not self.upstream_kafka:
            raise ValueError("without the pipeline the topology runs only the latency pair: add upstream_kafka")
        more_watchers(self.more_watchers)  # in range, else one clear error
        if self.more_watchers and ("kafka" not in self.brokers or not self.pipeline):
            raise ValueError("more_watchers join the example Kafka stream: only with kafka and the pipeline")
        if self.consumer_pool_slots is not None and self.consumer_pool_slots < 1:
            raise ValueError(f"consumer_pool_slots must be at least 1, got {self.consumer_pool_slots}")

    # -- what runs --------------------------------------------------------------------------------
    @property
    def env(self) -> AirflowEnv:
        if self._env is None:
            raise RuntimeError("the topology is not started")
        return self._env

    @property
    def ha_mode(self) -> HaMode:
        return self.ha or ha_mode_for(self.brokers)

    @property
    def output_dir(self) -> Path:
        """The pipeline's Parquet datasets: ``<output_dir>/<broker>/order_lines`` etc."""
        return self.workdir / "output"

    def watcher_roles(self, broker: str) -> dict[str, WatcherRole]:
        """
        ``watcher -> role`` of every watcher on ``broker``'s example stream: the example's own
        (the Kafka example's watcher of the same filter, as ``DemoStream.watcher_name`` maps it)
        and, on Kafka, the :attr:`more_watchers`.
        """
        stream = self.streams[broker]
        roles = {stream.watcher_name(role): WatcherRole(example=role) for role in WATCHERS}
        if broker == "kafka":
            roles.update(more_watchers(self.more_watchers))
        return roles

    def watchers(self, broker: str | None = None) -> tuple[str, ...]:
        """Every watcher on ``broker``'s example stream (default: every broker's, plus the latency pair's)."""
        names = ([broker] if broker else list(self.brokers)) if self.pipeline else []
        extra = LATENCY_PAIR if self.upstream_kafka and broker is None else ()
        return tuple(watcher for name in names for watcher in self.watcher_roles(name)) + extra

    def consumer_dags(self, broker: str | None = None) -> tuple[str, ...]:
        names = ([broker] if broker else list(self.brokers)) if self.pipeline else []
        extra = tuple(map(pair_dag, LATENCY_PAIR)) if self.upstream_kafka and broker is None else ()
        more = tuple(map(pair_dag, more_watchers(self.more_watchers))) if "kafka" in names else ()
        return tuple(dag_id for name in names for dag_id in self.streams[name].consumer_dags) + more + extra

    def devkit_dag_files(self) -> tuple[Path, ...]:
        """The Dag files of ``devkit/dags`` this topology copies beside the example Dags."""
        files: tuple[Path, ...] = (LATENCY_PAIR_FILE,) if self.upstream_kafka else ()
        files += (MORE_WATCHERS_FILE,) if self.more_watchers else ()
        return (*files, LIGHT_CONSUMER_FILE) if files else ()

    def describe(self) -> str:
        env = self.env
        lines = [
            f"metadata DB      : {self.postgres.url if self.postgres else 'SQLite'}",
            f"Airflow UI / API : {env.login_hint()}",
            f"triggerers       : triggerer + {SECOND_TRIGGERER} ({self.ha_mode})",
            f"Spark            : {self.spark_cluster.master_ui_url if self.spark_cluster else 'local[2]'}",
            f"output           : {self.output_dir}",
            f"process logs     : {env.airflow_home / 'process-logs'}",
        ]
        lines += [f"{name:<17}: {stream.source_label}, DLQ {stream.dlq_label}" for name, stream in self.streams.items()]
        return "\n".join(lines)

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> ProductionTopology:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, say: Any = print) -> None:
        """Start the brokers, PostgreSQL, Spark and Airflow; return once every watcher runs."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The Kafka demo stream reads its storage from the environment (so does the demo's).
        os.environ[KafkaDemoStream.storage_env] = self.kafka_storage
        for name in self.brokers:
            stream = STREAMS[name]()
            self.streams[name] = stream
            say(f"  {name}: {stream.start()}")
        self.postgres = PostgresServer(settings={} if self.durable_db else FAST_SETTINGS)
        self.postgres.start()
        say(f"  PostgreSQL: {self.postgres.url}")
        spark_connection: Mapping[str, Any] = SPARK_LOCAL_CONNECTION
        if self.spark == "standalone":
            # One core per application: each broker's pipeline gets one, so they run side by side
            # on the 2 x 2 worker cores instead of the first taking them all.
            self.spark_cluster = SparkCluster(workers=2, worker_cores=2, connect=False)
            self.spark_cluster.start()
            spark_connection = self.spark_cluster.standalone_connection(**{"spark.cores.max": "1"})
            say(f"  Spark: {self.spark_cluster.master_url} (UI {self.spark_cluster.master_ui_url})")
        pipelines = self.streams.values() if self.pipeline else ()
        dag_files = tuple(dict.fromkeys(f for stream in pipelines for f in stream.dag_files))
        dags = build_dags_folder(self.workdir / "dags", files=dag_files, extra=self.devkit_dag_files())
        connections: dict[str, Any] = {SPARK_CONN_ID: dict(spark_connection)}
        if self.upstream_kafka:
            connections[UPSTREAM_CONN_ID] = upstream_kafka_connection(self.streams["kafka"].orders.bootstrap)
        dag_env: dict[str, str] = {
            "ORDERS_OUTPUT_DIR": str(self.output_dir),
            "ORDERS_SPARK_CONN_ID": SPARK_CONN_ID,
            "ORDERS_BATCH_SIZE": str(self.batch_size),
            "ORDERS_BATCH_TIMEOUT": "" if self.batch_timeout is None else str(self.batch_timeout),
            "ORDERS_MAX_PAYLOAD_BYTES": "" if self.max_payload_bytes is None else str(self.max_payload_bytes),
            "ORDERS_MORE_WATCHERS": str(self.more_watchers),
        }
        for stream in self.streams.values():
            connections.update(stream.connections())
            dag_env.update(stream.dag_env())
        watchers = self.watchers()
        triggerer: dict[str, object] = {}
        if self.ha_mode == "recipe":
            triggerer["queues_enabled"] = True
        else:
            # Half the watchers each: the stream is split between the triggerers from the start.
            triggerer["capacity"] = max(1, math.ceil(len(watchers) / 2))
        config: dict[str, dict[str, object]] = {
            "scheduler": {
                "task_instance_heartbeat_timeout": self.task_heartbeat_timeout,
                # The new scheduler resets a dead one's running tasks at start-up only if that
                # one's heartbeat is already stale, else at the next check (300 s by default).
                "orphaned_tasks_check_interval": self.task_heartbeat_timeout,
            }
        }
        xcom_root = self.xcom_root
        if xcom_root is not None and self.xcom_object_storage_threshold is not None:
            xcom_root.mkdir(parents=True, exist_ok=True)
            config.update(xcom_object_storage_config(xcom_root, self.xcom_object_storage_threshold))
            say(f"  XComs of {self.xcom_object_storage_threshold} bytes or more: files under {xcom_root}")
        self._env = AirflowEnv(
            dags,
            connections=connections,
            env=dag_env,
            triggerer=triggerer,
            config=config,
            home=self.workdir / "airflow-home",
            sql_alchemy_conn=self.postgres.url,
            startup_timeout=self.startup_timeout,
        )
        if self.consumer_pool_slots is not None:
            write_consumer_pool_policy(self._env.airflow_home)
        self._env.start()
        say(f"  Airflow: {self._env.login_hint()}")
        if self.consumer_pool_slots is not None:
            self._env.api(
                "POST",
                "/api/v2/pools",
                json={
                    "name": CONSUMER_POOL,
                    "slots": self.consumer_pool_slots,
                    "description": "the light consumer Dags (devkit.production, consumer_pool_slots)",
                    "include_deferred": False,
                },
            )
            say(f"  pool {CONSUMER_POOL}: {self.consumer_pool_slots} slot(s) for the light consumer Dags")
        second_args = ("--queues", STANDBY_QUEUE) if self.ha_mode == "recipe" else ()
        # The second triggerer takes what the first leaves (kafka-ha) or nothing but deferred
        # tasks (recipe): its capacity is Airflow's default either way.
        self._env.add_triggerer(SECOND_TRIGGERER, {"capacity": 1000}, args=second_args)
        dag_ids = self.consumer_dags()
        self._env.wait_for_dags(dag_ids, timeout=self.startup_timeout)
        self._env.unpause(dag_ids)
        self._env.wait_for_watchers(watchers, timeout=self.startup_timeout)
        say(f"  {len(dag_ids)} Dags unpaused; {len(watchers)} watchers running")

    @property
    def xcom_root(self) -> Path | None:
        """Where large XComs are written (None: every XCom is in the metadata DB)."""
        return None if self.xcom_object_storage_threshold is None else self.workdir / "xcom"

    @classmethod
    def from_args(cls, args: argparse.Namespace, brokers: Sequence[str], workdir: Path) -> ProductionTopology:
        """The topology :func:`add_topology_arguments`' options describe."""
        return cls(
            brokers=brokers,
            workdir=workdir,
            spark=args.spark,
            batch_size=args.batch_size,
            batch_timeout=args.batch_timeout,
            max_payload_bytes=args.max_payload_bytes,
            upstream_kafka=args.upstream_kafka,
            pipeline=args.pipeline,
            more_watchers=args.more_watchers,
            ha=args.ha,
            kafka_storage=args.kafka_storage,
            consumer_pool_slots=args.consumer_pool_slots,
            xcom_object_storage_threshold=None
            if args.xcom_object_storage_threshold < 0
            else args.xcom_object_storage_threshold,
        )

    def stop(self) -> None:
        if self._env is not None:
            self._env.stop()
        for stream in self.streams.values():
            stream.stop()
        if self.spark_cluster is not None:
            self.spark_cluster.stop()
        if self.postgres is not None:
            self.postgres.stop()


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of :meth:`ProductionTopology.from_args` (this module's command and ``bench.production``)."""
    parser.add_argument("--brokers", default="kafka,sqs,pubsub,redis", help="comma-separated: " + ",".join(STREAMS))
    parser.add_argument("--spark", choices=("standalone", "local"), default="standalone")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=None,
        help="the watchers' batch_timeout (default: the trigger's, 0.5 s); each watcher stores at least one "
        "event per batch_timeout and lane (Kafka partition) while orders flow",
    )
    parser.add_argument(
        "--max-payload-bytes",
        type=int,
        default=None,
        help="the watchers' max_payload_bytes (default: the trigger's, 64 KiB): a batch is cut before it",
    )
    parser.add_argument(
        "--upstream-kafka",
        action="store_true",
        help="also the latency pair: upstream's Kafka stream and ours, one watcher and one light task each",
    )
    parser.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="without the example Dags: only the latency pair (requires --upstream-kafka and kafka)",
    )
    parser.add_argument(
        "--more-watchers",
        type=int,
        default=0,
        help="that many more watchers (one-task consumer Dags) on the example Kafka stream: 6 make 10",
    )
    parser.add_argument(
        "--ha", choices=("kafka-ha", "recipe"), default=None, help="how the two triggerers share watchers"
    )
    parser.add_argument(
        "--consumer-pool-slots",
        type=int,
        default=None,
        help="run the light consumer Dags' tasks in a pool of this many slots (default: Airflow's default_pool)",
    )
    parser.add_argument(
        "--xcom-object-storage-threshold",
        type=int,
        default=XCOM_OBJECT_STORAGE_THRESHOLD,
        help="XComs of this many bytes or more go to files (Airflow's object-storage XCom backend; 0: every "
        "one); negative: Airflow's default backend, every XCom in the metadata DB",
    )
    parser.add_argument(
        "--kafka-storage",
        choices=("memory", "s3"),
        default="memory",
        help="Tansu's storage; s3 (a local moto server) keeps its data over restart-broker",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devkit.production", description=__doc__.split("\n\n")[0])
    add_topology_arguments(parser)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary directory")
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a ``finally`` stops the topology."""
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shared-stream-production-"))

    interrupt_on_sigterm()
    topology = ProductionTopology.from_args(args, args.brokers.split(","), workdir)
    try:
        print("starting the production topology ...", flush=True)
        topology.start()
        print(topology.describe(), flush=True)
        print("running; Ctrl-C stops everything", flush=True)
        while True:
            topology.env.check_alive()
            time.sleep(5)
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    finally:
        topology.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
