"""The cross-broker contract, run against a real SQS-compatible endpoint (moto, or SQS_ENDPOINT_URL)."""

from __future__ import annotations

import pytest

from tests.integration.contract import ContractSuite

pytestmark = [pytest.mark.integration, pytest.mark.sqs]


class TestSqsContract(ContractSuite):
    settle_timeout = 60.0
