"""Benchmarks: scripts that print tables (python -m bench.<name>); not tests."""
