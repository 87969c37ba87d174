"""Provider metadata for Airflow's ProvidersManager (entry point ``apache_airflow_provider``)."""

# NOTE: THIS FILE IS GENERATED FROM provider.yaml AND WILL BE OVERWRITTEN.
# Edit provider.yaml at the repository top level, then run: python -m scripts.provider_info
# (scripts/test.sh runs it with --check, which fails when this file and provider.yaml differ).

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-shared-stream-provider",
        "name": "Shared Stream",
        "description": (
            "Shared-stream AssetWatcher triggers for Kafka, AWS SQS, Google Pub/Sub and Azure Service Bus:\n"
            "many watchers share one broker connection, and a message is committed only after every\n"
            "watcher's events are persisted in the metadata DB.\n"
        ),
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "Shared Stream Kafka",
                "external-doc-url": "https://kafka.apache.org/",
                "tags": ["software"],
            },
            {
                "integration-name": "Shared Stream Amazon SQS",
                "external-doc-url": "https://aws.amazon.com/sqs/",
                "tags": ["aws"],
            },
            {
                "integration-name": "Shared Stream Google Pub/Sub",
                "external-doc-url": "https://cloud.google.com/pubsub",
                "tags": ["gcp"],
            },
            {
                "integration-name": "Shared Stream Azure Service Bus",
                "external-doc-url": "https://azure.microsoft.com/products/service-bus",
                "tags": ["azure"],
            },
            {
                "integration-name": "Shared Stream Redis Streams",
                "external-doc-url": "https://redis.io/docs/latest/develop/data-types/streams/",
                "tags": ["software"],
            },
        ],
        "triggers": [
            {
                "integration-name": "Shared Stream Kafka",
                "python-modules": ["airflow_shared_stream_provider.triggers.kafka"],
            },
            {
                "integration-name": "Shared Stream Amazon SQS",
                "python-modules": ["airflow_shared_stream_provider.triggers.sqs"],
            },
            {
                "integration-name": "Shared Stream Google Pub/Sub",
                "python-modules": ["airflow_shared_stream_provider.triggers.pubsub"],
            },
            {
                "integration-name": "Shared Stream Azure Service Bus",
                "python-modules": ["airflow_shared_stream_provider.triggers.servicebus"],
            },
            {
                "integration-name": "Shared Stream Redis Streams",
                "python-modules": ["airflow_shared_stream_provider.triggers.redis"],
            },
        ],
        "queues": [
            "airflow_shared_stream_provider.queues.KafkaSharedStreamQueueProvider",
            "airflow_shared_stream_provider.queues.SqsSharedStreamQueueProvider",
            "airflow_shared_stream_provider.queues.PubSubSharedStreamQueueProvider",
            "airflow_shared_stream_provider.queues.ServiceBusSharedStreamQueueProvider",
            "airflow_shared_stream_provider.triggers.redis.RedisSharedStreamQueueProvider",
        ],
        "config": {
            "shared_stream_provider": {
                "description": (
                    "Settings of the shared-stream producers that describe the triggerer deployment, not a Dag.\n"
                ),
                "options": {
                    "cohort_settle": {
                        "description": (
                            "Seconds a new shared stream waits, before its first receive, for no more sibling watcher\n"
                            "to subscribe (a triggerer takes at most 50 new triggers per loop, about one per second).\n"
                            "Not waited when every watcher recorded in the stream's cohort record is back.\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "3.0",
                    },
                    "cohort_max_wait": {
                        "description": (
                            "Most seconds a new shared stream waits for the watchers of its cohort record (those of\n"
                            "its last formation) before reading without the missing ones, which it then forgets. Also\n"
                            "the most seconds a queue broker's stream (SQS, Pub/Sub, Redis, Service Bus) stops "
                            "reading\n"
                            "for a watcher the triggerer force-failed (ack timeout, full queue) until it is "
                            "re-created.\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "60.0",
                    },
                    "cohort_record": {
                        "description": (
                            "Keep each stream's cohort record (its watchers) in the watchers' asset state stores, so "
                            "a\n"
                            "restarted triggerer waits for every one of them. Its first use makes the triggerer's\n"
                            "supervisor build Airflow's in-process Execution API (about 80 MB more memory, once).\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": None,
                        "default": "True",
                    },
                    "position_interval": {
                        "description": (
                            "Seconds between writes of each Kafka watcher's position to its asset state store\n"
                            '(``position_store="watchers"``). A crash replays at most this much per watcher '
                            "(duplicates,\n"
                            "never loss); each write is one state-store call per watcher.\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "5.0",
                    },
                    "late_join_lookback": {
                        "description": (
                            'Kafka (``position_store="watchers"``): where a watcher without a stored position starts '
                            "when\n"
                            "it joins a running stream, in seconds back: at the position the stream had that long "
                            "ago.\n"
                            "Such a watcher may be one whose triggerer died before its first position write, with\n"
                            "messages received and not persisted; starting at the read end lost those. A brand-new\n"
                            "watcher may fire for up to this much history. 0: start at the read end. Also how far\n"
                            "before it left a watcher starts that comes back as a new trigger (its Dag paused and\n"
                            "unpaused: Airflow stores the events it fired after dropping its trigger for no asset).\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "300.0",
                    },
                    "heartbeat_interval": {
                        "description": (
                            "Seconds between a stream's heartbeats in its watchers' asset state stores, read to "
                            "detect\n"
                            "a stream split across triggerers (an ERROR for queues, whose consumers compete). 0 turns\n"
                            "the detection off.\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "30.0",
                    },
                },
            }
        },
    }
