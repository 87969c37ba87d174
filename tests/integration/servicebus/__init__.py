"""Service Bus integration tests (test broker, or SERVICEBUS_CONNECTION_STRING)."""
