"""Shared-stream triggers, one module per broker. None imports a broker SDK."""
