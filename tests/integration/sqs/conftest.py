"""
SQS integration fixtures: a real SQS-compatible HTTP endpoint and a fresh queue pair per test.

By default moto's ThreadedMotoServer is started on a free loopback port for the session. With
``SQS_ENDPOINT_URL`` set (LocalStack, ElasticMQ, or ``https://sqs.<region>.amazonaws.com``) no
server is started and the tests run against that endpoint with the default AWS credential chain
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / profile) and ``AWS_DEFAULT_REGION``.

Queue state is always asserted through an independent aiobotocore client, never through the
producer under test.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiobotocore.session import get_session

from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
from devkit.brokers import start_moto, stop_moto

CONN_ID = "aws_shared_stream_sqs_it"
REGION = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
REAL_ENDPOINT = os.environ.get("SQS_ENDPOINT_URL")
TRANSFER_ENCODING = "content-transfer-encoding"


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """The endpoint under test: SQS_ENDPOINT_URL, else a moto server started here (never skipped)."""
    if REAL_ENDPOINT:
        yield REAL_ENDPOINT
        return
    handle = start_moto()
    try:
        yield handle.address
    finally:
        stop_moto(handle)


def client_kwargs(endpoint: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"region_name": REGION, "endpoint_url": endpoint}
    if not REAL_ENDPOINT:
        kwargs.update(aws_access_key_id="testing", aws_secret_access_key="testing")
    return kwargs


@pytest.fixture
def sqs_connection(sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow ``aws`` connection (env var) pointing at the endpoint; returns its conn id."""
    conn: dict[str, Any] = {"conn_type": "aws", "extra": {"region_name": REGION, "endpoint_url": sqs_endpoint}}
    if not REAL_ENDPOINT:
        conn.update(login="testing", password="testing")
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(conn))
    return CONN_ID


@pytest.fixture
async def sqs_client(sqs_endpoint: str) -> AsyncIterator[Any]:
    """The independent client tests assert queue state with."""
    async with get_session().create_client("sqs", **client_kwargs(sqs_endpoint)) as client:
        yield client


