"""
SQS integration fixtures: a real SQS-compatible HTTP endpoint and a fresh queue pair per test.

By default the SQS kit (``devkit.kits.sqs.SqsKit``) starts moto's ThreadedMotoServer on a free
loopback port for the session. With ``SQS_ENDPOINT_URL`` set (LocalStack, ElasticMQ, or
``https://sqs.<region>.amazonaws.com``) no server is started and the tests run against that
endpoint with the default AWS credential chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
profile) and ``AWS_DEFAULT_REGION``.

Queue state is always asserted through a client independent of the producer under test: the kit
stream's (boto3, from a worker thread), or the async aiobotocore client of the SQS-only tests.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
from aiobotocore.session import get_session

from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger
from devkit.kits.sqs import ENDPOINT_ENV, SqsKit, SqsOrders, original_bytes
from tests.integration.contract import KitAdapter, cleaned_up
from tests.integration.faults_harness import set_connection

CONN_ID = "aws_shared_stream_sqs_it"
REGION = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
REAL_ENDPOINT = os.environ.get(ENDPOINT_ENV)


@pytest.fixture(scope="session")
def sqs_kit() -> Iterator[SqsKit]:
    """The SQS kit: SQS_ENDPOINT_URL's endpoint (default credential chain), else a moto server started here."""
    with SqsKit(own=False, region=REGION, credential_chain=True) as kit:
        yield kit


@pytest.fixture(scope="session")
def sqs_endpoint(sqs_kit: SqsKit) -> str:
    """The endpoint under test (never skipped)."""
    return sqs_kit.endpoint


@pytest.fixture
def sqs_connection(sqs_kit: SqsKit, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow ``aws`` connection (env var) pointing at the endpoint; returns its conn id."""
    return set_connection(monkeypatch, CONN_ID, sqs_kit.connection())


@pytest.fixture
async def sqs_client(sqs_kit: SqsKit) -> AsyncIterator[Any]:
    """The independent async client of the SQS-only inspections."""
    async with get_session().create_client("sqs", **sqs_kit.client_kwargs()) as client:
        yield client


class SqsAdapter(KitAdapter[SqsOrders, SqsSharedStreamTrigger]):
    """
    :class:`tests.integration.contract.BrokerAdapter` for SQS (plus helpers for SQS-only tests) over
    the kit's queue pair: creation, publishing, counts, dead letters and deletion are the kit's. The
    async ``client`` is kept for the calls only SQS-only tests make.
    """

    broker = "sqs"
    trigger_class = SqsSharedStreamTrigger
    quick: ClassVar[dict[str, Any]] = {"wait_time_seconds": 1, "visibility_timeout": 10}

    def __init__(self, client: Any, conn_id: str, kit: SqsOrders) -> None:
        super().__init__(kit, conn_id)
        self.client = client
        self.queue_url = kit.queue_url
        self.dlq_url = kit.dlq_url

    @classmethod
    async def fresh(
        cls, client: Any, conn_id: str, endpoint: str, *, region: str = REGION, moto_key: bool = True, **queues: Any
    ) -> SqsAdapter:
        """A fresh queue (a random name) and its dead-letter queue at ``endpoint`` (``queues``: SqsOrders' options)."""
        name = f"it-{uuid.uuid4().hex[:12]}"
        kit = await asyncio.to_thread(SqsOrders, endpoint, name, f"{name}-dlq", region, moto_key=moto_key, **queues)
        return cls(client, conn_id, kit)

    def trigger_options(self) -> dict[str, Any]:
        return {"aws_conn_id": self.conn_id, "dlq_queue_url": self.dlq_url}

    async def publish(
        self,
        bodies: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        group_id: str | None = None,
        message_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``attributes``: String attributes; ``message_attributes``: SQS's own shape (any DataType). In order."""
        shaped: dict[str, Mapping[str, Any]] = {
            name: {"DataType": "String", "StringValue": value} for name, value in (attributes or {}).items()
        }
        shaped.update(message_attributes or {})
        entries = [self.kit.entry(body, message_attributes=shaped, group_id=group_id) for body in bodies]
        await self.in_thread(self.kit.send_batch, entries)

    async def counts(self, queue_url: str | None = None) -> tuple[int, int]:
        """(visible, in flight) as SQS reports them."""
        return await self.in_thread(self.kit.counts, queue_url)

    async def dead_letter_messages(self) -> list[dict[str, Any]]:
        """Every DLQ message (body and attributes), left in the DLQ: hidden while listed, then released."""
        return await self.in_thread(self.kit.dead_letter_messages)

    async def dead_lettered(self) -> list[bytes]:
        return [original_bytes(m) for m in await self.dead_letter_messages()]

    async def cleanup(self) -> None:
        """Delete the queue and its dead-letter queue (the kit stream's client closed)."""
        await self.in_thread(self.kit.delete)


@pytest.fixture
async def make_adapter(sqs_client: Any, sqs_connection: str, sqs_kit: SqsKit) -> AsyncIterator[Any]:
    """Factory: ``await make_adapter(**queues)`` gives a fresh queue pair (SqsOrders' options), deleted afterwards."""

    async def make(**queues: Any) -> SqsAdapter:
        endpoint, region, moto_key = sqs_kit.endpoint, sqs_kit.region, sqs_kit.moto_key
        return await SqsAdapter.fresh(sqs_client, sqs_connection, endpoint, region=region, moto_key=moto_key, **queues)

    async with cleaned_up(make) as tracked:
        yield tracked


@pytest.fixture
async def adapter(make_adapter: Any) -> SqsAdapter:
    """A fresh standard queue + DLQ queue for one test, deleted afterwards."""
    return await make_adapter(visibility=30)  # type: ignore[no-any-return]


@pytest.fixture
async def fifo_adapter(make_adapter: Any) -> SqsAdapter:
    """A fresh FIFO queue + FIFO DLQ for one test."""
    return await make_adapter(fifo=True, visibility=30)  # type: ignore[no-any-return]
