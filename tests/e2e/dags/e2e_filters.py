"""A filter function with a bug, for the end-to-end tests (imported by the triggerer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def explode_on_poison(envelope: Mapping[str, Any]) -> bool:
    """Fire on ``priority == "high"`` orders; raise on orders flagged ``"poison": true``."""
    body = envelope.get("body")
    if isinstance(body, dict) and body.get("poison") is True:
        raise ValueError(f"cannot score order {body.get('order_id')!r}")
    return isinstance(body, dict) and body.get("priority") == "high"
