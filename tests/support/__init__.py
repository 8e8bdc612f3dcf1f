"""Helpers shared by the test suites: engine launchers, HTTP and ZMQ clients."""
