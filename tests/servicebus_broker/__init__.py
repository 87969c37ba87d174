"""A wire-level Azure Service Bus-compatible AMQP 1.0 broker for integration tests.

Modules: ``codec`` (AMQP type system), ``frames`` (framing, performatives), ``message`` (stored
messages and batches), ``entities`` (queues / topics / subscriptions / dead-letter queues),
``management`` (``$cbs`` and ``$management`` nodes), ``connection`` (one AMQP connection:
sessions, links, flow control, settlement), ``broker`` (registry, dispatch, lock timers, stats,
``start_broker()`` / ``BrokerHandle``), ``fixtures`` (the ``servicebus_broker`` pytest fixture).

Pure asyncio, no third-party dependency; tested against azure-servicebus 7.15 (``aio``).
"""
