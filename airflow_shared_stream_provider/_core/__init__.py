"""Broker-independent core: envelope, filters, dispositions, flow control, leases, base classes.

No broker SDK is imported anywhere in this package.
"""
