"""Pytest fixture for the Service Bus test broker (import it from a conftest).

Usage::

    from tests.servicebus_broker.fixtures import servicebus_broker  # noqa: F401 (in conftest.py)

    async def test_x(servicebus_broker: BrokerHandle) -> None:
        servicebus_broker.create_queue("orders", lock_duration=2, max_delivery_count=3)
        async with ServiceBusClient.from_connection_string(servicebus_broker.connection_string) as c:
            ...
        assert servicebus_broker.counts("orders").active == 0

The fixture starts one broker per test (start-up takes a few milliseconds), stops it afterwards,
and fails the test if the broker recorded any error while serving it (``handle.errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .broker import BrokerHandle, start_broker

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def servicebus_broker() -> Iterator[BrokerHandle]:
    """A running broker on 127.0.0.1 with no entities; errors fail the test at teardown."""
    handle = start_broker()
    try:
        yield handle
    finally:
        errors = handle.errors
        handle.stop()
    if errors:
        pytest.fail(
            "servicebus test broker recorded errors:\n" + "\n".join(str(error) for error in errors), pytrace=False
        )