def sqs_body(body: bytes) -> tuple[str, dict[str, Any]]:
    """SQS bodies are text: bytes that are not valid SQS text go as base64 + a transfer-encoding attribute."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c in "\t\n\r" or " " <= c <= "\ud7ff" or c >= "\ue000" for c in text):
        return text, {}
    encoded = base64.b64encode(body).decode("ascii")
    return encoded, {TRANSFER_ENCODING: {"DataType": "String", "StringValue": "base64"}}


def original_bytes(message: Mapping[str, Any]) -> bytes:
    attributes = message.get("MessageAttributes") or {}
    if attributes.get(TRANSFER_ENCODING, {}).get("StringValue") == "base64":
        return base64.b64decode(message["Body"])
    return str(message["Body"]).encode("utf-8")


@dataclass
class SqsAdapter:
    """:class:`tests.integration.contract.BrokerAdapter` for SQS (plus helpers for SQS-only tests)."""

    client: Any
    conn_id: str
    queue_url: str
    dlq_url: str
    trigger_defaults: dict[str, Any] = field(default_factory=dict)
    broker: str = "sqs"

    def make_trigger(self, **kwargs: Any) -> SqsSharedStreamTrigger:
        options: dict[str, Any] = {
            "queue_url": self.queue_url,
            "aws_conn_id": self.conn_id,
            "dlq_queue_url": self.dlq_url,
            "wait_time_seconds": 1,
            "visibility_timeout": 10,
            **self.trigger_defaults,
        }
        options.update(kwargs)
        return SqsSharedStreamTrigger(**options)

    async def publish(
        self,
        bodies: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        group_id: str | None = None,
        message_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``attributes``: String attributes; ``message_attributes``: SQS's own shape (any DataType)."""
        entries: list[dict[str, Any]] = []
        for index, body in enumerate(bodies):
            text, extra = sqs_body(body)
            entry_attributes = {
                name: {"DataType": "String", "StringValue": value} for name, value in (attributes or {}).items()
            }
            entry_attributes.update({name: dict(value) for name, value in (message_attributes or {}).items()})
            entry_attributes.update(extra)
            entry: dict[str, Any] = {"Id": str(index), "MessageBody": text}
            if entry_attributes:
                entry["MessageAttributes"] = entry_attributes
            if group_id is not None:
                entry["MessageGroupId"] = group_id
                entry["MessageDeduplicationId"] = uuid.uuid4().hex
            entries.append(entry)
        # One batch at a time, in order, so the queue holds them in publish order.
        for start in range(0, len(entries), 10):
            chunk = [{**e, "Id": str(i)} for i, e in enumerate(entries[start : start + 10])]
            response = await self.client.send_message_batch(QueueUrl=self.queue_url, Entries=chunk)
            assert not response.get("Failed"), response["Failed"]

    async def counts(self, queue_url: str | None = None) -> tuple[int, int]:
        """(visible, in flight) as SQS reports them."""
        response = await self.client.get_queue_attributes(
            QueueUrl=queue_url or self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )
        attrs = response["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])

    async def unsettled(self) -> int:
        visible, in_flight = await self.counts()
        return visible + in_flight

    async def dead_letter_messages(self) -> list[dict[str, Any]]:
        """Every DLQ message (body and attributes), left in the DLQ: hidden while listed, then released."""
        seen: dict[str, dict[str, Any]] = {}
        while True:
            response = await self.client.receive_message(
                QueueUrl=self.dlq_url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=0,
                VisibilityTimeout=30,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
            )
            messages = response.get("Messages") or []
            if not messages:
                break
            for message in messages:
                seen[message["MessageId"]] = message
        handles = [m["ReceiptHandle"] for m in seen.values()]
        for start in range(0, len(handles), 10):
            await self.client.change_message_visibility_batch(
                QueueUrl=self.dlq_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": h, "VisibilityTimeout": 0}
                    for i, h in enumerate(handles[start : start + 10])
                ],
            )
        return list(seen.values())

    async def dead_lettered(self) -> list[bytes]:
        return [original_bytes(m) for m in await self.dead_letter_messages()]


async def create_queue_pair(client: Any, *, fifo: bool = False, visibility: int = 30) -> tuple[str, str]:
    name = f"it-{uuid.uuid4().hex[:12]}"
    suffix = ".fifo" if fifo else ""
    attributes = {"VisibilityTimeout": str(visibility)}
    if fifo:
        attributes["FifoQueue"] = "true"
    queue = await client.create_queue(QueueName=name + suffix, Attributes=attributes)
    dlq = await client.create_queue(QueueName=name + "-dlq" + suffix, Attributes=dict(attributes))
    return queue["QueueUrl"], dlq["QueueUrl"]


@pytest.fixture
async def adapter(sqs_client: Any, sqs_connection: str) -> AsyncIterator[SqsAdapter]:
    """A fresh standard queue + DLQ queue for one test, deleted afterwards."""
    queue_url, dlq_url = await create_queue_pair(sqs_client)
    try:
        yield SqsAdapter(sqs_client, sqs_connection, queue_url, dlq_url)
    finally:
        for url in (queue_url, dlq_url):
            await sqs_client.delete_queue(QueueUrl=url)


@pytest.fixture
async def fifo_adapter(sqs_client: Any, sqs_connection: str) -> AsyncIterator[SqsAdapter]:
    """A fresh FIFO queue + FIFO DLQ for one test."""
    queue_url, dlq_url = await create_queue_pair(sqs_client, fifo=True)
    try:
        yield SqsAdapter(sqs_client, sqs_connection, queue_url, dlq_url)
    finally:
        for url in (queue_url, dlq_url):
            await sqs_client.delete_queue(QueueUrl=url)
