"""Benchmarks that print tables (``kvfast bench ...``). Speed is measured here, never in the tests."""
