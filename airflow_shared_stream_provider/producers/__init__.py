"""Shared-stream producers, one module per broker. Each imports its broker SDK."""
