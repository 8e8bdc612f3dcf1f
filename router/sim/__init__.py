"""The cluster simulator: kvroute simulate and kvroute plan (docs/simulator.md)."""
