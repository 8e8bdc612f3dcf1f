"""Engines: identity, load accounting, health, registry."""
