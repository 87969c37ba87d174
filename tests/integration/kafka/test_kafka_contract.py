"""The cross-broker contract, against a real Kafka-protocol broker."""

from __future__ import annotations

import pytest

from tests.integration.contract import ContractSuite

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


class TestKafkaContract(ContractSuite):
    pass
