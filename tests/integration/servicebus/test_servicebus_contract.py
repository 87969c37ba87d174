"""The cross-broker contract, against the Service Bus test broker (or SERVICEBUS_CONNECTION_STRING)."""

from __future__ import annotations

import pytest

from tests.integration.contract import ContractSuite

pytestmark = [pytest.mark.integration, pytest.mark.servicebus]


class TestServiceBusContract(ContractSuite):
    settle_timeout = 30.0
