"""The cross-broker contract, run against Google's Pub/Sub emulator (or PUBSUB_EMULATOR_HOST)."""

from __future__ import annotations

import pytest

from tests.integration.contract import ContractSuite

pytestmark = [pytest.mark.integration, pytest.mark.pubsub]


class TestPubSubContract(ContractSuite):
    settle_timeout = 60.0
