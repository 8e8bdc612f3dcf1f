"""kvroute: a cache-aware request router for disaggregated LLM inference fleets."""

__version__ = "0.1.0"
