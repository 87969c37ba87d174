"""The cross-broker contract, run against a real redis-server (or REDIS_URL)."""

from __future__ import annotations

import pytest

from tests.integration.contract import ContractSuite

pytestmark = [pytest.mark.integration, pytest.mark.redis]


class TestRedisContract(ContractSuite):
    settle_timeout = 60.0
