"""Benchmarks and load generation."""
